"""The README's deployment table, row by row, from SGLang 0.5.23's own code (CPU).

For a model served with ``--attention-backend triton`` on a GPU of compute capability 12 (RTX PRO
6000, sm_120) or 9 (H100/H200, sm_90), SGLang's own functions decide:

* the model family's overrides (``arg_groups/model_overrides/deepseek_v2.py``,
  ``_deepseek_family_overrides``): a DSA model (``is_deepseek_dsa``: ``index_topk`` set) gets
  ``page_size`` 64;
* the DSA KV dtype default and DSA backend resolution (``arg_groups/overrides.py``,
  ``_dsa_kv_cache_dtype_default`` then ``_dsa_split_backend_resolution``), and the default page
  size of everything else (``_page_size_default``);
* the KV dtype (``mem_cache/kv_cache_dtype.py``, ``configure_kv_cache_dtype``);
* the pool (``mem_cache/kv_cache_configurator.py``, ``KVCacheConfigurator._build_token_to_kv_pool``,
  which picks ``_build_dsa_kv_pool`` or ``_build_mla_kv_pool`` and asks
  ``calculate_mla_kv_cache_dim`` for the row width).

Without a GPU or a launched server, what these read from the runtime context is stood in for:
the device capability, the platform (CUDA: not ROCm, NPU, XPU or MUSA), the model config (the
attention fields of a GLM-5 / DeepSeek-V3.2 / DeepSeek-V3 config) and the server arguments as
resolved so far. The pool SGLang builds then goes through kdtree's gate, and is compared with the
pool tests/sglang_harness.py builds for the CPU and GPU tests of the served rows.
"""

from __future__ import annotations

import importlib
import types
from unittest import mock

import pytest
import torch

from sglang_harness import make_pool, parallel_context

from kdtree import sglang_patch
from sglang_env import import_sglang

GLM5 = "GlmMoeDsaForCausalLM"
DSV32 = "DeepseekV32ForCausalLM"
DSV3 = "DeepseekV3ForCausalLM"
PACKED = "pool layout 656-byte row"

# (model, compute capability major, --kv-cache-dtype, extra server args) ->
# (pool class, page size, KV dtype, row width in stored elements, kdtree's fallback key or None = served)
ROWS = [
    (GLM5, 12, "bf16", {}, ("DSATokenToKVPool", 64, torch.bfloat16, 576, None)),
    (GLM5, 12, "auto", {}, ("DSATokenToKVPool", 64, torch.float8_e4m3fn, 656, PACKED)),
    (GLM5, 12, "fp8_e4m3", {}, ("DSATokenToKVPool", 64, torch.float8_e4m3fn, 656, PACKED)),
    (GLM5, 12, "fp8_e4m3", {"dsa_prefill_backend": "trtllm", "dsa_decode_backend": "trtllm"},
     ("DSATokenToKVPool", 64, torch.float8_e4m3fn, 576, None)),
    (GLM5, 9, "auto", {}, ("DSATokenToKVPool", 64, torch.bfloat16, 576, None)),
    (GLM5, 9, "bf16", {}, ("DSATokenToKVPool", 64, torch.bfloat16, 576, None)),
    (GLM5, 9, "fp8_e4m3", {}, ("DSATokenToKVPool", 64, torch.float8_e4m3fn, 656, PACKED)),
    (DSV32, 12, "bf16", {}, ("DSATokenToKVPool", 64, torch.bfloat16, 576, None)),
    (DSV32, 12, "auto", {}, ("DSATokenToKVPool", 64, torch.float8_e4m3fn, 576, None)),
    (DSV32, 12, "fp8_e4m3", {}, ("DSATokenToKVPool", 64, torch.float8_e4m3fn, 576, None)),
    (DSV32, 9, "auto", {}, ("DSATokenToKVPool", 64, torch.bfloat16, 576, None)),
    (DSV32, 9, "bf16", {}, ("DSATokenToKVPool", 64, torch.bfloat16, 576, None)),
    (DSV32, 9, "fp8_e4m3", {}, ("DSATokenToKVPool", 64, torch.float8_e4m3fn, 656, PACKED)),
    (DSV3, 12, "auto", {}, ("MLATokenToKVPool", 1, torch.bfloat16, 576, None)),
    (DSV3, 12, "bf16", {}, ("MLATokenToKVPool", 1, torch.bfloat16, 576, None)),
    (DSV3, 9, "auto", {}, ("MLATokenToKVPool", 1, torch.bfloat16, 576, None)),
    (DSV3, 12, "fp8_e4m3", {}, ("MLATokenToKVPool", 1, torch.float8_e4m3fn, 576, None)),
    (DSV3, 9, "bf16", {}, ("MLATokenToKVPool", 1, torch.bfloat16, 576, None)),
    (DSV3, 9, "bf16", {"page_size": 64}, ("MLATokenToKVPool", 64, torch.bfloat16, 576, None)),
    (DSV3, 9, "fp8_e4m3", {}, ("MLATokenToKVPool", 1, torch.float8_e4m3fn, 576, None)),
]


def _row_id(row):
    model, major, kv, extra, _ = row
    tail = "".join(f"-{k}={v}" for k, v in extra.items())
    return f"{model}-sm{major}0-{kv}{tail}"


def _hf_config(arch: str):
    fields = dict(architectures=[arch], kv_lora_rank=512, qk_rope_head_dim=64)
    if arch != DSV3:
        fields.update(index_topk=2048, index_head_dim=128)   # GLM-5 / DeepSeek-V3.2 indexer
    return types.SimpleNamespace(**fields)


def deploy(arch: str, major: int, kv_cache_dtype: str, extra: dict):
    """What SGLang decides for this deployment: (resolved server arguments, KV dtype, pool)."""
    sg = import_sglang()
    overrides = importlib.import_module("sglang.srt.arg_groups.overrides")
    family = importlib.import_module("sglang.srt.arg_groups.model_overrides.deepseek_v2")
    configurator = importlib.import_module("sglang.srt.mem_cache.kv_cache_configurator")
    kv_dtype_mod = importlib.import_module("sglang.srt.mem_cache.kv_cache_dtype")
    cp_utils = importlib.import_module("sglang.srt.layers.cp.utils")

    hf = _hf_config(arch)
    model_config = types.SimpleNamespace(hf_config=hf, kv_lora_rank=512, qk_rope_head_dim=64,
                                         num_nextn_predict_layers=1)
    cuda = types.SimpleNamespace(is_npu=False, is_xpu=False, is_hip=False, is_musa=False, is_sm100=False)
    args = types.SimpleNamespace(
        kv_cache_dtype=kv_cache_dtype, attention_backend="triton", prefill_attention_backend=None,
        decode_attention_backend=None, dsa_prefill_backend=None, dsa_decode_backend=None, page_size=None,
        enable_hisparse=False, dcp_size=1, enable_prefill_cp=False, speculative_eagle_topk=1,
        disaggregation_mode="null", enable_hierarchical_cache=False, dcp_replicate_q_proj=None,
        dcp_comm_backend=None, _resolved_overrides=[])
    for key, value in extra.items():
        setattr(args, key, value)
    resolved = {}
    with mock.patch.object(overrides, "model_config_of", lambda view: model_config), \
            mock.patch.object(overrides, "get_platform", lambda: cuda), \
            mock.patch.object(family, "get_platform", lambda: cuda), \
            mock.patch("torch.cuda.get_device_capability", lambda *a, **k: (major, 0)):
        resolved.update(family._deepseek_family_overrides(args, hf))
        args._resolved_overrides.append(("_deepseek_family_overrides", dict(resolved)))
        for post in (overrides._dsa_kv_cache_dtype_default, overrides._dsa_split_backend_resolution,
                     overrides._page_size_default):
            resolved.update(post(overrides.ResolvedView(args, dict(resolved))))
    view = overrides.ResolvedView(args, dict(resolved))

    _, kv_dtype = kv_dtype_mod.configure_kv_cache_dtype(
        server_args_kv_cache_dtype=view.kv_cache_dtype, model=None, model_dtype=torch.bfloat16,
        is_draft_worker=False, is_dflash=False, speculative_draft_attention_backend=None)

    exec_ = types.SimpleNamespace(
        kernel=types.SimpleNamespace(dsa_prefill_backend=view.dsa_prefill_backend,
                                     dsa_decode_backend=view.dsa_decode_backend, attention_backend="triton"),
        features=types.SimpleNamespace(enable_memory_saver=False))
    memory = types.SimpleNamespace(enable_hisparse=False, enable_page_major_kv_layout=False,
                                   enable_unified_memory=False, enable_unified_cache_external_linker=False,
                                   enable_hierarchical_cache=False)
    schedule = types.SimpleNamespace(page_size=view.page_size)
    c = object.__new__(configurator.KVCacheConfigurator)
    for key, value in dict(model_config=model_config, kv_cache_dtype=kv_dtype, kv_cache_dtype_str=view.kv_cache_dtype,
                           is_draft_worker=False, mambaish_config=None, use_mla_backend=True, is_hybrid_swa=False,
                           kv_shard_rank=None, device="cpu", page_size=view.page_size,
                           layer_info=types.SimpleNamespace(start_layer=0, end_layer=2,
                                                            num_effective_layers=2)).items():
        setattr(c, key, value)
    with mock.patch.object(configurator, "get_exec", lambda: exec_), \
            mock.patch.object(configurator, "get_memory", lambda: memory), \
            mock.patch.object(configurator, "get_disagg", lambda: types.SimpleNamespace(disaggregation_mode="null")), \
            mock.patch.object(configurator, "get_schedule", lambda: schedule), \
            mock.patch.object(configurator, "max_speculative_num_draft_tokens", lambda: 4), \
            mock.patch.object(cp_utils, "get_glm_dsa_cp_layer_shard_info", lambda runner: (None, 1)), \
            parallel_context(sg):
        pool = c._build_token_to_kv_pool(
            sizes=types.SimpleNamespace(max_total_num_tokens=256, max_running_requests=8),
            is_dsa_model=arch != DSV3, is_dsv4_model=False,
            req_to_token_pool=types.SimpleNamespace(req_to_token=torch.zeros(8, 64, dtype=torch.int32)))
    return view, kv_dtype, pool


@pytest.mark.parametrize("model,major,kv,extra,expected", ROWS, ids=[_row_id(r) for r in ROWS])
def test_deployment_row(model, major, kv, extra, expected):
    pool_class, page_size, kv_dtype, row, reason = expected
    view, got_dtype, pool = deploy(model, major, kv, extra)
    assert type(pool).__name__ == pool_class
    assert view.page_size == page_size == pool.page_size
    assert got_dtype == kv_dtype == pool.dtype
    assert pool.kv_cache_dim == row and pool.get_key_buffer(0).shape[1:] == (1, row)
    assert getattr(pool, "dsa_kv_cache_store_fp8", False) == (row == 656)
    problem = sglang_patch._pool_layout_problem(pool, 0)
    assert (None if problem is None else problem[0]) == reason, problem


@pytest.mark.parametrize("model,major,kv,extra,expected", [r for r in ROWS if r[4][4] is None],
                         ids=[_row_id(r) for r in ROWS if r[4][4] is None])
def test_served_rows_are_the_pools_the_harness_tests(model, major, kv, extra, expected):
    """The served rows' pools are what tests/sglang_harness.py builds (make_pool) for the CPU and GPU
    tests with the real backend: same class, page size, dtype, row and index-key geometry."""
    sg = import_sglang()
    _, _, pool = deploy(model, major, kv, extra)
    kind = "dsa" if model != DSV3 else "mla"
    mine = make_pool(sg, kind, size=256, page_size=pool.page_size, kv_dtype=pool.dtype, layer_num=2, device="cpu",
                     max_running_requests=8, num_draft_tokens=4)
    assert type(mine) is type(pool)
    for attr in ("page_size", "dtype", "store_dtype", "kv_cache_dim", "kv_lora_rank", "qk_rope_head_dim", "start_layer",
                 "end_layer", "index_head_dim", "index_kpool", "dsa_kv_cache_store_fp8", "skip_topk_layers"):
        assert getattr(mine, attr, None) == getattr(pool, attr, None), attr
    assert mine.get_key_buffer(1).shape == pool.get_key_buffer(1).shape
    assert mine.get_key_buffer(1).stride() == pool.get_key_buffer(1).stride()
