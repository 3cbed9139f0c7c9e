"""Host-side cost of one kdtree call (eager mode), split by stage: what a CUDA graph removes.

    python benchmarks/overhead.py
Prints microseconds of host time per call for the mask rebuild, verify_attention and both.
"""
import torch

import kdtree
from kdtree.layout import build_tree_mask, kv_cache_2d, split_mla_q
from kdtree.synthetic import make_verify_batch

from host_timing import host_us  # benchmarks/

b = make_verify_batch([8192], 16, 9, device="cuda", seed=0, poison=False)
t = b.q.shape[0]
q_nope, q_pe = split_mla_q(b.q)
kv = kv_cache_2d(b.kv_buffer)
out = torch.empty(t, 16, 512, dtype=torch.bfloat16, device="cuda")
tree = build_tree_mask(b.custom_mask, b.mask_indptr, b.qo_indptr, b.kv_indptr, t, b.max_n)


mask = lambda: build_tree_mask(b.custom_mask, b.mask_indptr, b.qo_indptr, b.kv_indptr, t, b.max_n)  # noqa: E731
attn = lambda: kdtree.verify_attention(q_nope, q_pe, kv, b.kv_indptr, b.kv_indices, b.qo_indptr, b.k[:, 0],  # noqa: E731
                                       tree, b.sm_scale, out=out)
print(f"host us per call: build_tree_mask {host_us(mask)[0]:.1f}, verify_attention {host_us(attn)[0]:.1f}, "
      f"both {host_us(lambda: (mask(), attn()))[0]:.1f}")
