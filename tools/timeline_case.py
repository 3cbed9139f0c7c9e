"""When each kernel of one call starts, gets past its programmatic-launch wait and ends, replayed in a
CUDA graph as SGLang runs verify (a profiling aid for a TIMELINE build: tools/README.md).

    python tools/timeline_case.py 131072 1 8192 9     # (prefix, N) pairs, H=16
    python tools/timeline_case.py --separate-mask 131072 9   # the mask packed by its own kernel first
    python tools/timeline_case.py --kv e4m3 131072 1          # on an e4m3 pool (the FP8 kernels)

The combine kernel's last block prints one line per call: for mask pack, plan, split and combine the
microseconds from the call's first kernel start to (first block start, first block past
griddepcontrol.wait, last block end); each replay runs alone (synchronised), KV partly in L2.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import verify_call  # noqa: E402

argv = sys.argv[1:]
separate = "--separate-mask" in argv
kv = "bf16"
if "--kv" in argv:
    i = argv.index("--kv")
    kv = argv[i + 1]
    del argv[i:i + 2]
args = [int(a) for a in argv if a != "--separate-mask"] or [131072, 1, 8192, 9]
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
