"""Host time per call of an eager function (benchmarks/overhead.py, benchmarks/layer_host.py)."""
import time

import torch


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, calls=300):
    """(host microseconds per call: the loop's wall time with no synchronisation inside it, microseconds per call
    until the GPU is done with the loop's work), after min(20, calls) warm-up calls."""
    for _ in range(min(20, calls)):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6
