"""Where a call's graph-replay time goes besides its kernels: L2 state and back-to-back replays (a profiling aid).

    python benchmarks/flush_case.py 131072:1 131072:9 8192:9      # prefix:N pairs, H=16

For each shape, the whole call (bench.py's verify_call) captured in a CUDA graph and timed four ways (us, medians):
  bench     triton's do_bench, as bench.py reports it (it clears L2 with a 256 MB write before every replay);
  flushed   one replay between CUDA events after the same 256 MB write, event pair around the replay only;
  warm      one replay between CUDA events right after another replay (no flush: the previous call's keys may be in L2);
  stream    N replays back to back between one event pair, divided by N (launch gaps between replays hidden).
flushed - warm is what a cold L2 costs; bench - flushed what the timing method adds.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench import bench_ms, verify_call  # noqa: E402


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def one(prefix: int, n: int, reps: int = 40) -> None:
    _, _, call, _ = verify_call([prefix], 16, n, seed=3)
    call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    g.replay()
    torch.cuda.synchronize()
    scratch = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(flush: bool) -> float:
        if flush:
            scratch.zero_()
        else:
            g.replay()
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) * 1e3

    flushed = median([timed(True) for _ in range(reps)])
    warm = median([timed(False) for _ in range(reps)])
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    stream = s.elapsed_time(e) * 1e3 / reps
    bench = bench_ms(g.replay, 300) * 1e3
    print(f"P{prefix} N{n} H16: bench {bench:7.1f} us | flushed {flushed:7.1f} | warm {warm:7.1f} | "
          f"stream {stream:7.1f} (per replay of {reps} back to back)", flush=True)


def main(argv):
    for c in argv or ["131072:1", "131072:9", "8192:9"]:
        p, n = (int(x) for x in c.split(":"))
        one(p, n)


if __name__ == "__main__":
    main(sys.argv[1:])
