"""kdtree.reference against the REAL SGLang Triton extend kernel (sglang 0.5.23).

Same call as TritonAttnBackend.forward_extend makes for MLA target verify (SGLANG.md step 4):
``extend_attention_fwd(q, k, v, o, key_buffer, value_buffer, qo_indptr, kv_indptr, kv_indices,
custom_mask, True, mask_indptr, max_extend_len, 1.0, 1.0, sm_scale=...)`` with
``skip_prefix_custom_mask`` left at its default (True). On CPU the kernel runs in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1).

The tensors are float32 holding bf16-representable values: the interpreter mishandles bfloat16
tensors (it returns garbage of magnitude ~1e8 for this kernel with triton 3.9), while in float32
it is exact enough for a float32-level comparison. The pool is shuffled, larger than needed and
NaN in every slot the call must not read; kv_indices and custom_mask carry garbage tails past
what the indptrs delimit (as SGLang's CUDA-graph buffers do). The output starts as NaN, so a row
the kernel does not write fails the comparison.

KDTREE_TEST_LARGE=1 adds larger shapes (slow under the interpreter).
"""

import os
import random

import pytest
import torch

from kdtree import build_tree_mask, verify_attention_reference
from sglang_env import import_sglang

SM_SCALE = 0.1147
ATOL = 2e-5
RTOL = 2e-5


def _bf16_randn(shape, gen):
    return torch.randn(shape, generator=gen).to(torch.bfloat16).to(torch.float32)


def make_case(ns, ps, heads, mask_kind, padding, seed):
    """SGLang-layout inputs (float32 tensors) for requests with ns[b] verify tokens, ps[b] prefix keys.
    mask_kind: 'tree' (random parents before children), 'chain' (EAGLE topk=1 with a mask) or
    'none' (custom_mask None, causal drafts). The last ``padding`` rows of each request are
    all-False (prefix columns too) when a mask is used."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    T = sum(ns)
    S = 3 * (sum(ps) + T) + 8
    slots = torch.randperm(S - 1, generator=gen) + 1
    key_buffer = torch.full((S, 1, 576), float("nan"))
    kv_indices, flat = [], []
    used = 0
    for n, p in zip(ns, ps):
        idx = slots[used:used + p]
        used += p
        key_buffer[idx] = _bf16_randn((p, 1, 576), gen)
        kv_indices.append(idx)
        pad = min(padding, n - 1) if mask_kind != "none" else 0
        vis = [[False] * n for _ in range(n)]
        for i in range(n - pad):
            if i > 0:
                vis[i] = list(vis[rng.randrange(i) if mask_kind == "tree" else i - 1])
            vis[i][i] = True
        for i in range(n):
            flat += [any(vis[i])] * p + vis[i]
    k = _bf16_randn((T, 1, 576), gen)
    key_buffer[slots[used:used + T]] = k  # forward_extend stores the drafts first (save_kv_cache)
    kv_indices.append(torch.randint(0, S, (29,), generator=gen))  # garbage tail of a graph buffer
    flat += [True] * 501                                          # likewise for the mask

    def indptr(lengths, dtype):
        return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(dtype)

    return dict(
        q=_bf16_randn((T, heads, 576), gen),
        k=k,
        key_buffer=key_buffer,
        qo_indptr=indptr(ns, torch.int32),
        kv_indptr=indptr(ps, torch.int32),
        kv_indices=torch.cat(kv_indices).to(torch.int64),
        custom_mask=None if mask_kind == "none" else torch.tensor(flat, dtype=torch.bool),
        mask_indptr=indptr([n * (n + p) for n, p in zip(ns, ps)], torch.int64),
        max_n=max(ns),
        T=T,
        heads=heads,
    )


def run_sglang(sg, c):
    v = c["k"][..., :512].contiguous()
    o = torch.full((c["T"], c["heads"], 512), float("nan"))
    sg.extend_attention_fwd(
        c["q"], c["k"], v, o, c["key_buffer"], c["key_buffer"][..., :512],
        c["qo_indptr"], c["kv_indptr"], c["kv_indices"], c["custom_mask"], True, c["mask_indptr"],
        c["max_n"], 1.0, 1.0, sm_scale=SM_SCALE)
    return o


def run_reference(c, dtype=torch.float64):
    tree = build_tree_mask(c["custom_mask"], c["mask_indptr"], c["qo_indptr"], c["kv_indptr"], c["T"], c["max_n"])
    q = c["q"]
    return verify_attention_reference(
        q[..., :512], q[..., 512:], c["key_buffer"][:, 0], c["kv_indptr"], c["kv_indices"], c["qo_indptr"],
        c["k"][:, 0], tree, SM_SCALE, dtype=dtype)


def assert_close(got, ref, what):
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} non-finite values"
    assert torch.isfinite(ref).all(), "reference: non-finite values"
    err = (got.double() - ref.double()).abs()
    bound = ATOL + RTOL * ref.double().abs()
    worst = int((err - bound).flatten().argmax())
    assert bool((err <= bound).all()), (
        f"{what}: max abs error {float(err.max()):.3e} (at flat index {worst}), max|ref| {float(ref.abs().max()):.3f}")


CASES = [
    # ns, ps, heads, mask, padding rows
    ([1], [0], 1, "none", 0),
    ([1], [1], 4, "tree", 0),
    ([5], [1], 1, "tree", 1),
    ([5], [17], 16, "none", 0),
    ([9], [0], 4, "tree", 2),          # padding rows see nothing at all -> zeros
    ([9], [17], 4, "tree", 2),
    ([9], [70], 16, "tree", 2),
    ([5], [70], 4, "chain", 0),
    ([9], [1], 1, "none", 0),
    ([1, 5, 9], [0, 17, 70], 4, "tree", 2),   # ragged B=3
    ([9, 1, 5], [70, 1, 0], 1, "none", 0),
    ([5, 9, 1], [17, 0, 1], 16, "tree", 2),
]
if os.environ.get("KDTREE_TEST_LARGE") == "1":
    CASES += [
        ([33], [200], 16, "tree", 6),
        ([16, 16], [129, 64], 16, "none", 0),
        ([9, 9, 9, 9], [300, 31, 33, 1], 16, "tree", 2),
    ]


@pytest.mark.parametrize("ns,ps,heads,mask,padding", CASES,
                         ids=[f"N{c[0]}-P{c[1]}-H{c[2]}-{c[3]}" for c in CASES])
def test_reference_matches_sglang_extend_kernel(ns, ps, heads, mask, padding):
    sg = import_sglang()
    seed = sum(ns) * 1009 + sum(ps) * 31 + heads
    c = make_case(ns, ps, heads, mask, padding, seed)
    got = run_sglang(sg, c)
    ref = run_reference(c)
    assert_close(got, ref, f"sglang {sg.version} extend_attention_fwd")
    # the float32 reference (the CPU path of verify_attention) agrees too
    assert_close(run_reference(c, torch.float32), ref, "reference float32")

    # padding rows: zeros when the request has no prefix, otherwise a real (finite, nonzero)
    # attention over the prefix only
    q_ptr, k_ptr = c["qo_indptr"].tolist(), c["kv_indptr"].tolist()
    for b in range(len(ns)):
        pad = min(padding, ns[b] - 1) if mask != "none" else 0
        rows = ref[q_ptr[b + 1] - pad:q_ptr[b + 1]]
        if pad and k_ptr[b + 1] == k_ptr[b]:
            assert rows.eq(0).all()
        elif pad:
            assert rows.abs().amax(dim=-1).gt(0).all()


def test_comparison_detects_a_wrong_mask():
    """The comparison above is sharp: dropping one draft key of one row is caught."""
    sg = import_sglang()
    c = make_case([5], [3], 1, "tree", 0, seed=7)
    got = run_sglang(sg, c)
    flat = c["custom_mask"].clone()
    # row 4 (the last) always sees itself: the draft column P + 4 of row 4
    flat[4 * (3 + 5) + 3 + 4] = False
    ref = run_reference(dict(c, custom_mask=flat))
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close(got, ref, "sglang")
