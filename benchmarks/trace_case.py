"""Per-tile clock64 trace of the split kernel (build with -DKDTREE_EXP_TRACE; a profiling aid).

    KDTREE_EXPERIMENTS=TRACE ... (benchmarks/experiments.sh builds it), then
    python benchmarks/trace_case.py 131072 9     # prefix, N (H=16)
Blocks 0 and 1 print, for each work item, one line per 32-key tile: SM clocks since the item's
prologue ended when score warp 0 saw the keys land / passed P-empty / had S / published P, and when
value warp 0 passed P-full / had P V / passed the value barrier / had issued the refill.
"""
import sys

import torch

import kdtree
from kdtree.layout import build_tree_mask, kv_cache_2d, split_mla_q
from kdtree.synthetic import make_verify_batch

p = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
n = int(sys.argv[2]) if len(sys.argv) > 2 else 9
b = make_verify_batch([p], 16, n, kind="tree", device="cuda", seed=3, min_pool_slots=262_144, poison=False)
q_nope, q_pe = split_mla_q(b.q)
t = b.q.shape[0]
tree = build_tree_mask(b.custom_mask, b.mask_indptr, b.qo_indptr, b.kv_indptr, t, b.max_n)
args = dict(q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache_2d(b.kv_buffer), kv_indptr=b.kv_indptr,
            kv_indices=b.kv_indices, qo_indptr=b.qo_indptr, k_new=b.k[:, 0], tree_mask=tree, sm_scale=b.sm_scale)
for i in range(3):
    print(f"=== call {i} P={p} N={n}", flush=True)
    kdtree.verify_attention(**args)
    torch.cuda.synchronize()
