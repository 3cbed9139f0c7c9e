"""kdtree.sglang_patch with the CUDA kernel, against the real SGLang Triton backend on the GPU.

Run on a GPU machine after ``source .carry/sglang/activate`` (SGLANG.md) with kdtree built:
    python -m pytest tests/test_sglang_gpu.py -m gpu
The pool tests build their metadata with SGLang's own builders, which import ``kv_index_translator``: complete the
bundle with ``python tools/sglang_bundle_extras.py`` before carrying it (its file list lacks that module).
Every case compares the patched call with SGLang's own ``forward_extend`` (real Triton kernel) on
an identical copy of the inputs, and with a float64 reference: bf16, B 1 and 8 with ragged
prefixes, N 1 and 9 with trees, N 16 without a mask (DFlash chain), N 33 with all-False padding
rows (DDTree), every pool slot the call must not read NaN, slots shuffled. The pool cases run
MLATokenToKVPool at page sizes 1, 16 and 64 and DSATokenToKVPool (64) with the metadata SGLang's
backend builds, over three verify steps, eagerly and through a CUDA-graph capture replayed on
refreshed metadata, and check every pool buffer byte for byte against the original's.
"""

from __future__ import annotations

import pytest
import torch

from sglang_harness import (assert_close_bf16, assert_pools_identical, build_case, parallel_context,
                            reference_output)

from kdtree import sglang_patch

pytestmark = pytest.mark.gpu

RAGGED8 = [0, 1, 63, 64, 65, 511, 2049, 3001]
RAGGED8_P1 = [1, 2, 63, 64, 65, 511, 2049, 3001]   # with padding rows: P >= 1, as in serving
CASES = [
    ("b1_n1", dict(batch=1, n=1, heads=16, prefix_lens=[1000])),
    ("b8_n1", dict(batch=8, n=1, heads=16, prefix_lens=RAGGED8)),
    ("b1_n9_tree", dict(batch=1, n=9, heads=16, prefix_lens=[4097])),
    ("b8_n9_tree", dict(batch=8, n=9, heads=16, prefix_lens=RAGGED8)),
    ("b1_n16_chain", dict(batch=1, n=16, heads=16, mask="none", prefix_lens=[3000])),
    ("b8_n16_chain", dict(batch=8, n=16, heads=16, mask="none", prefix_lens=RAGGED8)),
    ("b1_n33_ddtree_pad", dict(batch=1, n=33, pad=9, heads=16, prefix_lens=[2000])),
    ("b8_n33_ddtree_pad", dict(batch=8, n=33, pad=6, heads=16, prefix_lens=RAGGED8_P1)),
    ("b8_n9_graph_layout_h128", dict(batch=8, n=9, heads=128, graph_layout=True, attn_output=True,
                                     prefix_lens=RAGGED8)),
    ("b2_n9_odd_heads", dict(batch=2, n=9, heads=7, prefix_lens=[100, 0])),
]
IDS = [c[0] for c in CASES]


def bits(t):
    return t.detach().contiguous().view(torch.uint8)


def cuda_case(seed, **kwargs):
    return build_case(seed=seed, device="cuda", **kwargs)


def refuse_triton(case):
    def refuse(*args, **kwargs):
        raise AssertionError("SGLang's extend_attention_fwd ran on a call kdtree should have served")

    case.backend.extend_attention_fwd = refuse


@pytest.mark.parametrize("name,kwargs", CASES, ids=IDS)
def test_on_matches_sglang_gpu(sg_patch, name, kwargs):
    unpatched = cuda_case(100, **kwargs)
    ref_out = unpatched.call()
    sg_patch.install("on", propagate=False)
    case = cuda_case(100, **kwargs)
    refuse_triton(case)
    out = case.call()
    torch.cuda.synchronize()
    assert out.shape == (case.num_tokens, case.num_heads * 512) and out.dtype == torch.bfloat16
    assert out.is_cuda
    expected = reference_output(case)
    assert_close_bf16(ref_out, expected, what=f"SGLang original ({name})")   # the baseline is sound
    assert_close_bf16(out, expected, what=f"kdtree ({name})")
    assert_close_bf16(out, ref_out.double(), what=f"kdtree vs SGLang ({name})")
    assert torch.equal(bits(case.key_buffer()), bits(unpatched.key_buffer())), "KV rows differ from SGLang's"
    if kwargs.get("attn_output"):
        assert out.data_ptr() == case.forward_batch._attn_output.data_ptr()
    assert sg_patch.stats()["served"] == 1


@pytest.mark.parametrize("name,kwargs", [CASES[3], CASES[7]], ids=[IDS[3], IDS[7]])
def test_validate_gpu(sg_patch, name, kwargs):
    unpatched = cuda_case(200, **kwargs)
    ref_out = unpatched.call()
    sg_patch.install("validate", propagate=False)
    out = cuda_case(200, **kwargs).call()
    assert torch.equal(bits(out), bits(ref_out))
    s = sg_patch.stats()
    assert (s["compared"], s["mismatched"], s["kernel_errors"]) == (1, 0, 0), s
    assert s["max_tolerance_ratio"] < 1


def test_validate_reports_wrong_kernel_gpu(sg_patch, monkeypatch):
    real = sglang_patch._kernel
    where = (5, 3, 17)

    def wrong(backend, q, k, layer, out3, capturing):
        kv_dtype = real(backend, q, k, layer, out3, capturing)
        out3[where] += 1.0
        return kv_dtype

    unpatched = cuda_case(300, **CASES[3][1])
    ref_out = unpatched.call()
    monkeypatch.setattr(sglang_patch, "_kernel", wrong)
    sg_patch.install("validate", propagate=False)
    out = cuda_case(300, **CASES[3][1]).call()
    assert torch.equal(bits(out), bits(ref_out))
    s = sg_patch.stats()
    assert s["mismatched"] == 1 and s["last_mismatch"]["worst_index"] == where, s


def test_non_default_stream(sg_patch):
    kwargs = CASES[7][1]
    unpatched = cuda_case(400, **kwargs)
    ref_out = unpatched.call()
    sg_patch.install("on", propagate=False)
    case = cuda_case(400, **kwargs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = case.call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert_close_bf16(out, ref_out.double())
    assert torch.equal(bits(case.key_buffer()), bits(unpatched.key_buffer()))


def _refresh_inputs(case, seed):
    """New q, k and draft trees in the same buffers (what changes between graph replays)."""
    from sglang_harness import random_tree

    g = torch.Generator().manual_seed(seed)
    case.q.copy_(torch.randn(case.q.shape, generator=g) * 2)
    case.k.copy_(torch.randn(case.k.shape, generator=g))
    case.v.copy_(case.k[..., :512])
    md = case.backend.forward_metadata
    if md.custom_mask is not None:
        starts = md.mask_indptr.tolist()
        for b, p in enumerate(case.prefix_lens):
            vis = random_tree(case.n, 0, g)
            block = md.custom_mask[starts[b]:starts[b] + case.n * (p + case.n)].view(case.n, p + case.n)
            block[:, p:] = vis.to(block.dtype).to(block.device)
            case.tree[b] = vis


@pytest.mark.parametrize("name,kwargs", [CASES[8], CASES[5]], ids=[IDS[8], IDS[5]])
def test_cuda_graph_capture_and_replay(sg_patch, name, kwargs):
    sg_patch.install("on", propagate=False)
    case = cuda_case(500, **kwargs)
    layer = case.layer
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        case.call()                                      # warm-up: sizes the workspace
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with parallel_context(case.sg):
        with torch.cuda.graph(graph):
            static_out = case.backend.forward_extend(case.q, case.k, case.v, layer, case.forward_batch)
    calls_after_capture = sg_patch.stats()["calls"]

    for seed in (1, 2):
        _refresh_inputs(case, 600 + seed)
        graph.replay()
        torch.cuda.synchronize()
        replayed = static_out.clone()
        assert_close_bf16(replayed, reference_output(case), what=f"replay {seed} ({name})")
        eager = case.call()                              # same inputs, eager
        torch.cuda.synchronize()
        assert_close_bf16(replayed, eager.double(), atol=1e-3, rtol=1e-3, what=f"replay vs eager ({name})")
        # the replay wrote the new draft rows into the pool, like SGLang's save
        kb = case.key_buffer()[case.out_cache_loc]
        assert torch.equal(bits(kb), bits(case.k))
    assert sg_patch.stats()["calls"] == calls_after_capture + 2   # replays run no Python


def test_validate_skips_comparison_during_capture(sg_patch):
    kwargs = CASES[3][1]
    sg_patch.install("validate", propagate=False)
    case = cuda_case(700, **kwargs)
    case.call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with parallel_context(case.sg):
        with torch.cuda.graph(graph):
            static_out = case.backend.forward_extend(case.q, case.k, case.v, case.layer, case.forward_batch)
    s = sg_patch.stats()
    assert s["skipped_capture"] == 1 and s["compared"] == 1
    _refresh_inputs(case, 701)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_bf16(static_out, reference_output(case), what="replayed original")


def _rel(a, e):
    a, e = a.detach().to("cpu", torch.float64), e.detach().to("cpu", torch.float64)
    return float((a - e).norm() / e.norm())


@pytest.mark.parametrize("kv_scales", [None, (0.75, 1.5)], ids=["unscaled", "scales"])
@pytest.mark.parametrize("pool_kind", ["mla", "dsa"])
def test_e4m3_pool_served_gpu(sg_patch, pool_kind, kv_scales):
    """An e4m3 pool (``--kv-cache-dtype fp8_e4m3``) with and without the layer's KV scales: the FP8 kernel against the
    float64 reference on the dequantised pool, no less accurate than SGLang's own Triton fp8 path on the same inputs,
    and the pool byte for byte as SGLang leaves it."""
    kwargs = dict(pool_kind=pool_kind, batch=4, n=9, heads=16, prefix_lens=[0, 64, 1000, 3001],
                  kv_dtype=torch.float8_e4m3fn, kv_scales=kv_scales, metadata="sglang")
    unpatched, case = cuda_case(800, **kwargs), cuda_case(800, **kwargs)
    ref_out = unpatched.call()
    sg_patch.install("on", propagate=False)
    refuse_triton(case)
    out = case.call()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    expected = reference_output(case)
    mine, theirs = _rel(out, expected), _rel(ref_out, expected)
    assert mine < 3e-2, mine
    assert mine <= theirs, f"kdtree {mine:.3e} vs SGLang's fp8 path {theirs:.3e}"
    assert_pools_identical(case, unpatched, f"{pool_kind} e4m3")
    assert sg_patch.stats()["served"] == 1


def test_e4m3_pool_validate_gpu(sg_patch):
    kwargs = dict(batch=2, n=9, heads=16, prefix_lens=[300, 2000], kv_dtype=torch.float8_e4m3fn)
    unpatched, case = cuda_case(810, **kwargs), cuda_case(810, **kwargs)
    ref_out = unpatched.call()
    sg_patch.install("validate", propagate=False)
    out = case.call()
    assert torch.equal(bits(out), bits(ref_out))   # validate returns SGLang's output
    s = sg_patch.stats()
    seen = {k: s[k] for k in ("compared", "mismatched", "kernel_errors", "max_abs_err", "max_tolerance_ratio",
                              "last_mismatch", "fp8_atol", "fp8_rtol")}
    on_case = cuda_case(810, **kwargs)
    sg_patch.install("on", propagate=False)
    on_out = on_case.call()
    expected = reference_output(on_case)
    mine, theirs = _rel(on_out, expected), _rel(ref_out, expected)   # both against the float reference
    assert (s["compared"], s["mismatched"], s["kernel_errors"]) == (1, 0, 0), (seen, mine, theirs)
    assert s["max_tolerance_ratio"] < 1


# ------------------------------------------------------------------------------------------------
# KV pool classes and page sizes (README, "Deployments: the pool each model gets"): the metadata
# is built by SGLang's own backend from req_to_token (tests/sglang_harness.py, metadata="sglang")
# ------------------------------------------------------------------------------------------------

POOL_CASES = [
    ("mla_p1_b1", dict(pool_kind="mla", page_size=1, batch=1, prefix_lens=[4097])),
    ("mla_p1_b4", dict(pool_kind="mla", page_size=1, batch=4, prefix_lens=[0, 63, 1000, 3001])),
    ("mla_p16_b1", dict(pool_kind="mla", page_size=16, batch=1, prefix_lens=[2049])),
    ("mla_p16_b4", dict(pool_kind="mla", page_size=16, batch=4, prefix_lens=[15, 16, 17, 2000])),
    ("mla_p64_b1", dict(pool_kind="mla", page_size=64, batch=1, prefix_lens=[4097])),
    ("mla_p64_b4", dict(pool_kind="mla", page_size=64, batch=4, prefix_lens=[63, 64, 65, 3001])),
    ("dsa_b1", dict(pool_kind="dsa", batch=1, prefix_lens=[4097])),
    ("dsa_b4", dict(pool_kind="dsa", batch=4, prefix_lens=[0, 64, 129, 3001])),
    ("dsa_b4_chain16", dict(pool_kind="dsa", batch=4, n=16, mask="none", prefix_lens=[5, 64, 1000, 2049])),
]
POOL_IDS = [c[0] for c in POOL_CASES]
#: per step, draft tokens each request commits before the next verify
POOL_ACCEPTED = [[9, 0, 4, 1], [2, 7, 0, 9]]


def pool_case(seed, **kwargs):
    common = dict(heads=16, n=9, metadata="sglang", reserve=32, layer_num=2)
    common.update(kwargs)
    return cuda_case(seed, **common)


def _accepted(step, case):
    return [min(a, case.n) for a in POOL_ACCEPTED[step][:len(case.prefix_lens)]]


@pytest.mark.parametrize("name,kwargs", POOL_CASES, ids=POOL_IDS)
def test_pools_on_matches_sglang_over_verify_steps_gpu(sg_patch, name, kwargs):
    unpatched, case = pool_case(900, **kwargs), pool_case(900, **kwargs)
    for step in range(3):
        sg_patch.install("off", propagate=False)
        if step:
            unpatched.advance(_accepted(step - 1, unpatched), seed=910 + step)
        ref_out = unpatched.call()
        sg_patch.install("on", propagate=False)
        if step:
            case.advance(_accepted(step - 1, case), seed=910 + step)
        refuse_triton(case)
        out = case.call()
        torch.cuda.synchronize()
        what = f"{name} step {step}"
        expected = reference_output(case)
        assert_close_bf16(ref_out, expected, what=f"SGLang original ({what})")
        assert_close_bf16(out, expected, what=f"kdtree ({what})")
        assert_close_bf16(out, ref_out.double(), what=f"kdtree vs SGLang ({what})")
        assert_pools_identical(case, unpatched, what)
    s = sg_patch.stats()
    assert (s["served"], s["fallback"]) == (3, 0), s


@pytest.mark.parametrize("name,kwargs", [POOL_CASES[3], POOL_CASES[5], POOL_CASES[6], POOL_CASES[7], POOL_CASES[8]],
                         ids=[POOL_IDS[3], POOL_IDS[5], POOL_IDS[6], POOL_IDS[7], POOL_IDS[8]])
def test_pools_cuda_graph_replay_gpu(sg_patch, name, kwargs):
    """Capture the patched call on metadata in SGLang's CUDA-graph buffers, then replay it over two
    more verify steps whose metadata SGLang's replay preparation refills in place
    (init_forward_metadata_out_graph(in_capture=False)); an unpatched twin runs the original eagerly
    on the same buffers' contents. Outputs, reference and every pool buffer agree at each step."""
    twin = pool_case(950, graph_layout=True, **kwargs)
    case = pool_case(950, graph_layout=True, **kwargs)
    ref_out = twin.call()                                # step 0, eager, both sides
    sg_patch.install("on", propagate=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = case.call()                                # warm-up: sizes the workspace
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert_close_bf16(out, ref_out.double(), what=f"{name} step 0 (eager)")
    assert_pools_identical(case, twin, f"{name} step 0")

    graph = torch.cuda.CUDAGraph()
    with parallel_context(case.sg):
        with torch.cuda.graph(graph):
            static_out = case.backend.forward_extend(case.q, case.k, case.v, case.layer, case.forward_batch)
    calls_after_capture = sg_patch.stats()["calls"]

    for step in (1, 2):
        accepted = _accepted(step - 1, case)
        sg_patch.install("off", propagate=False)
        twin.advance(accepted, seed=960 + step)
        ref_out = twin.call()
        sg_patch.install("on", propagate=False)
        case.advance(accepted, seed=960 + step)
        graph.replay()
        torch.cuda.synchronize()
        what = f"{name} replay {step}"
        assert_close_bf16(static_out, reference_output(case), what=what)
        assert_close_bf16(static_out, ref_out.double(), what=f"{what} vs SGLang")
        assert_pools_identical(case, twin, what)
    assert sg_patch.stats()["calls"] == calls_after_capture   # replays run no Python


@pytest.mark.parametrize("name,kwargs", [POOL_CASES[5], POOL_CASES[7]], ids=[POOL_IDS[5], POOL_IDS[7]])
def test_pools_validate_gpu(sg_patch, name, kwargs):
    unpatched, case = pool_case(970, **kwargs), pool_case(970, **kwargs)
    ref_out = unpatched.call()
    sg_patch.install("validate", propagate=False)
    out = case.call()
    assert torch.equal(bits(out), bits(ref_out))
    assert_pools_identical(case, unpatched, name)
    s = sg_patch.stats()
    assert (s["compared"], s["mismatched"], s["kernel_errors"]) == (1, 0, 0), s
    assert s["max_tolerance_ratio"] < 1


def test_packed_dsa_fp8_pool_falls_back_gpu(sg_patch, monkeypatch):
    """The packed 656-byte FP8 DSA row falls back on its layout (SGLang's own Triton path asserts on it; so does the
    patched call, unchanged)."""
    kwargs = dict(pool_kind="dsa", batch=2, prefix_lens=[300, 64], kv_dtype=torch.float8_e4m3fn, kv_cache_dim=656)
    unpatched, case = pool_case(980, **kwargs), pool_case(980, **kwargs)

    def refuse(*a, **k):
        raise AssertionError("kernel ran on a packed fp8 pool")

    with pytest.raises(AssertionError):
        unpatched.call()
    sg_patch.install("on", propagate=False)
    monkeypatch.setattr(sglang_patch, "_kernel", refuse)
    with pytest.raises(AssertionError):
        case.call()
    assert list(sg_patch.stats()["fallback_reasons"]) == ["pool layout 656-byte row"]
