"""Digests of kdtree's output on the benchmark shapes, for comparing two builds bit for bit (a GPU machine).

    python tools/output_digest.py > a.txt                       # the installed build
    PYTHONPATH=/tmp/kd_ab0 python tools/output_digest.py > b.txt # a variant (tools/ab_variants.sh)
    diff a.txt b.txt && echo bit-identical
    python tools/output_digest.py --kv e4m3 --only "H16 N1,H8 N4"  # an e4m3 pool, the shapes naming either

Every shape of benchmarks/bench.py (--small-rows included) on the same seeded inputs; one line per shape: its name, the
SHA-256 of the output's bytes, and the relative L2 error against the float32 reference of the first call (which says the
digest is of a correct output, not only of an equal one). A second call on the same inputs must give the same bytes
(determinism); a shape whose two calls differ says so.
"""
import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench import KV_DTYPES, batch_kwargs, shapes, verify_call  # noqa: E402

from kdtree.reference import verify_attention_reference  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated substrings of the shape names to digest (default all)")
    ap.add_argument("--kv", choices=sorted(KV_DTYPES), default="bf16", help="the pool's KV dtype")
    args = ap.parse_args()
    only = [o for o in args.only.split(",") if o]
    for s in shapes(quick=False, small_rows=True):
        if only and not any(o in s["name"] for o in only):
            continue
        b, out, kd, _ = verify_call(s["prefixes"], s["heads"], s["n"], seed=7, kv=args.kv, **batch_kwargs(s))
        kd()
        torch.cuda.synchronize()
        first = out.clone()
        kd()
        torch.cuda.synchronize()
        same = torch.equal(first.view(torch.int16), out.view(torch.int16))
        ref = verify_attention_reference(**b.verify_args()).float()
        err = ((first.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()   # as tests/test_kernel_gpu.py
        digest = hashlib.sha256(first.cpu().view(torch.int16).numpy().tobytes()).hexdigest()[:32]
        print(f"{s['name']:<36} {digest} rel err {err:.1e}{'' if same else '  NOT DETERMINISTIC'}", flush=True)


if __name__ == "__main__":
    main()
