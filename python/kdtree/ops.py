"""``verify_attention``: paged tree-verify attention for MLA (see kdtree_verify.h for the math).

CUDA tensors run kdtree's kernel (``kdtree._verify.launch``) on ``torch.cuda.current_stream()``;
CPU tensors run :func:`kdtree.reference.verify_attention_reference` in float32, so the package is
usable (and testable) without a GPU or a build of the extension.

Validation here reads only shapes, strides, dtypes, devices and pointers, never tensor values on
CUDA, so a call can be captured in a CUDA graph. Values that only the device holds (indptr
contents, slot ids) are the caller's contract; the CPU path checks them too.

Workspace and CUDA graphs: by default the kernel's scratch comes from a per-device, grow-only
cache sized by ``kdtree._verify.workspace_size(B, T, H)``. It allocates only when a call needs
more than any earlier call on that device. A CUDA-graph capture must therefore be preceded by an
eager (warm-up) call of the largest (B, T, H) that will be captured (SGLang's graph runner warms
up every batch size before capturing it, largest first), or pass ``workspace=`` explicitly; a
capture that would need to grow the cache raises instead of allocating inside the capture.
Buffers that a capture has recorded are kept alive for the life of the process when the cache
grows later, so earlier graphs never replay into freed memory.

Plan reuse: every call plans its split on the GPU (one small kernel) and leaves the plan in its
workspace. The layers of one forward pass share their metadata, so a caller holding its own
:class:`Workspace` may pass ``reuse_plan=True`` for every layer after the first and skip that
kernel (``kdtree.sglang_patch`` does).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
from typing import Dict, List, NamedTuple, Optional

import torch

from . import _ext
from .layout import build_tree_mask, check_custom_mask, kv_cache_2d, split_mla_q
from .reference import verify_attention_reference

__all__ = ["Workspace", "verify_attention", "verify_attention_mla", "workspace_for"]

HEAD_DIM_NOPE = 512
HEAD_DIM_PE = 64
HEAD_DIM_QK = 576
HEAD_DIM_V = 512
MAX_HEADS = 128
MAX_MASK_WORDS = 8
INDEX_INT32 = 0
INDEX_INT64 = 1
KV_BF16 = 0
KV_E4M3 = 1
#: pool element types the kernel reads: bf16 rows, or SGLang's fp8_e4m3 rows (576 bytes)
KV_DTYPES = {torch.bfloat16: KV_BF16, torch.float8_e4m3fn: KV_E4M3}
_ALIGN_BYTES = 16
_WORKSPACE_ALIGN_BYTES = 256
_INDEX_CODES = {torch.int32: INDEX_INT32, torch.int64: INDEX_INT64}


# --------------------------------------------------------------------------------------------
# validation helpers: every message names the argument and what was expected
# --------------------------------------------------------------------------------------------

def _tensor(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _dtype(t: torch.Tensor, name: str, *dtypes: torch.dtype) -> None:
    if t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {t.dtype}")


def _device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q_nope is on {device}: all tensors must be on one device")


def _dims(t: torch.Tensor, name: str, dims: int, layout: str) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")


def _shape(t: torch.Tensor, name: str, expected: tuple, layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must be {layout} = {tuple(expected)}, got {tuple(t.shape)}")


def _last_dim_contiguous(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"{name} has a negative stride {t.stride()}")


def _row_strides(t: torch.Tensor, name: str, width: int):
    """(t stride, h stride) of a ``[T, H, width]`` tensor as the kernel will walk it.

    A size-1 dim's stride is meaningless to torch (it can be anything), so a canonical value is
    passed instead. The kernel reads rows ``t * stride_t + h * stride_h``: heads of one token must
    not overlap, nor tokens (stride_t >= (H - 1) * stride_h + width), so t/h-transposed layouts
    are refused.
    """
    T, H = int(t.shape[0]), int(t.shape[1])
    sh = int(t.stride(1)) if H > 1 else width
    st = int(t.stride(0)) if T > 1 else H * sh
    if sh < width:
        raise ValueError(f"{name} head stride must be >= {width} (heads must not overlap), got strides {t.stride()}")
    if st < (H - 1) * sh + width:
        raise ValueError(f"{name} token stride must be >= (H - 1) * head stride + {width} = {(H - 1) * sh + width} "
                         f"(token-major layout), got strides {t.stride()}")
    return st, sh


def _check_cuda_strides(q_nope, q_pe, kv_cache, k_new, out, checked) -> None:
    """CUDA only, once per signature: every row stride the kernel walks is a multiple of 16 bytes."""
    for name, t, strides in (("q_nope", q_nope, (checked.q_nope_st, checked.q_nope_sh)),
                             ("q_pe", q_pe, (checked.q_pe_st, checked.q_pe_sh)),
                             ("kv_cache", kv_cache, (checked.kv_st,)), ("k_new", k_new, (checked.k_new_st,)),
                             ("out", out, (checked.out_st, checked.out_sh) if out is not None else ())):
        per = _ALIGN_BYTES // t.element_size() if t is not None else 1
        if any(s % per for s in strides):
            raise ValueError(f"{name} row strides must be multiples of {per} elements "
                             f"({_ALIGN_BYTES} bytes), got strides {t.stride()}")


def _check_pointers(named_ptrs) -> None:
    """CUDA only, every call: 16-byte aligned base pointers (one test for all; the name on failure)."""
    acc = 0
    for _, ptr in named_ptrs:
        acc |= ptr
    if acc % _ALIGN_BYTES:
        for name, ptr in named_ptrs:
            if ptr % _ALIGN_BYTES:
                raise ValueError(f"{name} data pointer must be {_ALIGN_BYTES}-byte aligned, got offset "
                                 f"{ptr % _ALIGN_BYTES} (slice it at a multiple of 8 elements)")


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # (device index) -> cudaStream_t as an int


def _stream_ptr(device: torch.device) -> int:
    """``device``'s current CUDA stream as an int: torch's raw accessor (what Triton's launcher uses), ~10x cheaper
    than building a torch.cuda.Stream; the public path where a torch build lacks it."""
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


_SAME_DEVICE = contextlib.nullcontext()


def _device_guard(device: torch.device):
    """``torch.cuda.device(device)`` where it differs from the current device (entering that context costs ~2 us a
    call); a no-op context otherwise."""
    return _SAME_DEVICE if device.index == torch.cuda.current_device() else torch.cuda.device(device)


def _index_vector(t, name: str, device, *dtypes) -> torch.Tensor:
    _tensor(t, name)
    _dtype(t, name, *dtypes)
    _device(t, name, device)
    _dims(t, name, 1, "")
    if t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride(0)}")
    return t


def _positive_scale(value, name: str) -> float:
    """A host float, finite and > 0 (sm_scale, k_scale, v_scale); the message names the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (a host float), got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and positive, got {value}")
    return value


# --------------------------------------------------------------------------------------------
# workspace cache
# --------------------------------------------------------------------------------------------

class Workspace:
    """Grow-only kdtree scratch on each CUDA device (uint8, 256-byte aligned): the split pass's partials
    and its work plan.

    :meth:`get` allocates (``torch.empty``) only when a call needs more than any earlier call on that
    device, and raises RuntimeError instead when that would happen inside a CUDA-graph capture.
    Buffers a capture has recorded stay alive for the life of the object when it grows later, so
    earlier graphs never replay into freed memory. ``kdtree.verify_attention`` uses one shared
    instance; a caller that reuses plans across calls (``reuse_plan=True``) keeps its own, so that
    no other caller's plan lands in between.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._buffers: Dict[int, torch.Tensor] = {}    # device index -> current buffer
        self._captured: Dict[int, bool] = {}           # device index -> current buffer used in a capture
        self._retired: List[torch.Tensor] = []         # buffers recorded by captures; never freed

    def get(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """This device's buffer, at least ``nbytes`` bytes."""
        return self._get(device, nbytes)[0]

    def _get(self, device: torch.device, nbytes: int):
        """(buffer, whether it was allocated by this call)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        capturing = torch.cuda.is_current_stream_capturing()
        with self._lock:
            buf = self._buffers.get(index)
            if buf is None or buf.numel() < nbytes:
                if capturing:
                    have = 0 if buf is None else buf.numel()
                    raise RuntimeError(
                        f"kdtree workspace on cuda:{index} must grow from {have} to {nbytes} bytes during a "
                        f"CUDA-graph capture; run one eager verify_attention call of the largest (batch, tokens, "
                        f"heads) before capturing, or pass workspace= (a uint8 CUDA tensor of "
                        f"kdtree._verify.workspace_size bytes)")
                if buf is not None and self._captured.get(index):
                    self._retired.append(buf)  # a captured graph still points at it
                size = max(nbytes, 1 << 20)
                size = 1 << (size - 1).bit_length() if size < (64 << 20) else size
                buf = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", index))
                self._buffers[index] = buf
                self._captured[index] = False
                grew = True
            else:
                grew = False
            if capturing:
                self._captured[index] = True
            return buf, grew


_shared_workspace = Workspace()


def workspace_for(device: torch.device, nbytes: int) -> torch.Tensor:
    """The shared per-device grow-only workspace (see :class:`Workspace`), at least ``nbytes`` bytes."""
    return _shared_workspace.get(device, nbytes)


# --------------------------------------------------------------------------------------------
# structural validation, cached by argument signature
# --------------------------------------------------------------------------------------------

class _Checked(NamedTuple):
    """What the structural checks derive from a valid set of arguments."""
    device: torch.device
    T: int
    H: int
    B: int
    words: int
    q_nope_st: int
    q_nope_sh: int
    q_pe_st: int
    q_pe_sh: int
    kv_st: int
    k_new_st: int
    out_st: int      # out's (t, h) strides: of the caller's out, else of a fresh contiguous one
    out_sh: int


_CHECKED: Dict[tuple, _Checked] = {}   # argument signature -> its checked structure
_CHECKED_MAX = 256                      # distinct signatures kept (cleared when full)


def _signature(tensors) -> Optional[tuple]:
    """(dtype, device, shape, strides) of every argument, or None unless each is a plain
    torch.Tensor or None (anything else takes the full checks, which name it)."""
    sig = []
    for t in tensors:
        if t is None:
            sig.append(None)
        elif type(t) is torch.Tensor:
            sig.append((t.dtype, t.device, t.shape, t.stride()))
        else:
            return None
    return tuple(sig)


def _check_structure(q_nope, q_pe, kv_cache, kv_indptr, kv_indices, qo_indptr, k_new, tree_mask, out) -> _Checked:
    """Every check of verify_attention's arguments that reads only types, dtypes, devices, shapes
    and strides (never values or pointers); raises TypeError / ValueError naming the argument."""
    _tensor(q_nope, "q_nope")
    device = q_nope.device
    for name, t in (("q_pe", q_pe), ("kv_cache", kv_cache), ("k_new", k_new)):
        _tensor(t, name)
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("k_new", k_new)):
        _dtype(t, name, torch.bfloat16)
        _device(t, name, device)
    _dtype(kv_cache, "kv_cache", *KV_DTYPES)
    _device(kv_cache, "kv_cache", device)

    _dims(q_nope, "q_nope", 3, f"[T, H, {HEAD_DIM_NOPE}]")
    T, H = int(q_nope.shape[0]), int(q_nope.shape[1])
    _shape(q_nope, "q_nope", (T, H, HEAD_DIM_NOPE), f"[T, H, {HEAD_DIM_NOPE}]")
    if T < 1:
        raise ValueError(f"q_nope must have at least one verify token (T >= 1), got shape {tuple(q_nope.shape)}")
    if not 1 <= H <= MAX_HEADS:
        raise ValueError(f"q_nope has {H} heads; kdtree serves 1..{MAX_HEADS} heads per rank")
    _dims(q_pe, "q_pe", 3, f"[T, H, {HEAD_DIM_PE}]")
    if tuple(q_pe.shape[:2]) != (T, H):
        raise ValueError(f"q_pe.shape[:2] must equal q_nope.shape[:2] = {(T, H)}, got {tuple(q_pe.shape[:2])}")
    _shape(q_pe, "q_pe", (T, H, HEAD_DIM_PE), f"[T, H, {HEAD_DIM_PE}]")
    _dims(kv_cache, "kv_cache", 2, f"[S, {HEAD_DIM_QK}] (use kdtree.layout.kv_cache_2d on SGLang's [S, 1, 576])")
    if kv_cache.shape[1] != HEAD_DIM_QK or kv_cache.shape[0] < 1:
        raise ValueError(f"kv_cache must be [S >= 1, {HEAD_DIM_QK}], got {tuple(kv_cache.shape)}")
    _dims(k_new, "k_new", 2, f"[T, {HEAD_DIM_QK}]")
    if k_new.shape[0] != T:
        raise ValueError(f"k_new must have one row per verify token (T = {T} = q_nope.shape[0]), "
                         f"got {k_new.shape[0]} rows")
    _shape(k_new, "k_new", (T, HEAD_DIM_QK), f"[T, {HEAD_DIM_QK}]")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("kv_cache", kv_cache), ("k_new", k_new)):
        _last_dim_contiguous(t, name)
    q_nope_st, q_nope_sh = _row_strides(q_nope, "q_nope", HEAD_DIM_NOPE)
    q_pe_st, q_pe_sh = _row_strides(q_pe, "q_pe", HEAD_DIM_PE)
    kv_st = int(kv_cache.stride(0)) if kv_cache.shape[0] > 1 else HEAD_DIM_QK
    k_new_st = int(k_new.stride(0)) if T > 1 else HEAD_DIM_QK
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) < HEAD_DIM_QK:
        raise ValueError(f"kv_cache row stride must be >= {HEAD_DIM_QK}, got {kv_cache.stride(0)}")
    if T > 1 and k_new.stride(0) < HEAD_DIM_QK:
        raise ValueError(f"k_new row stride must be >= {HEAD_DIM_QK}, got {k_new.stride(0)}")

    _index_vector(kv_indptr, "kv_indptr", device, torch.int32)
    _index_vector(kv_indices, "kv_indices", device, torch.int32, torch.int64)
    _index_vector(qo_indptr, "qo_indptr", device, torch.int32, torch.int64)
    if kv_indptr.shape[0] < 2:
        raise ValueError(f"kv_indptr must be [B + 1] with B >= 1, got length {kv_indptr.shape[0]}")
    if qo_indptr.shape[0] != kv_indptr.shape[0]:
        raise ValueError(f"qo_indptr and kv_indptr must both be [B + 1]: got lengths {qo_indptr.shape[0]} "
                         f"and {kv_indptr.shape[0]}")
    B = int(kv_indptr.shape[0]) - 1

    words = 0
    if tree_mask is not None:
        _tensor(tree_mask, "tree_mask")
        _dtype(tree_mask, "tree_mask", torch.int64)
        _device(tree_mask, "tree_mask", device)
        _dims(tree_mask, "tree_mask", 2, "[T, W] (packed bits, see kdtree.layout.build_tree_mask)")
        if tree_mask.shape[0] != T:
            raise ValueError(f"tree_mask must have one row per verify token (T = {T}), got {tree_mask.shape[0]} rows")
        words = int(tree_mask.shape[1])
        if not 1 <= words <= MAX_MASK_WORDS:
            raise ValueError(f"tree_mask must have 1..{MAX_MASK_WORDS} words per row (at most "
                             f"{64 * MAX_MASK_WORDS} verify tokens per request), got {words}")
        if not tree_mask.is_contiguous():  # the ABI has no row stride for it: [T, W] dense
            raise ValueError(f"tree_mask must be contiguous ([T, W] row-major), got strides {tree_mask.stride()}")

    if out is not None:
        _tensor(out, "out")
        _dtype(out, "out", torch.bfloat16)
        _device(out, "out", device)
        _dims(out, "out", 3, f"[T, H, {HEAD_DIM_V}]")
        _shape(out, "out", (T, H, HEAD_DIM_V), f"[T, H, {HEAD_DIM_V}]")
        _last_dim_contiguous(out, "out")
        out_st, out_sh = _row_strides(out, "out", HEAD_DIM_V)
    else:
        out_st, out_sh = H * HEAD_DIM_V, HEAD_DIM_V

    return _Checked(device, T, H, B, words, q_nope_st, q_nope_sh, q_pe_st, q_pe_sh, kv_st, k_new_st, out_st, out_sh)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------

def verify_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    k_new: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    sm_scale: float,
    *,
    out: Optional[torch.Tensor] = None,
    workspace=None,
    reuse_plan: bool = False,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Paged tree-verify attention over MLA latents for a batch of B requests.

    Request b owns verify rows ``qo_indptr[b]:qo_indptr[b+1]`` (N_b tokens) and a committed prefix of
    P_b = ``kv_indptr[b+1] - kv_indptr[b]`` pool slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
    Each row attends to all P_b prefix keys plus the drafts of its request that ``tree_mask``
    allows (bit j of word ``j // 64``), or drafts ``j <= n`` when ``tree_mask`` is None.
    ``score = sm_scale * (q_nope . key[:512] + q_pe . key[512:])``, values are ``key[:512]``, where a prefix key is
    its pool row times ``k_scale`` (scores) and ``v_scale`` (values), SGLang's k_descale / v_descale, and a draft its
    ``k_new`` row, unscaled. A row that sees no key gets zeros.

    Args:
        q_nope: ``[T, H, 512]`` bfloat16, last dim contiguous, any t/h strides (a view of SGLang's q).
        q_pe: ``[T, H, 64]`` bfloat16, same T and H, last dim contiguous.
        kv_cache: ``[S, 576]`` latent pool (see :func:`kdtree.layout.kv_cache_2d`), bfloat16 or float8_e4m3fn
            (SGLang's fp8_e4m3 KV cache; the kernel computes its prefix in e4m3, see docs/design.md), row stride
            >= 576, last dim contiguous.
        kv_indptr: ``[B + 1]`` int32.
        kv_indices: 1-D int32 or int64 slot ids (may be longer than ``kv_indptr[B]``).
        qo_indptr: ``[B + 1]`` int32 or int64, ``qo_indptr[B] == T``.
        k_new: ``[T, 576]`` bfloat16, the verify tokens' own latent rows (row stride >= 576).
        tree_mask: ``[T, W]`` int64 with ``1 <= W <= 8`` (see :func:`kdtree.layout.build_tree_mask`),
            or None for a causal chain.
        sm_scale: positive finite host float (SGLang's ``layer.scaling``).
        out: optional ``[T, H, 512]`` bfloat16 written in place (last dim contiguous).
        workspace: optional CUDA uint8 tensor of at least ``kdtree._verify.workspace_size(B, T, H)``
            bytes, 256-byte aligned, or a :class:`Workspace` (grow-only, per device); default: a
            shared :class:`Workspace` (see the module docs for CUDA graphs).
        reuse_plan: skip the GPU work plan and run on the plan ``workspace`` holds from the previous
            call on it, which must have had the same B, T, H and the same ``kv_indptr`` /
            ``qo_indptr`` values (an earlier layer of the same forward pass: saves one kernel and
            its dependency wait). Needs an explicit ``workspace``; the values are not checked (they
            live on the GPU), so a wrong reuse gives wrong results. A :class:`Workspace` that had to
            grow for this call holds no plan, and the call computes it. Ignored for CPU tensors.
        custom_mask: optional SGLang flat ``custom_mask`` (1-D bool or uint8), with ``mask_indptr`` (``[B + 1]``
            int64 or int32): the call packs it into ``tree_mask`` itself, as :func:`kdtree.layout.build_tree_mask`
            would, so ``tree_mask`` must then be a ``[T, W]`` int64 buffer (contents overwritten; e.g.
            ``torch.empty(T, kdtree.layout.mask_words(max_n), dtype=torch.int64)``) that later calls may pass
            packed. On CUDA the packing runs inside the call's plan kernel: one kernel and one dependency wait fewer
            than ``build_tree_mask`` before the call (with ``reuse_plan``, the pack kernel runs instead).
        k_scale, v_scale: positive finite host floats, 1 for none: a prefix key scores as ``k_scale`` times its pool
            row and its value counts as ``v_scale`` times the row's first 512 (SGLang's ``layer.k_scale_float`` /
            ``v_scale_float`` where the layer has both scales). The drafts are never scaled.
    Returns:
        ``out`` (allocated with ``torch.empty`` when not given), ``[T, H, 512]`` bfloat16.

    Raises:
        TypeError / ValueError naming the offending argument; ``kdtree.KdtreeError`` if the kernel
        rejects the launch; ImportError for CUDA tensors when the extension is not built.
    """
    # Structural checks (types, dtypes, devices, shapes, strides; the pack arguments' too; on CUDA the row strides'
    # alignment) depend only on each tensor's signature; a call whose signature passed before skips them (SGLang
    # repeats one signature per layer and step). Values, pointers and the workspace are checked on every call below.
    key = _signature((q_nope, q_pe, kv_cache, kv_indptr, kv_indices, qo_indptr, k_new, tree_mask, out, custom_mask,
                      mask_indptr))
    checked = _CHECKED.get(key) if key is not None else None
    if checked is None:
        checked = _check_structure(q_nope, q_pe, kv_cache, kv_indptr, kv_indices, qo_indptr, k_new, tree_mask, out)
        if custom_mask is not None or mask_indptr is not None:
            _check_pack(custom_mask, mask_indptr, qo_indptr, kv_indptr, tree_mask, checked.device)
        if checked.device.type == "cuda":
            _check_cuda_strides(q_nope, q_pe, kv_cache, k_new, out, checked)
        if key is not None:
            if len(_CHECKED) >= _CHECKED_MAX:
                _CHECKED.clear()
            _CHECKED[key] = checked
    device, T, H, B, words, q_nope_st, q_nope_sh, q_pe_st, q_pe_sh, kv_st, k_new_st, out_st, out_sh = checked
    scale = _positive_scale(sm_scale, "sm_scale")
    k_scale = _positive_scale(k_scale, "k_scale")
    v_scale = _positive_scale(v_scale, "v_scale")
    if not isinstance(reuse_plan, bool):
        raise TypeError(f"reuse_plan must be a bool, got {type(reuse_plan).__name__}")

    if device.type != "cuda":
        if custom_mask is not None:
            tree_mask.copy_(build_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, T, 64 * words))
        if workspace is not None and not isinstance(workspace, Workspace):   # a Workspace holds CUDA buffers only
            _tensor(workspace, "workspace")
            raise ValueError(f"workspace is only used for CUDA tensors; got one on {workspace.device} "
                             f"while the inputs are on {device}")
        result = verify_attention_reference(
            q_nope, q_pe, kv_cache, kv_indptr, kv_indices, qo_indptr, k_new, tree_mask, scale,
            dtype=torch.float32, k_scale=k_scale, v_scale=v_scale)
        if out is None:
            return result.to(q_nope.dtype)
        out.copy_(result)
        return out

    # ---------------------------------------------------------------- CUDA
    if out is None:
        out = torch.empty((T, H, HEAD_DIM_V), dtype=torch.bfloat16, device=device)   # (checked's out strides)
    q_nope_ptr, q_pe_ptr, kv_ptr, k_new_ptr, out_ptr = (
        q_nope.data_ptr(), q_pe.data_ptr(), kv_cache.data_ptr(), k_new.data_ptr(), out.data_ptr())
    _check_pointers((("q_nope", q_nope_ptr), ("q_pe", q_pe_ptr), ("kv_cache", kv_ptr), ("k_new", k_new_ptr),
                     ("out", out_ptr)))

    ext = _ext.load()
    with _device_guard(device):
        need = int(ext.workspace_size(B, T, H))
        if workspace is None:
            if reuse_plan:
                raise ValueError("reuse_plan=True needs workspace= (the Workspace or buffer of the call that computed "
                                 "the plan); the shared default workspace may hold another caller's plan")
            workspace = workspace_for(device, need)
        elif isinstance(workspace, Workspace):
            workspace, grew = workspace._get(device, need)
            if grew:
                reuse_plan = False   # a new buffer holds no plan: compute it (always correct)
        else:
            _tensor(workspace, "workspace")
            _dtype(workspace, "workspace", torch.uint8)
            _device(workspace, "workspace", device)
            if workspace.dim() != 1 or (workspace.numel() > 1 and workspace.stride(0) != 1):
                raise ValueError(f"workspace must be a contiguous 1-D uint8 tensor, got shape "
                                 f"{tuple(workspace.shape)} strides {workspace.stride()}")
            if workspace.numel() < need:
                raise ValueError(f"workspace must hold at least {need} bytes (kdtree._verify.workspace_size"
                                 f"({B}, {T}, {H})), got {workspace.numel()}")
            if workspace.data_ptr() % _WORKSPACE_ALIGN_BYTES:
                raise ValueError(f"workspace data pointer must be {_WORKSPACE_ALIGN_BYTES}-byte aligned")

        # An empty kv_indices (every prefix empty) may have a NULL data pointer; the kernel never
        # reads it then (all P_b are 0), so any valid device pointer stands in.
        kv_indices_ptr = kv_indices.data_ptr() if kv_indices.numel() else kv_indptr.data_ptr()
        pack_mask = pack_indptr = 0
        if custom_mask is not None:   # (stream-ordered conversions, no sync; SGLang's dtypes need none)
            custom_mask = custom_mask.contiguous()
            if mask_indptr.dtype != torch.int64 or not mask_indptr.is_contiguous():
                mask_indptr = mask_indptr.to(torch.int64).contiguous()
            pack_mask, pack_indptr = custom_mask.data_ptr(), mask_indptr.data_ptr()
        ext.launch(
            q_nope=q_nope_ptr,
            q_nope_stride_t=q_nope_st,
            q_nope_stride_h=q_nope_sh,
            q_pe=q_pe_ptr,
            q_pe_stride_t=q_pe_st,
            q_pe_stride_h=q_pe_sh,
            kv_cache=kv_ptr,
            kv_stride_s=kv_st,
            num_slots=int(kv_cache.shape[0]),
            kv_indices=kv_indices_ptr,
            kv_indices_dtype=_INDEX_CODES[kv_indices.dtype],
            kv_indptr=kv_indptr.data_ptr(),
            k_new=k_new_ptr,
            k_new_stride_t=k_new_st,
            qo_indptr=qo_indptr.data_ptr(),
            qo_indptr_dtype=_INDEX_CODES[qo_indptr.dtype],
            tree_mask=0 if tree_mask is None else tree_mask.data_ptr(),
            tree_mask_words=words,
            out=out_ptr,
            out_stride_t=out_st,
            out_stride_h=out_sh,
            batch_size=B,
            num_tokens=T,
            num_heads=H,
            sm_scale=scale,
            workspace=workspace.data_ptr(),
            workspace_bytes=int(workspace.numel()),
            stream=_stream_ptr(device),
            reuse_plan=reuse_plan,
            pack_custom_mask=pack_mask,
            pack_mask_indptr=pack_indptr,
            kv_dtype=KV_DTYPES[kv_cache.dtype],
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return out


def _check_pack(custom_mask, mask_indptr, qo_indptr, kv_indptr, tree_mask, device) -> None:
    """verify_attention's custom_mask / mask_indptr: both or neither, and a tree_mask buffer to pack into."""
    if custom_mask is None:
        raise ValueError("mask_indptr is given without custom_mask: pass both (the call packs custom_mask into "
                         "tree_mask) or neither")
    if mask_indptr is None:
        raise ValueError("custom_mask needs mask_indptr ([B + 1] int64: where each request's block starts)")
    if tree_mask is None:
        raise ValueError("custom_mask needs tree_mask: the [T, W] int64 buffer the call packs it into "
                         "(torch.empty(T, kdtree.layout.mask_words(max_n), dtype=torch.int64))")
    if check_custom_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr) != device:
        raise ValueError(f"custom_mask is on {custom_mask.device} but q_nope is on {device}")


def verify_attention_mla(
    q: torch.Tensor,
    k: torch.Tensor,
    key_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    qo_indptr: torch.Tensor,
    tree_mask: Optional[torch.Tensor],
    sm_scale: float,
    *,
    out: Optional[torch.Tensor] = None,
    workspace=None,
    reuse_plan: bool = False,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """:func:`verify_attention` on SGLang's MLA tensors as the backend receives them.

    Args:
        q: ``[T, H, 576]`` bfloat16 (nope then rope; split with views).
        k: ``[T, 1, 576]`` or ``[T, 576]`` bfloat16, the verify tokens' latent rows.
        key_buffer: the pool's ``[S, 1, 576]`` (or ``[S, 576]``) key buffer, bfloat16 or float8_e4m3fn.
        kv_indptr, kv_indices, qo_indptr, tree_mask, sm_scale, out, workspace, reuse_plan, custom_mask,
            mask_indptr, k_scale, v_scale: as in verify_attention.
    Returns:
        ``[T, H, 512]`` bfloat16.
    """
    q_nope, q_pe = split_mla_q(q)
    _tensor(k, "k")
    if k.dim() == 3:
        if k.shape[1] != 1:
            raise ValueError(f"k must be [T, 1, {HEAD_DIM_QK}] or [T, {HEAD_DIM_QK}], got {tuple(k.shape)}")
        k = k.select(1, 0)
    return verify_attention(q_nope, q_pe, kv_cache_2d(key_buffer), kv_indptr, kv_indices, qo_indptr, k,
                            tree_mask, sm_scale, out=out, workspace=workspace, reuse_plan=reuse_plan,
                            custom_mask=custom_mask, mask_indptr=mask_indptr, k_scale=k_scale, v_scale=v_scale)
