"""Per-tile clock64 trace of the split kernel (build with -DKDTREE_EXP_TRACE; a profiling aid).

    KDTREE_EXPERIMENTS=TRACE ... (benchmarks/experiments.sh builds it), then
    python benchmarks/trace_case.py 131072 9     # prefix, N (H=16)
    python benchmarks/trace_case.py B8 9         # the benchmark's ragged batch (8 requests, 4k..64k)
Blocks 0 and 1 print, for each work item, one line per 32-key tile: SM clocks since the item's
prologue ended when score warp 0 saw the keys land / passed P-empty / had S / published P, and when
value warp 0 passed P-full / had P V / passed the value barrier / had issued the refill; in the dual kernel's lines two
more columns: score warp 0 issued S (past its waits for the tile and for the other warpgroup's maxima) / had the tile's
own row maxima (session 22; the wgmma kernel prints 0 there), and three more: value warp 0 had issued P V / had P V
done, the last value warp had issued its refill (session 23; in the producer form, session 26: the producer's copies
of the tile start / are issued in columns 7 and 13 instead); and three more (session 26, producer form): the producer
starts its wait for the tile's buffer, value warpgroup 1 (warp 12) had P V done, the producer's loop top for the
tile. The wgmma kernels (dual, wgmma,
skinny) keep their stamps in global memory and a one-thread kernel prints them after each call (since session 22: a
printf inside them made ptxas serialise their wgmma, so earlier traces timed a slower S than the real kernel's).
"""
import sys

import torch

import kdtree
from kdtree.synthetic import make_verify_batch

RAGGED = [4096, 65536, 12288, 40960, 8192, 57344, 20480, 32768]   # bench.py's "B8 ragged 4k..64k"
p = sys.argv[1] if len(sys.argv) > 1 else "131072"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 9
b = make_verify_batch(RAGGED if p == "B8" else [int(p)], 16, n, kind="tree", device="cuda", seed=3, min_pool_slots=262_144, poison=False)
args = b.verify_args()
for i in range(3):
    print(f"=== call {i} P={p} N={n}", flush=True)
    kdtree.verify_attention(**args)
    torch.cuda.synchronize()
