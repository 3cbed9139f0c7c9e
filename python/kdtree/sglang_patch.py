"""kdtree inside SGLang: a gated override of ``TritonAttnBackend.forward_extend``.

SGLang's Triton backend sends every TARGET_VERIFY step through ``forward_extend`` (there is no
verify method of its own). This module replaces that method on the class (so the hybrid and
two-batch wrappers, which call ``self.forward_extend``, see it too) with a wrapper that serves the
calls kdtree's kernel can serve and hands everything else to the original, untouched.

Modes (``KDTREE_VERIFY`` or the ``mode`` argument of :func:`install`; unknown values raise):

``off`` (default)
    SGLang is left as it is: :func:`install` restores the original method if it was patched.
``on``
    Served calls write the new KV rows exactly as the original does (the pool's
    ``set_kv_buffer`` at ``forward_batch.out_cache_loc``, the same KV-scale handling), then run
    kdtree's kernel (prefix from the pool, drafts from ``k``) into SGLang's output
    ``[T, H * 512]`` (``forward_batch._attn_output`` when set). No host synchronisation and no
    tensor value read on the host: capturable in a CUDA graph.
``validate``
    Served calls run the original (which saves the KV rows) and the kernel on the same inputs,
    compare them at a bf16-level tolerance and return the original's output. The comparison reads
    host values, so it is skipped while a CUDA graph is captured (replays run only the original).

The gate (SGLANG.md, "Recognising a call to serve"): TARGET_VERIFY, not the draft runner, an MLA
layer (576/512, one KV head, at most 128 heads), ``k``/``v`` given, no sinks / score_mod /
aux_tensors / sliding window / logit cap / DCP / deterministic mode / dLLM, bfloat16 ``q``/``k``,
a KV pool that stores the layer in the layout the kernel reads (:func:`_pool_layout_problem`:
decided by layout, not by class, so ``MLATokenToKVPool`` and its subclasses such as the DSA pool
are served when their rows are 576 values of a dtype in :data:`SERVED_KV_DTYPES`; the packed DSA
FP8 row and FP4 pools fall back; bf16 and e4m3 pools are served), KV scales absent or finite and positive
(SGLang's k_descale / v_descale, applied to the prefix keys), at most 512 verify tokens per request. Each distinct
reason for falling back is logged once per process.

Page size: SGLang's Triton backend hands ``kv_indices`` as token slot ids at every page size (its
own kernel turns a slot into ``page * page_stride + offset * slot_stride``, which is
``slot * slot_stride``), and ``out_cache_loc`` names token slots too. kdtree's kernel reads row
``kv_indices[i]`` of the ``[S, 576]`` pool view, so the page size never enters the gate, the KV save,
the kernel, the mask packing or validate mode.

Counters (:func:`stats`) count what Python sees: eager calls and CUDA-graph captures, not graph
replays (no Python runs during a replay). They are per process: in a server they live in the
scheduler / TP worker processes, which log a summary at exit.

Public API: :func:`install`, :func:`uninstall`, :func:`stats`, :func:`reset_stats`, :func:`mode`,
:func:`is_installed`, :func:`original_forward_extend`, :func:`parse_mode`.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import logging
import math
import os
import sys
import threading
import time
import weakref
from typing import Any, Dict, Optional, Tuple

import torch

from . import layout, ops

logger = logging.getLogger(__name__)

__all__ = [
    "ENV_VAR", "MODES", "install", "uninstall", "stats", "reset_stats", "mode", "is_installed",
    "original_forward_extend", "parse_mode",
]

ENV_VAR = "KDTREE_VERIFY"
MODES = ("off", "validate", "on")
BACKEND_MODULE = "sglang.srt.layers.attention.triton_backend"
BACKEND_CLASS = "TritonAttnBackend"

HEAD_DIM_QK = 576
HEAD_DIM_V = 512
MAX_HEADS = 128
#: verify tokens per request the kernel serves (8 mask words of 64 bits)
MAX_VERIFY_TOKENS = 512
#: KV-cache dtypes the kernel reads from the pool (the one place to add a dtype the kernel learns): bf16, and the
#: e4m3 rows of ``--kv-cache-dtype fp8_e4m3`` (the FP8 kernel)
SERVED_KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
#: validate mode: |kernel - original| <= ATOL + RTOL * |original| elementwise (both are bf16
#: roundings of float32 accumulations; bf16 has an 8-bit mantissa, so 2^-6 covers two roundings
#: plus the original's bf16 cast of the softmax weights)
DEFAULT_ATOL = 2e-2
DEFAULT_RTOL = 2e-2
#: validate mode on an e4m3 pool, per (token, head) row: rms(kernel - SGLang) <= FP8_ATOL + FP8_RTOL * rms(SGLang).
#: SGLang's own fp8 numerics (e4m3 q unscaled, e4m3 P) put its output 3-4% (relative L2) off the exact result on
#: N(0, 1) data and its worst row 12% off (tests/fp8_model.py: prefixes 0 to 8000, 16 to 128 heads); kdtree's is
#: 0.2-1.1% (H100). 0.3 holds that worst row 2.4x over, and a wrong row (~100% off) fails it. Larger queries (|q| ~ 30) move
#: SGLang's own output further (its unscaled e4m3 cast of q), and validate reports that as mismatches.
DEFAULT_FP8_ATOL = 1e-2
DEFAULT_FP8_RTOL = 3e-1
#: validate mode: at most one mismatch log line per this many seconds (the first is always logged)
MISMATCH_LOG_INTERVAL_S = 10.0

# ------------------------------------------------------------------------------------------------
# mode
# ------------------------------------------------------------------------------------------------


def parse_mode(value: Optional[str] = None) -> str:
    """The kdtree mode from ``value``, or from ``$KDTREE_VERIFY`` when ``value`` is None.

    Accepts ``off``, ``validate``, ``on`` (case and surrounding blanks ignored); unset or empty
    means ``off``. Anything else raises ValueError: a typo must never silently turn kdtree off.
    """
    source = "argument"
    if value is None:
        value = os.environ.get(ENV_VAR, "")
        source = f"${ENV_VAR}"
    if not isinstance(value, str):
        raise TypeError(f"kdtree mode must be a string ({', '.join(MODES)}), got {type(value).__name__}")
    text = value.strip().lower()
    if text == "":
        return "off"
    if text not in MODES:
        raise ValueError(f"kdtree: unknown mode {value!r} from {source}; expected one of {', '.join(MODES)}")
    return text


# ------------------------------------------------------------------------------------------------
# process state
# ------------------------------------------------------------------------------------------------


class _Counters:
    __slots__ = ("calls", "served", "fallback", "fallback_reasons", "compared", "mismatched",
                 "skipped_capture", "kernel_errors", "max_abs_err", "max_rel_err", "max_tolerance_ratio",
                 "last_mismatch")

    def __init__(self):
        self.calls = 0                 # patched calls seen (mode validate/on)
        self.served = 0                # calls that passed the gate
        self.fallback = 0              # calls sent to the original by the gate
        self.fallback_reasons: Dict[str, int] = {}
        self.compared = 0              # validate: comparisons done
        self.mismatched = 0            # validate: comparisons outside the tolerance
        self.skipped_capture = 0       # validate: served calls not compared (CUDA-graph capture)
        self.kernel_errors = 0         # validate: kernel raised (the original's output was returned)
        self.max_abs_err = 0.0         # validate: largest max-abs error seen
        self.max_rel_err = 0.0         # validate: max abs err / max |original| of one comparison
        self.max_tolerance_ratio = 0.0 # validate: max of |err| / (atol + rtol |original|); > 1 = mismatch
        self.last_mismatch: Optional[Dict[str, Any]] = None


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.mode = "off"
        self.cls = None                # the patched class
        self.original = None           # the unpatched forward_extend function
        self.had_own_attr = True       # forward_extend was in cls.__dict__ (else inherited)
        self.atol = DEFAULT_ATOL
        self.rtol = DEFAULT_RTOL
        self.fp8_atol = DEFAULT_FP8_ATOL
        self.fp8_rtol = DEFAULT_FP8_RTOL
        self.counters = _Counters()
        self.logged_reasons = set()
        self.last_mismatch_log = -math.inf
        self.mismatch_logs_suppressed = 0
        self.set_env = False
        self.next_progress_log = 1     # served-call count of the next progress line (x10 each time)


_state = _State()


def mode() -> str:
    """The active mode of this process: ``off``, ``validate`` or ``on``."""
    return _state.mode


def is_installed() -> bool:
    """True while ``TritonAttnBackend.forward_extend`` is kdtree's wrapper."""
    cls = _state.cls
    return cls is not None and _is_wrapper(getattr(cls, "forward_extend", None))


def original_forward_extend():
    """SGLang's own ``TritonAttnBackend.forward_extend`` (also when patched); imports SGLang."""
    if _state.original is not None:
        return _state.original
    fn = getattr(_backend_class(), "forward_extend")
    return getattr(fn, "__wrapped__", fn) if _is_wrapper(fn) else fn


def stats() -> Dict[str, Any]:
    """A snapshot of this process's counters.

    Keys: ``mode``, ``installed``, ``calls`` (patched calls seen while validate/on), ``served``
    (passed the gate: the kernel's result was returned (on) or compared (validate)),
    ``fallback`` and ``fallback_reasons`` ({reason: calls}), and for validate ``compared``,
    ``mismatched``, ``skipped_capture`` (served during a CUDA-graph capture, not compared),
    ``kernel_errors``, ``max_abs_err`` (largest ``|kernel - original|``), ``max_rel_err`` (that over
    the largest ``|original|`` of the same call), ``max_tolerance_ratio`` (largest
    ``|err| / (atol + rtol * |original|)``: above 1 is a mismatch) and ``last_mismatch`` (a dict
    with ``layer_id``, ``num_tokens``, ``num_heads``, ``max_abs_err``, ``max_rel_err``,
    ``tolerance_ratio``, ``mismatched_elements``, ``worst_index`` (token, head, dim), ``kernel``,
    ``original``) or None.
    CUDA-graph replays run no Python and are not counted.
    """
    with _state.lock:
        c = _state.counters
        return {
            "mode": _state.mode,
            "installed": is_installed(),
            "atol": _state.atol,
            "rtol": _state.rtol,
            "fp8_atol": _state.fp8_atol,
            "fp8_rtol": _state.fp8_rtol,
            "calls": c.calls,
            "served": c.served,
            "fallback": c.fallback,
            "fallback_reasons": dict(c.fallback_reasons),
            "compared": c.compared,
            "mismatched": c.mismatched,
            "skipped_capture": c.skipped_capture,
            "kernel_errors": c.kernel_errors,
            "max_abs_err": c.max_abs_err,
            "max_rel_err": c.max_rel_err,
            "max_tolerance_ratio": c.max_tolerance_ratio,
            "last_mismatch": None if c.last_mismatch is None else dict(c.last_mismatch),
        }


def reset_stats() -> None:
    """Zero the counters; fallback reasons and mismatches are logged afresh afterwards."""
    with _state.lock:
        _state.counters = _Counters()
        _state.logged_reasons.clear()
        _state.last_mismatch_log = -math.inf
        _state.mismatch_logs_suppressed = 0
        _state.next_progress_log = 1


# ------------------------------------------------------------------------------------------------
# install / uninstall
# ------------------------------------------------------------------------------------------------


def _backend_class(backend_module=None):
    module = backend_module if backend_module is not None else importlib.import_module(BACKEND_MODULE)
    return getattr(module, BACKEND_CLASS)


def _is_wrapper(fn) -> bool:
    return getattr(fn, "_kdtree_wrapper", False) is True


def _sglang_version() -> str:
    module = sys.modules.get("sglang")
    return getattr(module, "__version__", "?") if module is not None else "?"


def install(mode: Optional[str] = None, *, atol: Optional[float] = None, rtol: Optional[float] = None,
            fp8_atol: Optional[float] = None, fp8_rtol: Optional[float] = None,
            propagate: bool = True, backend_module=None) -> str:
    """Patch SGLang's ``TritonAttnBackend.forward_extend`` in this process; returns the mode.

    Args:
        mode: ``off``, ``validate`` or ``on``; None reads ``$KDTREE_VERIFY`` (unset = off).
            An unknown value raises ValueError. ``off`` restores the original method.
        atol, rtol: validate mode's tolerance (default :data:`DEFAULT_ATOL`, :data:`DEFAULT_RTOL`).
        fp8_atol, fp8_rtol: validate mode's bound on an e4m3 pool, per (token, head) row on the rms of the
            difference (default :data:`DEFAULT_FP8_ATOL`, :data:`DEFAULT_FP8_RTOL`).
        propagate: also set ``$KDTREE_VERIFY`` to the mode, so that processes SGLang spawns
            (scheduler, TP workers) patch themselves at start through the ``kdtree-autopatch.pth``
            file the package installs.
        backend_module: the ``triton_backend`` module object (the import hook passes it);
            default: import it.

    Idempotent: a second call only changes the mode (logged); the original stays reachable as
    :func:`original_forward_extend` and as the wrapper's ``__wrapped__``.
    """
    new_mode = parse_mode(mode)
    with _state.lock:
        if atol is not None:
            _state.atol = float(atol)
        if rtol is not None:
            _state.rtol = float(rtol)
        if fp8_atol is not None:
            _state.fp8_atol = float(fp8_atol)
        if fp8_rtol is not None:
            _state.fp8_rtol = float(fp8_rtol)
        if propagate and (mode is not None or ENV_VAR in os.environ):
            os.environ[ENV_VAR] = new_mode
            _state.set_env = True
        if new_mode == "off":
            if is_installed():
                _restore()
                logger.info("kdtree: mode off: SGLang %s %s.forward_extend restored to the original",
                            _sglang_version(), BACKEND_CLASS)
            _state.mode = "off"
            return "off"

        cls = _backend_class(backend_module)
        current = getattr(cls, "forward_extend")
        if _is_wrapper(current) and _state.cls is cls and current.__wrapped__ is _state.original:
            if _state.mode != new_mode:
                logger.info("kdtree: SGLang %s.forward_extend mode %s -> %s", BACKEND_CLASS, _state.mode, new_mode)
            _state.mode = new_mode
            return new_mode
        # a wrapper left by an earlier copy of this module (reload) wraps the real original
        original = current.__wrapped__ if _is_wrapper(current) else current
        _state.cls = cls
        _state.original = original
        _state.had_own_attr = "forward_extend" in cls.__dict__ or _is_wrapper(current)
        wrapper = _make_wrapper(original)
        _state.mode = new_mode
        setattr(cls, "forward_extend", wrapper)
        logger.info("kdtree: patched SGLang %s %s.%s.forward_extend, mode=%s (serves MLA TARGET_VERIFY; "
                    "everything else runs the original)", _sglang_version(), cls.__module__, cls.__name__, new_mode)
        return new_mode


def uninstall() -> None:
    """Restore SGLang's original ``forward_extend`` (no-op when not patched); mode becomes off."""
    with _state.lock:
        if is_installed():
            _restore()
            logger.info("kdtree: %s.forward_extend restored to the original", BACKEND_CLASS)
        elif _state.cls is not None and _state.original is not None:
            current = getattr(_state.cls, "forward_extend", None)
            if current is not _state.original:
                logger.warning("kdtree: %s.forward_extend was replaced by someone else after kdtree patched it; "
                               "left as it is", BACKEND_CLASS)
        _state.mode = "off"
        if _state.set_env:
            os.environ[ENV_VAR] = "off"
            _state.set_env = False


def _restore() -> None:
    cls, original = _state.cls, _state.original
    if _state.had_own_attr:
        setattr(cls, "forward_extend", original)
    else:
        delattr(cls, "forward_extend")


# ------------------------------------------------------------------------------------------------
# the wrapper
# ------------------------------------------------------------------------------------------------

#: parameters of forward_extend after (self, q, k, v, layer, forward_batch) that must be None to serve
_MUST_BE_NONE = ("sinks", "score_mod", "aux_tensors")


def _extra_param_names(original) -> Tuple[str, ...]:
    """Names of the positional parameters after ``forward_batch`` (0.5.23: save_kv_cache, sinks,
    score_mod, aux_tensors; 0.5.17 the same), so that positional extras can be named."""
    try:
        params = list(inspect.signature(original).parameters.values())
    except (TypeError, ValueError):
        return ("save_kv_cache", "sinks", "score_mod", "aux_tensors")
    names = []
    for p in params[6:]:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return tuple(names)


def _make_wrapper(original):
    extra_names = _extra_param_names(original)

    @functools.wraps(original)
    def forward_extend(self, q, k, v, layer, forward_batch, *args, **kwargs):
        run_mode = _state.mode
        if run_mode == "off":
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        _state.counters.calls += 1
        extras = dict(kwargs)
        for name, value in zip(extra_names, args):
            extras[name] = value
        reason = _gate(self, q, k, v, layer, forward_batch, extras, len(args) > len(extra_names))
        if reason is not None:
            _fall_back(reason)
            return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
        _state.counters.served += 1
        if _state.counters.served >= _state.next_progress_log:
            _log_progress()
        if run_mode == "on":
            return _serve(self, q, k, v, layer, forward_batch, extras.get("save_kv_cache", True))
        return _validate(original, self, q, k, v, layer, forward_batch, args, kwargs)

    forward_extend._kdtree_wrapper = True
    return forward_extend


def _fall_back(reason: Tuple[str, str]) -> None:
    key, detail = reason
    c = _state.counters
    c.fallback += 1
    c.fallback_reasons[key] = c.fallback_reasons.get(key, 0) + 1
    if key not in _state.logged_reasons:
        _state.logged_reasons.add(key)
        logger.info("kdtree: falling back to SGLang's forward_extend: %s (logged once per reason)", detail)


# ------------------------------------------------------------------------------------------------
# the gate: host-side attributes, shapes and dtypes only (CUDA-graph safe)
# ------------------------------------------------------------------------------------------------


def _gate(backend, q, k, v, layer, fb, extras, too_many_args) -> Optional[Tuple[str, str]]:
    """None when kdtree serves the call, else (reason key, detail)."""
    forward_mode = getattr(fb, "forward_mode", None)
    if forward_mode is None or not forward_mode.is_target_verify():
        return "not target verify", f"forward mode {getattr(forward_mode, 'name', forward_mode)} is not TARGET_VERIFY"
    if getattr(backend, "is_draft_runner", False):
        return "draft runner", "the draft model's backend (is_draft_runner)"
    if not getattr(backend, "use_mla", False):
        return "not MLA", "the backend is not MLA (use_mla False)"
    if (getattr(layer, "qk_head_dim", None) != HEAD_DIM_QK or getattr(layer, "v_head_dim", None) != HEAD_DIM_V
            or getattr(layer, "tp_k_head_num", None) != 1):
        return "layer dims", (f"layer dims qk={getattr(layer, 'qk_head_dim', None)} v={getattr(layer, 'v_head_dim', None)} "
                              f"kv_heads={getattr(layer, 'tp_k_head_num', None)} (served: 576/512, 1 KV head)")
    heads = getattr(layer, "tp_q_head_num", 0)
    if not 1 <= heads <= MAX_HEADS:
        return "heads", f"{heads} query heads per rank (served: 1..{MAX_HEADS})"
    if k is None or v is None:
        return "k/v None", "k/v not given (read-back path)"
    if too_many_args:
        return "extra arguments", "more positional arguments than forward_extend declares"
    for name in _MUST_BE_NONE:
        if extras.get(name) is not None:
            return name, f"{name} given"
    for name, value in extras.items():
        if name not in ("save_kv_cache",) and name not in _MUST_BE_NONE and value is not None:
            return f"argument {name}", f"unknown argument {name}={type(value).__name__}"
    sliding = getattr(layer, "sliding_window_size", -1)
    if sliding is not None and sliding > -1:
        return "sliding window", f"sliding window {sliding}"
    if (getattr(layer, "logit_cap", 0) or 0) > 0:
        return "logit cap", f"logit cap {layer.logit_cap}"
    if (getattr(layer, "xai_temperature_len", -1) or -1) > 0:
        return "xai temperature", "xai temperature scaling"
    if getattr(layer, "is_cross_attention", False):
        return "cross attention", "cross attention"
    attn_type = getattr(layer, "attn_type", None)
    if attn_type is not None and getattr(attn_type, "name", "DECODER") != "DECODER":
        return "attention type", f"attention type {attn_type}"
    if getattr(backend, "dcp_size", 1) != 1:
        return "DCP", f"decode context parallel (dcp_size {backend.dcp_size})"
    if getattr(backend, "enable_deterministic", False):
        return "deterministic", "deterministic inference (a different kernel and mask semantics)"
    if getattr(backend, "dllm_attention", None) is not None:
        return "dLLM", "dLLM attention"
    if getattr(fb, "mha_one_shot", False):
        return "mha one shot", "MHA one-shot prefill"
    if getattr(backend, "use_verify_shared_kv", False) or getattr(backend, "use_verify_splitkv", False):
        return "ROCm verify path", "the backend's split-KV verify path is enabled (ROCm)"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        return "dtype", f"q {q.dtype}, k {k.dtype} (served: bfloat16)"
    scales = _kv_descales(layer)
    if scales is None:
        return "kv scales", (f"KV scales k_scale_float={getattr(layer, 'k_scale_float', None)!r}, "
                             f"v_scale_float={getattr(layer, 'v_scale_float', None)!r} (served: finite and > 0)")
    T = q.shape[0]
    if T < 1:
        return "empty", "no verify tokens"
    if not ((q.dim() == 3 and tuple(q.shape[1:]) == (heads, HEAD_DIM_QK))
            or (q.dim() == 2 and q.shape[1] == heads * HEAD_DIM_QK)):
        return "q shape", f"q shape {tuple(q.shape)} (served: [T, {heads}, 576])"
    if not ((k.dim() == 3 and tuple(k.shape) == (T, 1, HEAD_DIM_QK)) or (k.dim() == 2 and tuple(k.shape) == (T, HEAD_DIM_QK))):
        return "k shape", f"k shape {tuple(k.shape)} (served: [T, 1, 576])"
    problem = _pool_layout_verdict(getattr(backend, "token_to_kv_pool", None), layer.layer_id)
    if problem is not None:
        return problem
    md = getattr(backend, "forward_metadata", None)
    max_n = getattr(md, "max_extend_len", None)
    if md is None or getattr(md, "qo_indptr", None) is None or getattr(md, "kv_indptr", None) is None:
        return "metadata", "forward_metadata without qo_indptr/kv_indptr"
    if isinstance(max_n, bool) or not isinstance(max_n, int) or not 1 <= max_n <= MAX_VERIFY_TOKENS:
        return "verify tokens", f"max_extend_len {max_n!r} (served: 1..{MAX_VERIFY_TOKENS} verify tokens per request)"
    if md.kv_indptr.dtype != torch.int32 or md.kv_indices.dtype not in (torch.int32, torch.int64) \
            or md.qo_indptr.dtype not in (torch.int32, torch.int64):
        return "index dtypes", (f"index dtypes kv_indptr {md.kv_indptr.dtype}, kv_indices {md.kv_indices.dtype}, "
                                f"qo_indptr {md.qo_indptr.dtype}")
    if q.is_cuda:
        problem = _cuda_problem(q.device)
        if problem is not None:
            return "device", problem
    return None


def _kv_descales(layer) -> Optional[Tuple[float, float]]:
    """(k_scale, v_scale) of the prefix keys as SGLang's forward_extend hands them to its kernel (``k_descale`` /
    ``v_descale``): the layer's ``k_scale_float`` / ``v_scale_float`` when both ``k_scale`` and ``v_scale`` are set,
    else 1.0 and 1.0; None when those floats are not finite positive numbers (the call falls back). Host values only."""
    if getattr(layer, "k_scale", None) is None or getattr(layer, "v_scale", None) is None:
        return 1.0, 1.0
    ks, vs = getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None)
    try:
        ks, vs = float(ks), float(vs)
    except (TypeError, ValueError):
        return None
    if not (math.isfinite(ks) and math.isfinite(vs) and ks > 0 and vs > 0):
        return None
    return ks, vs


def _served_dtypes_text() -> str:
    return ", ".join(str(d).replace("torch.", "") for d in SERVED_KV_DTYPES)


def _pool_layout_problem(pool, layer_id: int) -> Optional[Tuple[str, str]]:
    """None when ``pool`` stores layer ``layer_id`` the way the kernel reads it, else (reason key, detail).

    Decided by layout, never by class name: SGLang builds ``MLATokenToKVPool`` and subclasses of it
    (``DSATokenToKVPool`` for DSA models, its layer-split, HiSparse and page-interleaved variants,
    the unified pool), and any of them is served when the kernel's reads and SGLang's agree:

    1. the pool has ``get_key_buffer`` / ``get_value_buffer`` [``pool <class>``];
    2. a stored row is 576 values (the pool's ``kv_cache_dim`` where it declares one), not e.g. the
       packed DSA FP8 row of 656 bytes (512 e4m3, 4 fp32 per-128 scales, 64 bf16 rope)
       [``pool layout <n>-byte row``];
    3. the pool's dtype is in :data:`SERVED_KV_DTYPES` [``kv cache <dtype>``]; checked before
       ``get_key_buffer``, which dequantizes the whole layer for an FP4 pool;
    4. ``get_key_buffer(layer_id)`` is ``[S, 1, 576]`` or ``[S, 576]``, unit inner stride, in the
       pool's dtype [``kv cache <dtype>``, ``pool layout``];
    5. ``get_value_buffer(layer_id)`` is that buffer's first 512 columns (the kernel takes the
       values from the key rows) [``pool layout``].

    The order makes the reason name the first thing that differs (the packed FP8 row reports its
    layout, not its dtype). Rows are token slots: the pool's page size does not matter.
    """
    name = type(pool).__name__
    if not (callable(getattr(pool, "get_key_buffer", None)) and callable(getattr(pool, "get_value_buffer", None))):
        return f"pool {name}", f"KV pool {name} has no get_key_buffer/get_value_buffer (not an MLA pool)"
    pool_dtype = getattr(pool, "dtype", None)
    row = getattr(pool, "kv_cache_dim", None)
    if isinstance(row, int) and row != HEAD_DIM_QK:
        store = getattr(pool, "store_dtype", pool_dtype)
        row_bytes = row * (store.itemsize if isinstance(store, torch.dtype) else 1)
        what = (f"packed FP8 rows of {row_bytes} bytes (512 e4m3, 4 fp32 per-128 scales, 64 bf16 rope)"
                if getattr(pool, "dsa_kv_cache_store_fp8", False) else f"rows of {row} values ({row_bytes} bytes)")
        return f"pool layout {row_bytes}-byte row", f"KV pool {name} stores {what} (served: {HEAD_DIM_QK} values per row)"
    if isinstance(pool_dtype, torch.dtype) and pool_dtype not in SERVED_KV_DTYPES:
        return f"kv cache {pool_dtype}", f"KV pool {name} dtype {pool_dtype} (served: {_served_dtypes_text()})"
    kb = pool.get_key_buffer(layer_id)
    if not isinstance(kb, torch.Tensor):
        return "pool layout", f"KV pool {name}.get_key_buffer returned {type(kb).__name__}, not a tensor"
    if kb.dim() >= 1 and kb.shape[-1] != HEAD_DIM_QK:
        row_bytes = kb.shape[-1] * kb.element_size()
        return (f"pool layout {row_bytes}-byte row",
                f"KV pool {name} key rows of {kb.shape[-1]} {kb.dtype} ({row_bytes} bytes; served: {HEAD_DIM_QK} values)")
    if kb.dtype not in SERVED_KV_DTYPES or (isinstance(pool_dtype, torch.dtype) and kb.dtype != pool_dtype):
        return f"kv cache {kb.dtype}", f"KV pool {name} key buffer dtype {kb.dtype} (pool dtype {pool_dtype}; served: {_served_dtypes_text()})"
    if not ((kb.dim() == 3 and kb.shape[1] == 1) or kb.dim() == 2) or kb.stride(-1) != 1:
        return "pool layout", (f"KV pool {name} key buffer shape {tuple(kb.shape)} strides {kb.stride()} "
                               f"(served: [S, 1, {HEAD_DIM_QK}] or [S, {HEAD_DIM_QK}], unit inner stride)")
    vb = pool.get_value_buffer(layer_id)
    if not (isinstance(vb, torch.Tensor) and vb.dtype == kb.dtype and vb.data_ptr() == kb.data_ptr()
            and tuple(vb.shape) == tuple(kb.shape[:-1]) + (HEAD_DIM_V,) and vb.stride() == kb.stride()):
        got = (f"shape {tuple(vb.shape)} strides {vb.stride()} {vb.dtype}" if isinstance(vb, torch.Tensor)
               else type(vb).__name__)
        return "pool layout", f"KV pool {name} value buffer ({got}) is not the key buffer's first {HEAD_DIM_V} columns"
    return None


#: pool -> {layer_id: _pool_layout_problem(pool, layer_id)}; weak, so a pool SGLang drops is forgotten
_layout_verdicts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _pool_layout_verdict(pool, layer_id: int) -> Optional[Tuple[str, str]]:
    """:func:`_pool_layout_problem`, decided once per pool and layer. A pool keeps its layout for
    its lifetime, and some pools' accessors do work that must not repeat on every call: the
    layer-split DSA pool's ``get_key_buffer`` broadcasts the layer from its owner rank (the one
    call SGLang's own path makes happens again in the kernel call, after the KV save)."""
    try:
        per_layer = _layout_verdicts.setdefault(pool, {})
    except TypeError:   # None, or a pool that cannot be weakly referenced: decide on every call
        return _pool_layout_problem(pool, layer_id)
    if layer_id not in per_layer:
        per_layer[layer_id] = _pool_layout_problem(pool, layer_id)
    return per_layer[layer_id]


@functools.lru_cache(maxsize=None)
def _cuda_problem_cached(index: int) -> Optional[str]:
    from . import _ext

    try:
        ext = _ext.load()
    except ImportError as exc:
        return f"kdtree's CUDA extension is not available ({exc})"
    major, minor = torch.cuda.get_device_capability(index)
    archs = str(ext.compiled_archs())
    # "90,120" (numbers only, says the build); tolerate suffixed forms like "90a" all the same
    listed = {"".join(ch for ch in a if ch.isdigit()) for a in archs.split(",") if a.strip()}
    if listed and f"{major}{minor}" not in listed:
        return f"cuda:{index} is sm_{major}{minor}; this kdtree build carries kernels for sm_{archs}"
    return None


def _cuda_problem(device: torch.device) -> Optional[str]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_problem_cached(index)


# ------------------------------------------------------------------------------------------------
# on: save KV as the original does, then the kernel
# ------------------------------------------------------------------------------------------------


def _write_loc(backend, fb):
    """The write location the original hands ``set_kv_buffer``: a ``KVWriteLoc`` where the SGLang
    release has one (0.5.23: ``KVWriteLoc.for_batch``; 0.5.17: the dataclass with ``full_loc``),
    else ``out_cache_loc``."""
    write_loc_cls = getattr(sys.modules.get(BACKEND_MODULE), "KVWriteLoc", None)
    md = backend.forward_metadata
    if write_loc_cls is None:
        return fb.out_cache_loc
    if hasattr(write_loc_cls, "for_batch"):
        return write_loc_cls.for_batch(fb, swa_loc=getattr(md, "swa_out_cache_loc", None))
    return write_loc_cls(fb.out_cache_loc, getattr(md, "swa_out_cache_loc", None),
                         full_loc=getattr(md, "out_cache_loc_full_physical", None))


def _save_kv(backend, layer, fb, k, v) -> None:
    """The original's "save KV cache first" step for MLA (dcp_size is 1 here, the gate saw to it)."""
    loc = _write_loc(backend, fb)
    if layer.k_scale is None:
        set_kv = getattr(backend, "_set_kv_buffer", None)
        if set_kv is not None:
            set_kv(fb, layer, loc, k, v)
        else:
            backend.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
    else:
        # MLATokenToKVPool takes no scale: the original divides a clone of k (k stays unscaled for
        # the attention itself)
        backend.token_to_kv_pool.set_kv_buffer(layer, loc, k.clone().div_(layer.k_scale), v)


def _pass_for(backend, md, layer_id: int, num_tokens: int, num_heads: int, capturing: bool):
    """(packed tree mask, whether the plan in the backend's workspace serves this call) for one layer.

    The mask and the kernel's work plan depend only on the forward metadata (and T, H), which every
    layer of one forward pass shares: the first layer of a pass packs the mask and plans, the later
    ones reuse both. A pass walks the layers in increasing order, so a layer id not above the last
    one served (or a different metadata object, T or H, or a change of capture state) starts a new
    pass: inside a CUDA-graph capture the first layer's pack and plan kernels are therefore captured
    and replayed. The plan lives in the backend's own workspace (``_workspace_of``), which no other
    caller writes between two layers. The caller records the pass (``_kdtree_pass_cache``) only once
    its kernel is launched, so a failed launch never leaves a plan to reuse that was not computed.
    """
    cache = getattr(backend, "_kdtree_pass_cache", None)
    same_pass = (cache is not None and cache[0] is md and cache[1] < layer_id and cache[2] == capturing
                 and cache[3] == num_tokens and cache[4] == num_heads)
    if same_pass:
        mask = cache[5]
    elif md.custom_mask is None:
        mask = None
    else:   # packed by this layer's verify call (in its plan kernel), then reused by the pass's later layers
        mask = torch.empty((num_tokens, layout.mask_words(md.max_extend_len)), dtype=torch.int64,
                           device=md.custom_mask.device)
    return mask, same_pass


def _workspace_of(backend) -> ops.Workspace:
    """The backend's own kdtree workspace (the split pass's partials and the plan its layers reuse)."""
    ws = backend.__dict__.get("_kdtree_workspace")
    if ws is None:
        ws = backend._kdtree_workspace = ops.Workspace()
    return ws


def _kernel(backend, q, k, layer, out3, capturing: bool) -> torch.dtype:
    """kdtree's kernel for the current verify batch into ``out3`` ``[T, H, 512]``; returns the pool's element type
    (validate mode's bound depends on it, and it is read here without a second ``get_key_buffer``)."""
    md = backend.forward_metadata
    T = q.shape[0]
    H = layer.tp_q_head_num
    q3 = q if q.dim() == 3 else q.view(T, H, HEAD_DIM_QK)
    q_nope, q_pe = layout.split_mla_q(q3)
    k2 = k.select(1, 0) if k.dim() == 3 else k
    if k2.stride(-1) != 1:
        k2 = k2.contiguous()
    kv_cache = layout.kv_cache_2d(backend.token_to_kv_pool.get_key_buffer(layer.layer_id))
    mask, reuse_plan = _pass_for(backend, md, layer.layer_id, T, H, capturing)
    backend._kdtree_pass_cache = None   # until this launch is done, no layer may reuse a plan (or the mask)
    pack = mask is not None and not reuse_plan   # the pass's first layer packs custom_mask into mask
    k_scale, v_scale = _kv_descales(layer)   # (the gate made sure they are valid)
    ops.verify_attention(q_nope, q_pe, kv_cache, md.kv_indptr, md.kv_indices, md.qo_indptr, k2, mask,
                         layer.scaling, out=out3, workspace=_workspace_of(backend), reuse_plan=reuse_plan,
                         custom_mask=md.custom_mask if pack else None, mask_indptr=md.mask_indptr if pack else None,
                         k_scale=k_scale, v_scale=v_scale)
    backend._kdtree_pass_cache = (md, layer.layer_id, capturing, T, H, mask)
    return kv_cache.dtype


def _capturing(q) -> bool:
    return bool(q.is_cuda and torch.cuda.is_current_stream_capturing())


@torch.compiler.disable
def _serve(backend, q, k, v, layer, fb, save_kv_cache):
    T = q.shape[0]
    H = layer.tp_q_head_num
    out = getattr(fb, "_attn_output", None)
    if out is None:
        out = q.new_empty((T, H * HEAD_DIM_V))
    if save_kv_cache:
        _save_kv(backend, layer, fb, k, v)
    _kernel(backend, q, k, layer, out.view(T, H, HEAD_DIM_V), _capturing(q))
    return out


# ------------------------------------------------------------------------------------------------
# validate
# ------------------------------------------------------------------------------------------------

_scratch_lock = threading.Lock()
_scratch: Dict[Tuple[str, int], torch.Tensor] = {}


def _scratch_out(device: torch.device, T: int, H: int) -> torch.Tensor:
    """A reused ``[T, H, 512]`` bf16 buffer for the kernel's result in validate mode (grow-only)."""
    need = T * H * HEAD_DIM_V
    key = (device.type, device.index if device.index is not None else -1)
    with _scratch_lock:
        buf = _scratch.get(key)
        if buf is None or buf.numel() < need:
            buf = torch.empty(max(need, 2 * (0 if buf is None else buf.numel())), dtype=torch.bfloat16,
                              device=device)
            _scratch[key] = buf
    return buf[:need].view(T, H, HEAD_DIM_V)


def _validate(original, backend, q, k, v, layer, fb, args, kwargs):
    out = original(backend, q, k, v, layer, fb, *args, **kwargs)
    if _capturing(q):
        _state.counters.skipped_capture += 1
        return out
    T = q.shape[0]
    H = layer.tp_q_head_num
    mine = _scratch_out(q.device, T, H)
    try:
        kv_dtype = _kernel(backend, q, k, layer, mine, False)
    except Exception:
        _state.counters.kernel_errors += 1
        first = _state.counters.kernel_errors == 1
        if first:
            _state.last_mismatch_log = time.monotonic()
        if first or _should_log_mismatch():
            logger.exception("kdtree validate: the kernel raised on layer %s (T=%d, H=%d); returning SGLang's "
                             "output", layer.layer_id, T, H)
        return out
    _compare(out.view(T, H, HEAD_DIM_V), mine, layer, kv_dtype == torch.float8_e4m3fn)
    return out


def _should_log_mismatch() -> bool:
    now = time.monotonic()
    if now - _state.last_mismatch_log >= MISMATCH_LOG_INTERVAL_S:
        _state.last_mismatch_log = now
        return True
    _state.mismatch_logs_suppressed += 1
    return False


def _compare(expected: torch.Tensor, got: torch.Tensor, layer, fp8: bool = False) -> None:
    """bf16 pools: elementwise ``|got - expected| <= atol + rtol * |expected|``. e4m3 pools: per (token, head) row,
    ``rms(got - expected) <= fp8_atol + fp8_rtol * rms(expected)``: SGLang's own fp8 output scatters elementwise by
    up to ~1.3x ``0.1 + 0.1 |x|`` where a few keys dominate a row, while its rows stay within ~12% (relative L2) of
    the exact result, and a wrong row is ~100% off. A NaN or inf on either side is a mismatch (an attention output is
    never legitimately non-finite, and NaN never passes)."""
    atol, rtol = (_state.fp8_atol, _state.fp8_rtol) if fp8 else (_state.atol, _state.rtol)
    T, H, D = expected.shape
    e = expected.float()
    g = got.float()
    finite_e = torch.isfinite(e)
    both_finite = finite_e & torch.isfinite(g)
    err = torch.where(both_finite, (g - e).abs(), torch.full_like(e, math.inf))
    e0 = torch.where(finite_e, e.abs(), torch.zeros_like(e))
    if fp8:
        ratio = err.pow(2).mean(-1).sqrt() / (atol + rtol * e0.pow(2).mean(-1).sqrt())   # [T, H]: > 1 is outside
        worst_row = torch.argmax(ratio)
        worst = worst_row * D + torch.argmax(err.reshape(-1, D)[worst_row])
    else:
        ratio = err / (atol + rtol * e0)                                                  # [T, H, D]
        worst = torch.argmax(ratio)
    bad = ratio > 1
    summary = torch.stack([err.max(), e0.max(), ratio.max(), bad.sum().to(err.dtype), worst.to(err.dtype),
                           g.reshape(-1)[worst], e.reshape(-1)[worst]]).tolist()   # one host sync
    max_abs, scale, worst_ratio, n_bad, worst_flat, got_w, exp_w = summary
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    c = _state.counters
    with _state.lock:
        c.compared += 1
        c.max_abs_err = max(c.max_abs_err, max_abs)
        c.max_rel_err = max(c.max_rel_err, max_rel)
        c.max_tolerance_ratio = max(c.max_tolerance_ratio, worst_ratio)
        if n_bad == 0:
            return
        c.mismatched += 1
        flat = int(worst_flat)
        index = (flat // (H * D), (flat // D) % H, flat % D)
        c.last_mismatch = {
            "layer_id": layer.layer_id, "num_tokens": T, "num_heads": H, "max_abs_err": max_abs,
            "max_rel_err": max_rel, "tolerance_ratio": worst_ratio,
            ("mismatched_rows" if fp8 else "mismatched_elements"): int(n_bad),
            "worst_index": index,
            "kernel": got_w, "original": exp_w,
        }
        first = c.mismatched == 1
    if first:
        _state.last_mismatch_log = time.monotonic()
    if first or _should_log_mismatch():
        suppressed, _state.mismatch_logs_suppressed = _state.mismatch_logs_suppressed, 0
        what = (f"rows (token, head) of {T * H} outside rms {atol:g} + {rtol:g}*rms(ref)" if fp8
                else f"elements of {T * H * D} outside {atol:g} + {rtol:g}*|ref|")
        logger.warning(
            "kdtree validate: mismatch on layer %s (T=%d, H=%d): max abs err %.4g, max rel err %.4g, %d %s; "
            "worst at (token %d, head %d, dim %d): kernel %r vs SGLang %r "
            "[%d mismatches in %d comparisons so far%s]", layer.layer_id, T, H, max_abs, max_rel, int(n_bad), what,
            index[0], index[1], index[2], got_w, exp_w, c.mismatched, c.compared,
            f"; {suppressed} log lines suppressed" if suppressed else "")


# ------------------------------------------------------------------------------------------------
# summaries in the log (per process: the scheduler / TP workers of a server each log theirs, and
# SGLang may end them without running atexit, hence also the progress lines at 1, 10, 100, ...)
# ------------------------------------------------------------------------------------------------


def _summary() -> str:
    c = _state.counters
    text = (f"pid {os.getpid()}, mode {_state.mode}: {c.calls} patched calls, {c.served} served, "
            f"{c.fallback} fell back {c.fallback_reasons or ''}")
    if _state.mode == "validate" or c.compared:
        text += (f"; validate: {c.compared} compared, {c.mismatched} mismatched, {c.skipped_capture} not compared "
                 f"(CUDA-graph capture), {c.kernel_errors} kernel errors, max abs err {c.max_abs_err:.4g}")
    return text


def _log_progress() -> None:
    _state.next_progress_log *= 10
    logger.info("kdtree progress (%s)", _summary())


def _log_summary_at_exit() -> None:
    if _state.counters.calls:
        logger.info("kdtree summary (%s)", _summary())


atexit.register(_log_summary_at_exit)
