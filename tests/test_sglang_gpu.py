"""kdtree.sglang_patch with the CUDA kernel, against the real SGLang Triton backend on the GPU.

Run on a GPU machine after ``source .carry/sglang/activate`` (SGLANG.md) with kdtree built:
    python -m pytest tests/test_sglang_gpu.py -m gpu
Every case compares the patched call with SGLang's own ``forward_extend`` (real Triton kernel) on
an identical copy of the inputs, and with a float64 reference: bf16, B 1 and 8 with ragged
prefixes, N 1 and 9 with trees, N 16 without a mask (DFlash chain), N 33 with all-False padding
rows (DDTree), every pool slot the call must not read NaN, slots shuffled.
"""

from __future__ import annotations

import pytest
import torch

from sglang_harness import assert_close_bf16, build_case, parallel_context, reference_output

from kdtree import sglang_patch
from sglang_env import import_sglang

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


@pytest.fixture
def sg_patch(monkeypatch):
    monkeypatch.delenv("KDTREE_VERIFY", raising=False)
    import_sglang()
    sglang_patch.uninstall()
    sglang_patch.reset_stats()
    yield sglang_patch
    sglang_patch.uninstall()
    sglang_patch.reset_stats()


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
        real(backend, q, k, layer, out3, capturing)
        out3[where] += 1.0

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


def test_fp8_pool_falls_back_gpu(sg_patch, monkeypatch):
    kwargs = dict(batch=2, n=9, heads=16, prefix_lens=[300, 17], kv_dtype=torch.float8_e4m3fn)
    unpatched = cuda_case(800, **kwargs)
    ref_out = unpatched.call()
    sg_patch.install("on", propagate=False)

    def refuse(*a, **k):
        raise AssertionError("kernel ran on an fp8 pool")

    monkeypatch.setattr(sglang_patch, "_kernel", refuse)
    out = cuda_case(800, **kwargs).call()
    assert torch.equal(bits(out), bits(ref_out))
    assert list(sg_patch.stats()["fallback_reasons"]) == ["kv cache torch.float8_e4m3fn"]
