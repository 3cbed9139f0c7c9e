"""kdtree.sglang_patch on SGLang's KV pool classes and page sizes (CPU: Triton interpreter).

The deployments SGLang builds around the MLA layout (README, "Deployments: the pool each model
gets"): ``MLATokenToKVPool`` at page size 1, 16 and 64, and ``DSATokenToKVPool`` (GLM-5.x,
DeepSeek-V3.2), which only takes 64-token pages. Every case's metadata is built by SGLang's own
backend from a ``req_to_token`` table (``metadata="sglang"`` in tests/sglang_harness.py): eagerly,
or into the CUDA-graph buffers and refreshed the way a replay's preparation refreshes them. The
unpatched original runs on one copy, the patched method on an identical copy; the outputs agree at
bf16 tolerance and with a float64 reference, and every tensor the pool holds (latent KV of every
layer, the DSA index keys and scales) is byte-identical after the two calls, over two verify steps
with committed drafts in between.
"""

from __future__ import annotations

import logging

import pytest
import torch

from sglang_harness import (DSA_PAGE_SIZE, assert_close_bf16, assert_pools_identical, bits, build_case,
                            make_pool, parallel_context, reference_output)

from kdtree import sglang_patch
from sglang_env import import_sglang

LOGGER = "kdtree.sglang_patch"


def triton_must_not_run(case):
    def refuse(*args, **kwargs):
        raise AssertionError("SGLang's extend_attention_fwd ran on a call kdtree should have served")

    case.backend.extend_attention_fwd = refuse


def kernel_must_not_run(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("kdtree's kernel ran on a call the gate should have sent to SGLang")

    monkeypatch.setattr(sglang_patch, "_kernel", refuse)


# (id, build_case kwargs): B 1 and 4, ragged prefixes across page boundaries, page sizes 1 / 16 / 64
# for MLATokenToKVPool and 64 (its only size) for DSATokenToKVPool
POOL_CASES = [
    ("mla_p1_b1", dict(pool_kind="mla", page_size=1, batch=1, prefix_lens=[21])),
    ("mla_p1_b4", dict(pool_kind="mla", page_size=1, batch=4, prefix_lens=[0, 1, 9, 30])),
    ("mla_p16_b1", dict(pool_kind="mla", page_size=16, batch=1, prefix_lens=[33])),
    ("mla_p16_b4", dict(pool_kind="mla", page_size=16, batch=4, prefix_lens=[15, 16, 17, 3])),
    ("mla_p64_b1", dict(pool_kind="mla", page_size=64, batch=1, prefix_lens=[70])),
    ("mla_p64_b4", dict(pool_kind="mla", page_size=64, batch=4, prefix_lens=[63, 64, 1, 65])),
    ("dsa_b1", dict(pool_kind="dsa", batch=1, prefix_lens=[66])),
    ("dsa_b4", dict(pool_kind="dsa", batch=4, prefix_lens=[62, 0, 64, 129])),
    ("dsa_b4_chain", dict(pool_kind="dsa", batch=4, mask="none", prefix_lens=[5, 61, 64, 2])),
]
IDS = [c[0] for c in POOL_CASES]
#: per step, draft tokens each request commits before the next verify (n = 4)
ACCEPTED = [[4, 0, 2, 1], [1, 3, 0, 4]]


def _pair(seed, **kwargs):
    common = dict(seed=seed, heads=3, n=4, metadata="sglang", reserve=12, layer_num=2)
    common.update(kwargs)
    return build_case(**common), build_case(**common)


# ------------------------------------------------------------------------------------------------
# the harness: SGLang's own metadata is what SGLANG.md says, at every page size
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("graph_layout", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("name,kwargs", [POOL_CASES[3], POOL_CASES[5], POOL_CASES[7]],
                         ids=[IDS[3], IDS[5], IDS[7]])
def test_sglang_metadata_names_token_slots(name, kwargs, graph_layout):
    case = build_case(seed=1, heads=2, n=4, metadata="sglang", graph_layout=graph_layout, **kwargs)
    md = case.backend.forward_metadata
    lens = case.prefix_lens
    assert md.kv_indptr.tolist() == [sum(lens[:b]) for b in range(len(lens) + 1)]
    live = md.kv_indices[:md.kv_indptr[-1]].cpu()
    expected = torch.cat([row[:p] for row, p in zip(case.slot_rows, lens)])
    assert torch.equal(live, expected), "kv_indices must be the prefix token slots, in sequence order"
    if case.page_size > 1:
        assert len({int(s) // case.page_size for s in expected}) < expected.numel(), "slots share pages"
    assert md.mask_indptr.tolist() == [sum(case.n * (p + case.n) for p in lens[:b]) for b in range(len(lens) + 1)]
    assert md.max_extend_len == case.n
    if graph_layout:
        assert md.qo_indptr.dtype == torch.int64 and md.custom_mask.dtype == torch.uint8
        assert md.kv_indices.numel() > md.kv_indptr[-1] and md.custom_mask.numel() > md.mask_indptr[-1]
    else:
        assert md.qo_indptr.dtype == torch.int32 and md.kv_indices.numel() == md.kv_indptr[-1]


def test_dsa_pool_is_the_configurators():
    """The DSA pool the harness builds is SGLang's, with a 576-value bf16 row and its index-key cache."""
    sg = import_sglang()
    case = build_case(seed=2, pool_kind="dsa", prefix_lens=[3], metadata="sglang")
    assert type(case.pool) is sg.memory_pool.DSATokenToKVPool
    assert case.pool.page_size == DSA_PAGE_SIZE and case.pool.index_head_dim == 128
    assert not case.pool.dsa_kv_cache_store_fp8 and case.pool.kv_cache_dim == 576
    index = [path for path in case.pool_buffers() if "index" in path]
    assert index, "the DSA index keys must be among the buffers the byte-identity checks cover"
    with pytest.raises(AssertionError, match="64-token physical pages"):
        make_pool(case.sg, "dsa", size=256, page_size=16, kv_dtype=torch.bfloat16, layer_num=1, device="cpu",
                  max_running_requests=4, num_draft_tokens=4)


# ------------------------------------------------------------------------------------------------
# on: the same outputs and the same pool as SGLang, step after step
# ------------------------------------------------------------------------------------------------


def _run_steps(sg_patch, name, kwargs, graph_layout, seed):
    unpatched, case = _pair(seed, graph_layout=graph_layout, **kwargs)
    batch = len(unpatched.prefix_lens)
    steps = [None] + [acc[:batch] for acc in ACCEPTED]
    for step, accepted in enumerate(steps):
        sg_patch.install("off", propagate=False)
        if accepted is not None:
            unpatched.advance(accepted, seed=seed + step)
        ref_out = unpatched.call()
        sg_patch.install("on", propagate=False)
        if accepted is not None:
            case.advance(accepted, seed=seed + step)
        triton_must_not_run(case)
        out = case.call()
        what = f"{name} step {step}"
        assert out.shape == (case.num_tokens, case.num_heads * 512) and out.dtype == torch.bfloat16
        assert_close_bf16(out, ref_out.double(), what=f"kdtree vs SGLang ({what})")
        assert_close_bf16(out, reference_output(case), what=f"kdtree vs float64 reference ({what})")
        assert_pools_identical(case, unpatched, what)
    return case


@pytest.mark.parametrize("name,kwargs", POOL_CASES, ids=IDS)
def test_on_matches_original_over_verify_steps(sg_patch, name, kwargs):
    _run_steps(sg_patch, name, kwargs, graph_layout=False, seed=40)
    s = sg_patch.stats()
    assert (s["served"], s["fallback"]) == (3, 0), s


@pytest.mark.parametrize("name,kwargs", [POOL_CASES[1], POOL_CASES[3], POOL_CASES[5], POOL_CASES[7]],
                         ids=[IDS[1], IDS[3], IDS[5], IDS[7]])
def test_on_matches_original_with_graph_buffers(sg_patch, name, kwargs):
    """The metadata in the CUDA-graph buffers (stale tails), refilled between steps by SGLang's
    replay preparation (init_forward_metadata_out_graph(in_capture=False))."""
    case = _run_steps(sg_patch, name, kwargs, graph_layout=True, seed=50)
    md = case.backend.forward_metadata
    assert md.qo_indptr.dtype == torch.int64 and md.kv_indices.numel() > md.kv_indptr[-1]


def test_on_every_layer_of_a_dsa_pass(sg_patch):
    """Two layers of one forward pass on a DSA pool: the second reuses the first's plan; both write
    their own layer's rows and leave the other layer and the index keys as SGLang does."""
    unpatched, case = _pair(60, pool_kind="dsa", batch=4, prefix_lens=[64, 3, 65, 0])

    def both_layers(c):
        layers = [c.layer, type(c.layer)(c.num_heads, 576, c.layer.scaling, 1, 1, v_head_dim=512)]
        with parallel_context(c.sg):
            return [c.backend.forward_extend(c.q, c.k, c.v, lyr, c.forward_batch) for lyr in layers]

    ref = both_layers(unpatched)
    sg_patch.install("on", propagate=False)
    triton_must_not_run(case)
    outs = both_layers(case)
    for layer_id, (out, r) in enumerate(zip(outs, ref)):
        assert_close_bf16(out, r.double(), what=f"layer {layer_id}")
    assert_pools_identical(case, unpatched, "two layers")
    assert sg_patch.stats()["served"] == 2


@pytest.mark.parametrize("name,kwargs", [POOL_CASES[4], POOL_CASES[7]], ids=[IDS[4], IDS[7]])
def test_validate_on_paged_pools(sg_patch, name, kwargs):
    unpatched, case = _pair(70, **kwargs)
    ref_out = unpatched.call()
    sg_patch.install("validate", propagate=False)
    out = case.call()
    assert torch.equal(bits(out), bits(ref_out)), "validate must return the original's output"
    assert_pools_identical(case, unpatched, name)
    s = sg_patch.stats()
    assert (s["served"], s["compared"], s["mismatched"], s["kernel_errors"]) == (1, 1, 0, 0), s
    assert 0 < s["max_abs_err"] and s["max_tolerance_ratio"] < 1


def test_on_without_save_leaves_dsa_pool_untouched(sg_patch):
    sg_patch.install("on", propagate=False)
    case = build_case(seed=80, pool_kind="dsa", batch=2, n=3, prefix_lens=[64, 7], metadata="sglang")
    before = {path: t.clone() for path, t in case.pool_buffers().items()}
    out = case.call(False)
    for path, t in case.pool_buffers().items():
        assert torch.equal(bits(t), bits(before[path])), path
    assert_close_bf16(out, reference_output(case))


# ------------------------------------------------------------------------------------------------
# the gate: layouts it serves and layouts it leaves to SGLang
# ------------------------------------------------------------------------------------------------


def _fallback_pair(monkeypatch, sg_patch, kwargs, reason, *, raises=None):
    """The unpatched original and the patched method (on) on identical copies: the same output (or
    the same exception), the same pool, the call counted under ``reason``."""
    unpatched, case = _pair(90, **kwargs)
    if raises is None:
        ref_out = unpatched.call()
    else:
        with pytest.raises(raises) as ref_exc:
            unpatched.call()
    sg_patch.install("on", propagate=False)
    kernel_must_not_run(monkeypatch)
    if raises is None:
        out = case.call()
        assert torch.equal(bits(out), bits(ref_out))
    else:
        with pytest.raises(raises) as exc:
            case.call()
        assert str(exc.value) == str(ref_exc.value)
    assert_pools_identical(case, unpatched, reason)
    assert sg_patch.stats()["fallback_reasons"] == {reason: 1}


@pytest.mark.parametrize("pool_kind, kv_scales", [("dsa", None), ("mla", None), ("mla", (0.75, 1.5))],
                         ids=["dsa", "mla", "mla_scales"])
def test_e4m3_pools_are_served(sg_patch, pool_kind, kv_scales):
    """FP8 in the raw 576-byte row (``--kv-cache-dtype fp8_e4m3``; the TRTLLM DSA layout of DeepSeek-V3.2 on
    sm_100/sm_120): served, with the layer's KV scales. The pool after the call is SGLang's byte for byte (the KV save
    is the pool's own, a scaled k divided first); the output is the reference's on the dequantised pool (on CPU the
    served path is kdtree's float reference; SGLang's Triton fp8 path cannot be the oracle under the interpreter,
    tests/fp8_model.py)."""
    kwargs = dict(pool_kind=pool_kind, batch=2, prefix_lens=[64, 5], kv_dtype=torch.float8_e4m3fn,
                  kv_scales=kv_scales)
    unpatched, case = _pair(91, **kwargs)
    unpatched.call()
    sg_patch.install("on", propagate=False)
    triton_must_not_run(case)
    out = case.call()
    assert_pools_identical(case, unpatched, f"{pool_kind} e4m3")
    assert_close_bf16(out, reference_output(case), what=f"{pool_kind} e4m3 vs float64 reference")
    if kv_scales is not None:   # the scales are applied: without them the reference moves away
        layer = case.layer
        layer.v_scale = None
        with pytest.raises(AssertionError):
            assert_close_bf16(out, reference_output(case), what="unscaled reference")
    s = sg_patch.stats()
    assert (s["served"], s["fallback"]) == (1, 0), s


def test_packed_dsa_fp8_row_falls_back_on_its_layout(sg_patch, monkeypatch, caplog):
    """The packed 656-byte FP8 row (GLM-5.x on sm_120 and every DSA model on sm_90 with FP8 KV).
    SGLang's own Triton path cannot run on it either: MLATokenToKVPool.set_kv_buffer asserts that
    the pool is not a packed FP8 DSA pool; kdtree leaves that to SGLang unchanged."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _fallback_pair(monkeypatch, sg_patch, dict(pool_kind="dsa", batch=2, prefix_lens=[64, 5],
                                                   kv_dtype=torch.float8_e4m3fn, kv_cache_dim=656),
                       "pool layout 656-byte row", raises=AssertionError)
    logged = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(logged) == 1 and "656 bytes" in logged[0] and "fp32 per-128 scales" in logged[0], logged


def test_fp4_pool_falls_back_without_dequantizing(sg_patch, monkeypatch):
    """MLATokenToKVPoolFP4's get_key_buffer dequantizes the whole layer into a new bf16 tensor:
    the gate decides on the pool's dtype and never calls it."""
    sg = import_sglang()
    with parallel_context(sg):
        pool = sg.memory_pool.MLATokenToKVPoolFP4(128, page_size=1, dtype=torch.float4_e2m1fn_x2, kv_lora_rank=512,
                                                 qk_rope_head_dim=64, layer_num=1, device="cpu",
                                                 enable_memory_saver=False)

    def refuse(layer_id):
        raise AssertionError("the gate called get_key_buffer on an FP4 pool")

    monkeypatch.setattr(pool, "get_key_buffer", refuse)
    assert sglang_patch._pool_layout_problem(pool, 0)[0] == "kv cache torch.float4_e2m1fn_x2"


class _Views:
    """Replacement accessors for a real pool: a layout SGLang could hand out."""

    @staticmethod
    def strided_key(pool, layer_id):     # every other value of a wider row: inner stride 2
        return torch.zeros(pool.size + 1, 1, 2 * 576, dtype=torch.bfloat16)[..., ::2]

    @staticmethod
    def paged_key(pool, layer_id):       # a 4-D page-major view [pages, P, 1, 576]
        return pool.kv_buffer[layer_id].view(-1, 1, 1, 576)

    @staticmethod
    def separate_value(pool, layer_id):  # values in a tensor of their own
        return pool.kv_buffer[layer_id][..., :512].clone()


@pytest.mark.parametrize("accessor,attr", [("strided_key", "get_key_buffer"), ("paged_key", "get_key_buffer"),
                                           ("separate_value", "get_value_buffer")])
def test_gate_checks_the_layout_the_accessors_return(accessor, attr, monkeypatch):
    case = build_case(seed=3, prefix_lens=[5])
    pool = case.pool
    monkeypatch.setattr(pool, attr, lambda layer_id: getattr(_Views, accessor)(pool, layer_id))
    problem = sglang_patch._pool_layout_problem(pool, 0)
    assert problem is not None and problem[0] == "pool layout", problem


def test_gate_names_a_pool_without_mla_accessors():
    class OpaquePool:
        pass

    case = build_case(seed=4, prefix_lens=[2])
    case.backend.token_to_kv_pool = OpaquePool()
    r = sglang_patch._gate(case.backend, case.q, case.k, case.v, case.layer, case.forward_batch, {}, False)
    assert r[0] == "pool OpaquePool"


def test_an_unknown_subclass_with_the_layout_is_served(sg_patch):
    """Decided by layout, not by class name: a subclass SGLang (or a platform plugin) may add."""
    sg = import_sglang()

    class VendorMLATokenToKVPool(sg.memory_pool.MLATokenToKVPool):
        pass

    def retype(case):
        case.pool.__class__ = VendorMLATokenToKVPool
        return case

    unpatched = retype(build_case(seed=5, batch=2, prefix_lens=[4, 9]))
    ref_out = unpatched.call()
    sg_patch.install("on", propagate=False)
    case = retype(build_case(seed=5, batch=2, prefix_lens=[4, 9]))
    triton_must_not_run(case)
    out = case.call()
    assert_close_bf16(out, ref_out.double())
    assert_pools_identical(case, unpatched, "vendor subclass")
    assert sg_patch.stats()["served"] == 1


def test_layout_is_decided_once_per_pool_and_layer(sg_patch, monkeypatch):
    """The gate asks the pool for its layer buffers on the first call of each layer only; every
    served call then reads get_key_buffer once, after the KV save, as SGLang's own path does."""
    case = build_case(seed=6, pool_kind="dsa", batch=2, prefix_lens=[64, 3], layer_num=2, metadata="sglang")
    calls = []
    real = case.pool.get_key_buffer

    def counting(layer_id):
        calls.append(layer_id)
        return real(layer_id)

    monkeypatch.setattr(case.pool, "get_key_buffer", counting)
    sg_patch.install("on", propagate=False)
    layer1 = type(case.layer)(case.num_heads, 576, case.layer.scaling, 1, 1, v_head_dim=512)
    with parallel_context(case.sg):
        for _ in range(3):
            for lyr in (case.layer, layer1):
                case.backend.forward_extend(case.q, case.k, case.v, lyr, case.forward_batch)
    assert calls.count(0) == 3 + 1 and calls.count(1) == 3 + 1, calls
    assert sg_patch.stats()["served"] == 6
