"""Debug aid: a few crafted calls that localise a wrong split kernel (prints, never asserts).

    python benchmarks/probe_kernel.py
(a) one key (P=0, N=1): the output must equal that key's first 512 values whatever S is: P V alone;
(b) small prefixes against the float32 reference: S, the softmax and the mask; per-row errors show
    which rows / heads go wrong; (c) a split-K case.
"""
import torch

import kdtree
from kdtree import _ext
from kdtree.reference import verify_attention_reference
from kdtree.synthetic import make_verify_batch

print("split kernel:", _ext.load().split_kernel())


def run(prefixes, heads, n, seed=0):
    b = make_verify_batch(prefixes, heads, n, kind="tree", device="cuda", seed=seed)
    args = b.verify_args()
    out = kdtree.verify_attention(**args)
    torch.cuda.synchronize()
    ref = verify_attention_reference(**args)
    return out.float(), ref.float(), args


out, ref, args = run([0], 1, 1)
print(f"(a) one key: max |out - k[:512]| = {(out[0, 0] - args['k_new'][0, :512].float()).abs().max().item():.3e}, "
      f"out[:8] {out[0, 0, :8].tolist()}")
for p, h, n in [(31, 1, 1), (40, 16, 1), (40, 16, 9), (200, 16, 9), (5000, 16, 9)]:
    out, ref, _ = run([p], h, n, seed=p + h)
    err = (out - ref).norm() / ref.norm()
    rows = ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).flatten()
    bad = (rows > 1e-2).nonzero().flatten().tolist()
    colerr = ((out - ref).abs().amax(dim=(0, 1)))
    print(f"(b) P={p} H={h} N={n}: rel L2 {err.item():.3e}; rows off {len(bad)}/{rows.numel()} {bad[:12]}; "
          f"worst 64-col block {int(colerr.view(8, 64).amax(1).argmax())} "
          f"(col errs by block {[round(x, 3) for x in colerr.view(8, 64).amax(1).tolist()]})")
