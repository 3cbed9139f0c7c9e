"""When each kernel of one call starts, gets past its programmatic-launch wait and ends, replayed in a
CUDA graph as SGLang runs verify (a profiling aid for a TIMELINE build: tools/README.md).

    python tools/timeline_case.py 131072 1 8192 9     # (prefix, N) pairs, H=16
    python tools/timeline_case.py --separate-mask 131072 9   # the mask packed by its own kernel first
    python tools/timeline_case.py --kv e4m3 131072 1          # on an e4m3 pool (the FP8 kernels)

The combine kernel's last block prints one line per call: for mask pack, plan, split and combine the
microseconds from the call's first kernel start to (first block start, first block past
griddepcontrol.wait, last block end); each replay runs alone (synchronised), KV partly in L2.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import verify_call  # noqa: E402

ap = argparse.ArgumentParser(description="per-kernel timeline of one call (a TIMELINE build)")
ap.add_argument("pairs", nargs="*", type=int, default=[131072, 1, 8192, 9], help="prefix, N pairs (H=16)")
ap.add_argument("--separate-mask", action="store_true", help="the mask packed by its own kernel first")
ap.add_argument("--kv", choices=["bf16", "e4m3"], default="bf16", help="the pool's element type")
a = ap.parse_args()
separate, kv, args = a.separate_mask, a.kv, a.pairs
for p, n in zip(args[0::2], args[1::2]):
    b, out, kd, _ = verify_call([p], 16, n, 3, separate_mask=separate, kv=kv)
    kd()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kd()
    print(f"=== P{p} N{n} {kv}{' (mask packed separately)' if separate else ''}: three graph replays", flush=True)
    for i in range(3):
        g.replay()
        torch.cuda.synchronize()
