"""Per-tile clock64 trace of the split kernel (a profiling aid for a TRACE build: tools/README.md).

    python tools/trace_case.py 131072 9     # prefix, N (H=16)
    python tools/trace_case.py B8 9         # the benchmark's ragged batch (8 requests, 4k..64k)
    python tools/trace_case.py 131072 9 e4m3   # on an e4m3 pool (the FP8 kernels; default bf16)
Three calls on the same batch (=== repeat 0, 1, 2). After each, blocks 0 and 1 (the dual kernel: block 0) print one line
per work item and one per 32-key tile of its first tiles (the dual kernel: of its first item): SM clocks since the item
started (the dual kernel: since score thread 0 started it) at each stamp the TRACE build records (the score side's tile
landed, S done, P published; the value side's P taken, P V issued and done, the buffer released; the producer's copies
started and issued), in the order the kernels number them where they take them (0 where a kernel takes none: the
dual kernel's FP8 form leaves its score side's loop top unstamped). The dual and skinny kernels add a line
for the start of block 0's first item (q issued and landed, the first tiles issued). The wgmma kernels keep their stamps
in global memory and a one-thread kernel prints them after the call (src/cuda/verify_profiling.cuh): a printf inside a
kernel is a function call, across which ptxas serialises every wgmma (tests/test_ptxas.py checks the TRACE build for
that).
"""
import sys

import torch

import kdtree
from kdtree.synthetic import make_verify_batch

RAGGED = [4096, 65536, 12288, 40960, 8192, 57344, 20480, 32768]   # bench.py's "B8 ragged 4k..64k"
p = sys.argv[1] if len(sys.argv) > 1 else "131072"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 9
kv = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}[sys.argv[3] if len(sys.argv) > 3 else "bf16"]
b = make_verify_batch(RAGGED if p == "B8" else [int(p)], 16, n, kind="tree", device="cuda", seed=3,
                      min_pool_slots=262_144, poison=False, kv_dtype=kv)
args = b.verify_args()
for i in range(3):
    print(f"=== repeat {i} P={p} N={n}", flush=True)
    kdtree.verify_attention(**args)
    torch.cuda.synchronize()
