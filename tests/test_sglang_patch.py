"""kdtree.sglang_patch against the real SGLang TritonAttnBackend (CPU: Triton interpreter).

Every case builds SGLang's own backend class, MLA pool, RadixAttention and ForwardMetadata
(tests/sglang_harness.py) and calls ``backend.forward_extend`` the way RadixAttention does. The
unpatched original runs on one copy of the inputs, the patched method on an identical copy (same
seed), so the two can be compared bit for bit where that is the claim (off, validate, fallbacks,
the KV rows written) and at bf16 tolerance where kdtree's kernel computes (on). On CPU the kernel
is kdtree's float32 reference (kdtree.ops routes CPU tensors there), so the whole integration runs
end to end; the CUDA kernel itself is covered by tests/test_sglang_gpu.py.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from sglang_harness import (DEFAULT_SCALING, assert_close_bf16, build_case, parallel_context,
                            reference_output)

from kdtree import sglang_patch
from sglang_env import import_sglang

LOGGER = "kdtree.sglang_patch"


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor, so that torch.equal also compares NaN slots."""
    return t.detach().contiguous().view(torch.uint8)


def kernel_must_not_run(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("kdtree's kernel ran on a call the gate should have sent to SGLang")

    monkeypatch.setattr(sglang_patch, "_kernel", refuse)


def triton_must_not_run(case):
    """The original's Triton kernel raises on this backend instance (proves kdtree served it)."""
    def refuse(*args, **kwargs):
        raise AssertionError("SGLang's extend_attention_fwd ran on a call kdtree should have served")

    case.backend.extend_attention_fwd = refuse


# Cases: (name, build_case kwargs). Small shapes: the original runs in Triton's interpreter.
SERVED_CASES = [
    ("tree_b1", dict(batch=1, heads=2, n=4, prefix_lens=[13])),
    # DDTree padding rows see the prefix only (P >= 1 in serving; P = 0 has its own test below)
    ("tree_ragged_b3_pad", dict(batch=3, heads=3, n=5, pad=2, prefix_lens=[1, 2, 17])),
    ("chain_no_mask", dict(batch=2, heads=2, n=3, mask="none", prefix_lens=[0, 4])),
    ("graph_layout", dict(batch=2, heads=2, n=4, graph_layout=True, attn_output=True, prefix_lens=[6, 11])),
    ("n1", dict(batch=2, heads=1, n=1, prefix_lens=[5, 2])),
]


# ------------------------------------------------------------------------------------------------
# the harness itself: the real original on CPU is correct, so comparisons against it mean something
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kwargs", SERVED_CASES[:3], ids=[c[0] for c in SERVED_CASES[:3]])
def test_original_on_cpu_matches_float64_reference(sg_patch, name, kwargs):
    case = build_case(seed=11, **kwargs)
    out = case.call()
    assert out.shape == (case.num_tokens, case.num_heads * 512) and out.dtype == torch.bfloat16
    assert_close_bf16(out, reference_output(case), what=f"SGLang original ({name})")
    assert torch.equal(bits(case.key_buffer()[case.out_cache_loc]), bits(case.k)), "original did not save k"


# ------------------------------------------------------------------------------------------------
# mode parsing, install / uninstall
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,mode", [("on", "on"), (" Validate ", "validate"), ("OFF", "off"), ("", "off")])
def test_parse_mode_accepts(text, mode):
    assert sglang_patch.parse_mode(text) == mode


@pytest.mark.parametrize("text", ["1", "true", "onn", "validation", "none"])
def test_parse_mode_rejects_unknown(text):
    with pytest.raises(ValueError, match="unknown mode"):
        sglang_patch.parse_mode(text)


def test_unknown_env_value_is_an_install_error(sg_patch, monkeypatch):
    monkeypatch.setenv("KDTREE_VERIFY", "yes-please")
    with pytest.raises(ValueError, match="yes-please"):
        sg_patch.install()
    assert not sg_patch.is_installed()


def test_env_selects_mode(sg_patch, monkeypatch):
    monkeypatch.setenv("KDTREE_VERIFY", "validate")
    assert sg_patch.install() == "validate"
    assert sg_patch.mode() == "validate" and sg_patch.is_installed()


def test_install_is_idempotent_and_keeps_original(sg_patch, caplog):
    cls = import_sglang().triton_backend.TritonAttnBackend
    original = cls.forward_extend
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sg_patch.install("on", propagate=False)
        wrapper = cls.forward_extend
        sg_patch.install("on", propagate=False)
        assert cls.forward_extend is wrapper, "a second install must not wrap the wrapper"
        sg_patch.install("validate", propagate=False)
        assert cls.forward_extend is wrapper
    patched_logs = [r for r in caplog.records if "patched SGLang" in r.getMessage()]
    assert len(patched_logs) == 1 and "mode=on" in patched_logs[0].getMessage()
    assert any("on -> validate" in r.getMessage() for r in caplog.records)
    assert wrapper is not original and wrapper.__wrapped__ is original
    assert sg_patch.original_forward_extend() is original
    sg_patch.install("off", propagate=False)
    assert cls.forward_extend is original and not sg_patch.is_installed() and sg_patch.mode() == "off"
    sg_patch.install("on", propagate=False)
    sg_patch.uninstall()
    assert cls.forward_extend is original


def test_autopatch_patches_an_already_imported_backend(sg_patch, monkeypatch):
    import sys

    from kdtree import _autopatch

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))    # the hook goes away afterwards
    monkeypatch.setenv("KDTREE_VERIFY", "Validate")
    assert _autopatch.activate() is True
    assert sg_patch.is_installed() and sg_patch.mode() == "validate"
    assert sum(getattr(f, "_kdtree_autopatch", False) for f in sys.meta_path) == 1
    _autopatch.activate()                                          # idempotent
    assert sum(getattr(f, "_kdtree_autopatch", False) for f in sys.meta_path) == 1
    monkeypatch.setenv("KDTREE_VERIFY", "off")
    sg_patch.uninstall()
    assert _autopatch.activate() is False and not sg_patch.is_installed()


def test_install_propagates_mode_to_environment(sg_patch):
    import os

    sg_patch.install("on")
    assert os.environ["KDTREE_VERIFY"] == "on"   # spawned SGLang processes inherit it
    sg_patch.uninstall()
    assert os.environ["KDTREE_VERIFY"] == "off"


# ------------------------------------------------------------------------------------------------
# off
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kwargs", SERVED_CASES[:2], ids=[c[0] for c in SERVED_CASES[:2]])
def test_off_is_bit_identical_to_unpatched(sg_patch, name, kwargs):
    unpatched = build_case(seed=3, **kwargs)
    ref_out = unpatched.call()
    sg_patch.install("on", propagate=False)
    sg_patch.install("off", propagate=False)
    case = build_case(seed=3, **kwargs)
    out = case.call()
    assert torch.equal(bits(out), bits(ref_out))
    assert torch.equal(bits(case.key_buffer()), bits(unpatched.key_buffer()))
    assert sg_patch.stats()["calls"] == 0


# ------------------------------------------------------------------------------------------------
# on
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kwargs", SERVED_CASES, ids=[c[0] for c in SERVED_CASES])
def test_on_matches_original_and_writes_same_kv(sg_patch, name, kwargs):
    unpatched = build_case(seed=5, **kwargs)
    ref_out = unpatched.call()

    sg_patch.install("on", propagate=False)
    case = build_case(seed=5, **kwargs)
    triton_must_not_run(case)
    out = case.call()

    assert out.shape == (case.num_tokens, case.num_heads * 512) and out.dtype == torch.bfloat16
    assert_close_bf16(out, ref_out.double(), what=f"kdtree vs SGLang ({name})")
    assert_close_bf16(out, reference_output(case), what=f"kdtree vs float64 reference ({name})")
    # the whole pool, NaN slots included, is bit-identical to what the original left
    assert torch.equal(bits(case.key_buffer()), bits(unpatched.key_buffer()))
    if kwargs.get("attn_output"):
        assert out.data_ptr() == case.forward_batch._attn_output.data_ptr()
    s = sg_patch.stats()
    assert (s["calls"], s["served"], s["fallback"]) == (1, 1, 0)


def test_on_rows_that_see_no_key_are_zero(sg_patch):
    """P = 0 and all-False padding rows: such a row sees no key at all; kdtree writes 0 (SGLang
    0.5.23 does too; 0.5.17's kernel divides 0 by 0 there), never NaN."""
    sg_patch.install("on", propagate=False)
    case = build_case(seed=13, batch=2, heads=2, n=4, pad=2, prefix_lens=[0, 3])
    out = case.call()
    assert_close_bf16(out, reference_output(case))
    rows = out.view(case.num_tokens, case.num_heads, 512)
    assert torch.equal(rows[2:4], torch.zeros_like(rows[2:4]))      # request 0, padding rows
    assert rows[6:8].abs().sum() > 0                                # request 1's see its prefix


def test_progress_lines_at_powers_of_ten(sg_patch, caplog):
    sg_patch.install("on", propagate=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for seed in range(2):
            build_case(seed=seed, n=2, prefix_lens=[3]).call()
    progress = [r.getMessage() for r in caplog.records if "kdtree progress" in r.getMessage()]
    assert len(progress) == 1 and "1 served" in progress[0], progress   # at 1, next at 10


def test_on_without_save_kv_cache_leaves_pool_untouched(sg_patch):
    sg_patch.install("on", propagate=False)
    case = build_case(seed=8, batch=2, n=3, prefix_lens=[4, 7])
    before = case.snapshot_pool()
    out = case.call(False)                         # save_kv_cache passed positionally
    assert torch.equal(bits(case.key_buffer()), bits(before))
    assert_close_bf16(out, reference_output(case))  # drafts come from k, not the pool


def test_on_with_unit_kv_scales_saves_like_original(sg_patch):
    def scaled(case):
        case.layer.k_scale = torch.tensor(1.0)
        case.layer.v_scale = torch.tensor(1.0)
        case.layer.k_scale_float = case.layer.v_scale_float = 1.0
        return case

    unpatched = scaled(build_case(seed=9, n=3))
    ref_out = unpatched.call()
    sg_patch.install("on", propagate=False)
    case = scaled(build_case(seed=9, n=3))
    triton_must_not_run(case)
    out = case.call()
    assert_close_bf16(out, ref_out.double())
    assert torch.equal(bits(case.key_buffer()), bits(unpatched.key_buffer()))
    assert sg_patch.stats()["served"] == 1


def _spy_kernel_calls(monkeypatch, fail_first=False):
    """Record (reuse_plan, workspace, whether it packs custom_mask) of every ops.verify_attention call the patch
    makes; with ``fail_first`` the first call raises before launching anything."""
    from kdtree import ops

    calls = []
    real = ops.verify_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("reuse_plan", False), kwargs.get("workspace"), kwargs.get("custom_mask") is not None))
        if fail_first and len(calls) == 1:
            raise RuntimeError("launch failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "verify_attention", spy)
    return calls


def test_on_reuses_tree_mask_and_plan_across_layers_of_one_pass(sg_patch, monkeypatch):
    from kdtree import ops

    calls = _spy_kernel_calls(monkeypatch)
    built = lambda: sum(packs for _, _, packs in calls)   # noqa: E731 - calls that pack the mask (in the call)
    sg_patch.install("on", propagate=False)
    case = build_case(seed=12, batch=2, n=4, layer_num=3, prefix_lens=[5, 8])
    layers = [case.layer] + [type(case.layer)(case.num_heads, 576, DEFAULT_SCALING, 1, i, v_head_dim=512)
                             for i in (1, 2)]
    with parallel_context(case.sg):
        outs = [case.backend.forward_extend(case.q, case.k, case.v, lyr, case.forward_batch) for lyr in layers]
    assert [packs for _, _, packs in calls] == [True, False, False], \
        "one forward pass (layers 0, 1, 2) must pack the mask once, in its first layer's call"
    assert [reuse for reuse, _, _ in calls] == [False, True, True], "layers after the first reuse the plan"
    workspaces = {id(ws) for _, ws, _ in calls}
    assert len(workspaces) == 1 and isinstance(calls[0][1], ops.Workspace), "the backend's own workspace"
    assert calls[0][1] is not ops._shared_workspace
    for lyr, out in zip(layers, outs):
        case.layer = lyr
        assert_close_bf16(out, reference_output(case), what=f"layer {lyr.layer_id}")
    case.layer = layers[0]
    case.call()                                    # layer 0 again: a new pass packs and plans again
    assert built() == 2 and calls[-1][0] is False
    case.backend.forward_metadata = copy.copy(case.backend.forward_metadata)
    case.layer = layers[1]
    case.call()                                    # new metadata object: a new pass, even at layer 1
    assert built() == 3 and calls[-1][0] is False


def test_on_failed_launch_leaves_no_plan_to_reuse(sg_patch, monkeypatch):
    calls = _spy_kernel_calls(monkeypatch, fail_first=True)
    sg_patch.install("on", propagate=False)
    case = build_case(seed=13, batch=2, n=4, layer_num=2, prefix_lens=[5, 8])
    layer1 = type(case.layer)(case.num_heads, 576, DEFAULT_SCALING, 1, 1, v_head_dim=512)
    with pytest.raises(RuntimeError, match="launch failed"):
        case.call()                                # layer 0: the launch fails
    case.layer = layer1
    out = case.call()                              # layer 1 of the same pass must plan afresh
    assert [(reuse, packs) for reuse, _, packs in calls] == [(False, True), (False, True)]
    assert_close_bf16(out, reference_output(case))


# ------------------------------------------------------------------------------------------------
# validate
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,kwargs", [SERVED_CASES[1], SERVED_CASES[3]], ids=[SERVED_CASES[1][0], SERVED_CASES[3][0]])
def test_validate_returns_original_and_counts(sg_patch, name, kwargs):
    unpatched = build_case(seed=21, **kwargs)
    ref_out = unpatched.call()
    sg_patch.install("validate", propagate=False)
    case = build_case(seed=21, **kwargs)
    out = case.call()
    assert torch.equal(bits(out), bits(ref_out)), "validate must return the original's output"
    assert torch.equal(bits(case.key_buffer()), bits(unpatched.key_buffer()))
    s = sg_patch.stats()
    assert (s["calls"], s["served"], s["compared"], s["mismatched"]) == (1, 1, 1, 0)
    assert 0 < s["max_abs_err"] < 0.05 and s["max_tolerance_ratio"] < 1
    assert s["last_mismatch"] is None


@pytest.mark.parametrize("poison", ["offset", "nan"])
def test_validate_reports_a_wrong_kernel(sg_patch, monkeypatch, caplog, poison):
    real_kernel = sglang_patch._kernel
    where = (2, 1, 300)   # (token, head, dim)

    def wrong_kernel(backend, q, k, layer, out3, capturing):
        kv_dtype = real_kernel(backend, q, k, layer, out3, capturing)
        out3[where] = float("nan") if poison == "nan" else out3[where].float() + 0.5
        return kv_dtype

    monkeypatch.setattr(sglang_patch, "_kernel", wrong_kernel)
    unpatched = build_case(seed=4, batch=1, heads=2, n=4)
    ref_out = unpatched.call()
    sg_patch.install("validate", propagate=False)
    case = build_case(seed=4, batch=1, heads=2, n=4)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = case.call()
        case2 = build_case(seed=4, batch=1, heads=2, n=4)
        case2.call()                                # a second mismatch right away: rate-limited
    assert torch.equal(bits(out), bits(ref_out))
    s = sg_patch.stats()
    assert (s["compared"], s["mismatched"]) == (2, 2)
    m = s["last_mismatch"]
    assert m["worst_index"] == where and m["mismatched_elements"] == 1 and m["layer_id"] == 0
    assert m["tolerance_ratio"] > 1
    if poison == "nan":
        assert m["max_abs_err"] == float("inf")
    else:
        assert 0.4 < m["max_abs_err"] < 0.6
    warnings = [r for r in caplog.records if "mismatch" in r.getMessage()]
    assert len(warnings) == 1, "mismatch logs must be rate-limited"
    assert "token 2, head 1, dim 300" in warnings[0].getMessage()


def test_validate_survives_a_kernel_error(sg_patch, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(sglang_patch, "_kernel", broken)
    unpatched = build_case(seed=6)
    ref_out = unpatched.call()
    sg_patch.install("validate", propagate=False)
    out = build_case(seed=6).call()
    assert torch.equal(bits(out), bits(ref_out))
    s = sg_patch.stats()
    assert (s["kernel_errors"], s["compared"]) == (1, 0)


# ------------------------------------------------------------------------------------------------
# the gate
# ------------------------------------------------------------------------------------------------

def _sinks(case):
    return (True, torch.zeros(case.num_heads)), {}


def _sinks_kw(case):
    return (), {"sinks": torch.full((case.num_heads,), 0.5)}


FALLBACKS = [
    # (id, build_case kwargs, extra positional/keyword args, expected reason key)
    ("extend", dict(forward_mode="EXTEND"), None, "not target verify"),
    ("draft_extend", dict(forward_mode="DRAFT_EXTEND_V2"), None, "not target verify"),
    ("draft_runner", dict(is_draft_runner=True), None, "draft runner"),
    ("non_mla", dict(use_mla=False), None, "not MLA"),
    ("sinks_positional", dict(), _sinks, "sinks"),
    ("sinks_keyword", dict(), _sinks_kw, "sinks"),
    ("fp8_e5m2_pool", dict(kv_dtype=torch.float8_e5m2), None, "kv cache torch.float8_e5m2"),
]


@pytest.mark.parametrize("name,kwargs,extra,reason", FALLBACKS, ids=[f[0] for f in FALLBACKS])
def test_gate_sends_to_original(sg_patch, monkeypatch, caplog, name, kwargs, extra, reason):
    unpatched = build_case(seed=31, n=3, **kwargs)
    args, kw = extra(unpatched) if extra else ((), {})
    ref_out = unpatched.call(*args, **kw)

    sg_patch.install("on", propagate=False)
    kernel_must_not_run(monkeypatch)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        outs = []
        for _ in range(2):
            case = build_case(seed=31, n=3, **kwargs)
            args, kw = extra(case) if extra else ((), {})
            outs.append(case.call(*args, **kw))
    for out in outs:
        assert torch.equal(bits(out), bits(ref_out))
    assert torch.equal(bits(case.key_buffer()), bits(unpatched.key_buffer()))
    s = sg_patch.stats()
    assert s["fallback"] == 2 and s["served"] == 0 and s["fallback_reasons"] == {reason: 2}
    logged = [r for r in caplog.records if "falling back" in r.getMessage()]
    assert len(logged) == 1, "each fallback reason is logged once, not per call"


def test_gate_too_many_verify_tokens(sg_patch, monkeypatch):
    sg_patch.install("on", propagate=False)
    kernel_must_not_run(monkeypatch)
    case = build_case(seed=2, n=3)
    case.backend.forward_metadata.max_extend_len = sglang_patch.MAX_VERIFY_TOKENS + 1
    out = case.call()
    assert_close_bf16(out, reference_output(case))
    assert sg_patch.stats()["fallback_reasons"] == {"verify tokens": 1}


def test_gate_reasons_for_paths_the_cpu_original_cannot_run(sg_patch):
    """Sliding window, DCP, deterministic mode, logit cap and score_mod need machinery the harness
    does not build (window metadata, DCP groups); check the gate's decision on the real objects."""
    case = build_case(seed=1)

    def reason(**extras):
        r = sglang_patch._gate(case.backend, case.q, case.k, case.v, case.layer, case.forward_batch, extras, False)
        return None if r is None else r[0]

    assert reason() is None
    assert reason(score_mod=lambda s: s) == "score_mod"
    assert reason(aux_tensors=[torch.zeros(1)]) == "aux_tensors"
    for obj, attr, value, key in [
        (case.layer, "sliding_window_size", 64, "sliding window"),
        (case.layer, "logit_cap", 30.0, "logit cap"),
        (case.backend, "dcp_size", 2, "DCP"),
        (case.backend, "enable_deterministic", True, "deterministic"),
        (case.layer, "tp_k_head_num", 2, "layer dims"),
        (case.layer, "v_head_dim", 128, "layer dims"),
    ]:
        old = getattr(obj, attr)
        setattr(obj, attr, value)
        try:
            assert reason() == key, attr
        finally:
            setattr(obj, attr, old)
    # KV scales are served (SGLang's k_descale / v_descale); ones that are not finite positive numbers are not
    case.layer.k_scale, case.layer.k_scale_float = torch.tensor(2.0), 2.0
    assert reason() is None   # (k_scale alone: SGLang's kernel takes descales 1.0)
    case.layer.v_scale, case.layer.v_scale_float = torch.tensor(0.5), 0.5
    assert reason() is None and sglang_patch._kv_descales(case.layer) == (2.0, 0.5)
    for bad in (float("nan"), 0.0, -1.0, None):
        case.layer.v_scale_float = bad
        assert reason() == "kv scales", bad
