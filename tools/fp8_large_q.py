"""The error of the e4m3 kernels as the queries grow: the inputs of tests/test_fp8_gpu.py's
test_large_and_small_queries (prefixes [3000, 17], H16, N9 and N1; q times 1, 30, 1e3), relative L2 of the output
against the float32 reference on the dequantised pool, one line per shape and scale with the split kernel that ran.
Under KDTREE_SPLIT_STAGES=2 the sm_120 code path (its stand-in MMA) runs instead of the wgmma kernels.

    python tools/fp8_large_q.py
    KDTREE_SPLIT_STAGES=2 python tools/fp8_large_q.py
"""
import torch

import kdtree
from kdtree import _ext
from kdtree.reference import verify_attention_reference
from kdtree.synthetic import make_verify_batch

ext = _ext.load()
for h, n in [(16, 9), (16, 1)]:
    for qs in [1.0, 30.0, 1e3]:
        b = make_verify_batch([3000, 17], h, n, kind="tree", device="cuda", seed=int(qs * 10) + 1 + n,
                              kv_dtype=torch.float8_e4m3fn)
        b.q = (b.q.float() * qs).to(torch.bfloat16)
        a = b.verify_args()
        out = kdtree.verify_attention(**a)
        ref = verify_attention_reference(**a)
        e = float((out.double() - ref.double()).norm() / ref.double().norm())
        print(f"{ext.split_kernel(2, 2 * n, h, ext.KV_E4M3):18s} H{h} N{n} qscale {qs:g}: rel {e:.2e}", flush=True)
