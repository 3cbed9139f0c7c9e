"""One kdtree call for compute-sanitizer: `small` (one split per request, B=2), `split` (split-K + combine) or
`many` (24 requests, more work items than SMs: blocks run several items, some split, back to back).

    compute-sanitizer --tool memcheck  python benchmarks/sanitize_case.py split
    compute-sanitizer --tool racecheck python benchmarks/sanitize_case.py small
Exits non-zero if the result is off the reference, so a sanitizer run also checks the numbers.
"""
import sys

import torch

import kdtree
from kdtree.reference import verify_attention_reference
from kdtree.synthetic import make_verify_batch

case = sys.argv[1] if len(sys.argv) > 1 else "small"
prefixes = {"small": [40, 0], "split": [3000, 70], "many": [300 + 53 * i for i in range(24)]}[case]
b = make_verify_batch(prefixes, 16, 9, kind="tree", pad=2, device="cuda", seed=1)
args = b.verify_args()
out = kdtree.verify_attention(**args)
torch.cuda.synchronize()
ref = verify_attention_reference(**args)
err = ((out.float() - ref).norm() / ref.norm()).item()
print(f"sanitize case {case}: prefixes {prefixes}, rel err {err:.2e}")
sys.exit(0 if err < 1e-2 and torch.isfinite(out).all() else 1)
