"""One kdtree call for compute-sanitizer: `small` (one split per request, B=2), `split` (split-K + combine) or
`many` (24 requests, more work items than SMs: blocks run several items, some split, back to back); `reuse`:
the `many` batch twice on one Workspace, the second call on the first one's plan (reuse_plan, new q); `n1`: the
split case with one verify token (16-row items; under KDTREE_SPLIT_STAGES=2 the 2-stage mma.sync kernel's 32-row shape);
`n4`, `n4many`: the split and many cases at H8 N4 (32-row requests: on an e4m3 pool on sm_90a the skinny FP8 kernel's
32-row form, two consumer warpgroups a block); `pack`: the split case with the call packing its own tree mask
(custom_mask=, in the plan kernel's extra blocks);
`balanced`: H128 N9, two requests of 18 row tiles whose split rule adds a short split on 132 SMs (8 splits, 9,216
partial rows each: more than 132 x 64, so the workspace must allow each request its own rows beyond the grid's).
KDTREE_TEST_KV=e4m3 runs the case on an e4m3 pool (the FP8 kernel, the prep kernel's q blocks) with KV scales.

    compute-sanitizer --tool memcheck  python tools/sanitize_case.py split
    compute-sanitizer --tool racecheck python tools/sanitize_case.py small
Exits non-zero if the result is off the reference, so a sanitizer run also checks the numbers.
"""
import os
import sys

import torch

import kdtree
from kdtree.reference import verify_attention_reference
from kdtree.synthetic import make_verify_batch

case = sys.argv[1] if len(sys.argv) > 1 else "small"
many = [300 + 53 * i for i in range(24)]
prefixes = {"small": [40, 0], "split": [3000, 70], "many": many, "reuse": many, "n1": [3000, 70], "n4": [3000, 70],
            "n4many": many, "pack": [3000, 70], "balanced": [6000, 6100]}[case]
n = {"n1": 1, "n4": 4, "n4many": 4}.get(case, 9)
heads = {"balanced": 128, "n4": 8, "n4many": 8}.get(case, 16)
fp8 = os.environ.get("KDTREE_TEST_KV") == "e4m3"
b = make_verify_batch(prefixes, heads, n, kind="tree", pad=min(2, n - 1), device="cuda", seed=1,
                      kv_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
args = b.verify_args()
scales = dict(k_scale=0.75, v_scale=1.5) if fp8 else {}
tol = 3e-2 if fp8 else 1e-2
ok = True
calls = 2 if case == "reuse" else 1
ws = kdtree.Workspace()
for i in range(calls):
    if i:
        b.q.copy_(torch.randn_like(b.q))   # q_nope / q_pe are views of b.q
    if case == "pack":   # into a buffer of garbage: the call's own packing must fill it
        packed = torch.full_like(args["tree_mask"], -1)
        out = kdtree.verify_attention(**dict(args, tree_mask=packed), workspace=ws, custom_mask=b.custom_mask,
                                      mask_indptr=b.mask_indptr, **scales)
        torch.cuda.synchronize()
        ok = ok and torch.equal(packed, args["tree_mask"])
    else:
        out = kdtree.verify_attention(**args, workspace=ws, reuse_plan=i > 0, **scales)
        torch.cuda.synchronize()
    ref = verify_attention_reference(**args, **scales)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"sanitize case {case}, call {i}: prefixes {prefixes}, rel err {err:.2e}")
    ok = ok and err < tol and bool(torch.isfinite(out).all())
sys.exit(0 if ok else 1)
