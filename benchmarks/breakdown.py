"""Device time of each kernel in one kdtree call (mask rebuild, plan, split, combine), per shape.

    python benchmarks/breakdown.py [P:N:H ...]      (default: 8192:9:16 131072:9:16 131072:1:16)
Runs the bench's call eagerly under torch.profiler (CUPTI kernel records) and prints, per kernel
name, the mean device microseconds over the profiled calls, then the sum and the CUDA-graph replay
time of the same call: the difference is launch gaps between the kernels inside the graph.
The kernels are launched plainly (KDTREE_PDL=0 unless set): with programmatic dependent launch each kernel starts
early and waits for the one before it, and the profiler counts that wait as its time (session 16: the combine
"took" 44-57 us). The graph replay is then without PDL too (a few us slower than the benchmark's).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("KDTREE_PDL", "0")   # before kdtree reads it (once per device)
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench import verify_call  # benchmarks/bench.py: the same batch and call as the benchmark


def one(prefix: int, n: int, heads: int, calls: int = 20) -> None:
    _, _, call, _ = verify_call([prefix], heads, n, seed=3)

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    per = defaultdict(float)
    count = defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            per[e.name] += e.device_time_total
            count[e.name] += 1
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    from triton.testing import do_bench
    graph_us = do_bench(g.replay, warmup=50, rep=300, return_mode="median") * 1e3
    print(f"-- P{prefix} N{n} H{heads}: per call (mean of {calls})")
    total = 0.0
    for name, us in sorted(per.items(), key=lambda kv_: -kv_[1]):
        total += us / calls
        short = name if len(name) < 70 else name[:67] + "..."
        print(f"   {us / calls:8.1f} us  x{count[name] / calls:.0f}  {short}")
    print(f"   {total:8.1f} us  sum of kernels; graph replay {graph_us:.1f} us (gaps {graph_us - total:.1f} us)")


def main(argv):
    cases = argv or ["8192:9:16", "131072:9:16", "131072:1:16"]
    for c in cases:
        p, n, h = (int(x) for x in c.split(":"))
        one(p, n, h)


if __name__ == "__main__":
    main(sys.argv[1:])
