"""The error of the e4m3 kernels as the queries grow, over several inputs: prefixes [3000, 17] (the inputs of
tests/test_fp8_gpu.py's large-query test, with other seeds), H16 N9 and N1, q times 1, 30 and 1e3; relative L2 of the
output against the float32 reference on the dequantised pool. One line per shape and scale: the split kernel that
ran, the median and the largest error over the inputs, and the median of SGLang's fp8 numerics on the same inputs
(tests/fp8_model.py, on the CPU). Under KDTREE_SPLIT_STAGES=2 the sm_120 code path (its stand-in MMA) runs instead of
the wgmma kernels.

    python tools/fp8_large_q.py [--inputs 8]
    KDTREE_SPLIT_STAGES=2 python tools/fp8_large_q.py
"""
import argparse
import os
import statistics
import sys

import torch

import kdtree
from kdtree import _ext
from kdtree.reference import verify_attention_reference
from kdtree.synthetic import make_verify_batch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from fp8_model import sglang_fp8  # noqa: E402


def rel(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=8, help="inputs (seeds) per shape and scale")
    args = ap.parse_args()
    ext = _ext.load()
    for h, n in [(16, 9), (16, 1)]:
        for qs in [1.0, 30.0, 1e3]:
            mine, theirs = [], []
            for i in range(args.inputs):
                b = make_verify_batch([3000, 17], h, n, kind="tree", device="cuda", seed=1000 * i + int(qs),
                                      kv_dtype=torch.float8_e4m3fn)
                b.q = (b.q.float() * qs).to(torch.bfloat16)
                a = b.verify_args()
                ref = verify_attention_reference(**a)
                mine.append(rel(kdtree.verify_attention(**a), ref))
                cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
                sg = sglang_fp8(b.q.cpu(), cpu["kv_cache"], cpu["kv_indptr"], cpu["kv_indices"], cpu["qo_indptr"],
                                cpu["k_new"], cpu["tree_mask"], cpu["sm_scale"])
                theirs.append(rel(sg, ref.cpu()))
            print(f"{ext.split_kernel(2, 2 * n, h, ext.KV_E4M3):18s} H{h} N{n} qscale {qs:<6g} kdtree median "
                  f"{statistics.median(mine):.1e} max {max(mine):.1e} | SGLang's numerics median "
                  f"{statistics.median(theirs):.1e} ({args.inputs} inputs)", flush=True)


if __name__ == "__main__":
    main()
