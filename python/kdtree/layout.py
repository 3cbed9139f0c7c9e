"""Views and mask conversion between SGLang's MLA verify layout and kdtree's.

* :func:`split_mla_q`: SGLang's ``q [T, H, 576]`` -> ``(q_nope [T, H, 512], q_pe [T, H, 64])`` views.
* :func:`kv_cache_2d`: the MLA pool's key buffer ``[S, 1, 576]`` (or ``[S, 576]``) -> ``[S, 576]`` view.
* :func:`build_tree_mask`: SGLang's flat byte ``custom_mask`` (per request a row-major
  ``N_b x (P_b + N_b)`` block at ``mask_indptr[b]``) -> the kernel's packed ``[T, W]`` int64 mask
  holding only the ``N_b x N_b`` draft block (bit j of word ``j // 64`` of row ``qo_indptr[b] + n``
  = verify token n sees draft j). The prefix columns are never read: under SGLang's
  ``skip_prefix_custom_mask=True`` every prefix key is visible.

None of these copies data. On CUDA, build_tree_mask launches kdtree's pack kernel on the current
stream and never synchronises with the host (CUDA-graph capturable).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _ext

HEAD_DIM_NOPE = 512
HEAD_DIM_PE = 64
HEAD_DIM_QK = HEAD_DIM_NOPE + HEAD_DIM_PE
MAX_MASK_WORDS = 8

__all__ = ["split_mla_q", "kv_cache_2d", "build_tree_mask", "mask_words"]


def _require_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def split_mla_q(q: torch.Tensor):
    """Split MLA queries into the latent and rope parts, as views (no copy).

    Args:
        q: ``[T, H, 576]`` bfloat16 (SGLang passes it contiguous; any strides with a contiguous
            last dimension are accepted).
    Returns:
        ``(q_nope, q_pe)``: ``q[..., :512]`` and ``q[..., 512:]``, ``[T, H, 512]`` and ``[T, H, 64]``,
        sharing q's storage.
    """
    _require_tensor(q, "q")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be bfloat16, got {q.dtype}")
    if q.dim() != 3 or q.shape[-1] != HEAD_DIM_QK:
        raise ValueError(f"q must be [T, H, {HEAD_DIM_QK}], got shape {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise ValueError(f"q must have a contiguous last dimension (stride 1), got strides {q.stride()}")
    return q[..., :HEAD_DIM_NOPE], q[..., HEAD_DIM_NOPE:]


def kv_cache_2d(key_buffer: torch.Tensor) -> torch.Tensor:
    """The MLA latent pool as a ``[S, 576]`` view (no copy).

    Args:
        key_buffer: ``MLATokenToKVPool.get_key_buffer(layer_id)``, ``[S, 1, 576]`` bfloat16 or float8_e4m3fn (an
            fp8_e4m3 KV cache), or an already 2-D ``[S, 576]`` tensor of those; last dimension contiguous.
    Returns:
        ``[S, 576]`` view of the same storage (row stride = the buffer's slot stride).
    """
    _require_tensor(key_buffer, "key_buffer")
    if key_buffer.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        raise TypeError(f"key_buffer must be bfloat16 or float8_e4m3fn, got {key_buffer.dtype}")
    if key_buffer.dim() == 3:
        if key_buffer.shape[1] != 1 or key_buffer.shape[2] != HEAD_DIM_QK:
            raise ValueError(f"key_buffer must be [S, 1, {HEAD_DIM_QK}] or [S, {HEAD_DIM_QK}], "
                             f"got shape {tuple(key_buffer.shape)}")
        view = key_buffer.select(1, 0)
    elif key_buffer.dim() == 2:
        if key_buffer.shape[1] != HEAD_DIM_QK:
            raise ValueError(f"key_buffer must be [S, 1, {HEAD_DIM_QK}] or [S, {HEAD_DIM_QK}], "
                             f"got shape {tuple(key_buffer.shape)}")
        view = key_buffer.view(key_buffer.shape)
    else:
        raise ValueError(f"key_buffer must be [S, 1, {HEAD_DIM_QK}] or [S, {HEAD_DIM_QK}], "
                         f"got shape {tuple(key_buffer.shape)}")
    if view.stride(-1) != 1:
        raise ValueError(f"key_buffer must have a contiguous last dimension, got strides {key_buffer.stride()}")
    return view


def mask_words(max_n: int) -> int:
    """Words per packed mask row for requests of up to ``max_n`` verify tokens: ``ceil(max_n / 64)``."""
    if isinstance(max_n, bool) or not isinstance(max_n, int):
        raise TypeError(f"max_n must be an int, got {type(max_n).__name__}")
    words = (max_n + 63) // 64
    if not 1 <= words <= MAX_MASK_WORDS:
        raise ValueError(f"max_n must be in [1, {64 * MAX_MASK_WORDS}] (at most {MAX_MASK_WORDS} mask words), "
                         f"got {max_n}")
    return words


def _check_indptr(t, name: str, dtypes, device) -> None:
    _require_tensor(t, name)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must be {want}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but custom_mask is on {device}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B + 1], got shape {tuple(t.shape)}")


def check_custom_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr) -> torch.device:
    """The structural checks of SGLang's flat ``custom_mask`` and the indptrs that delimit it (types, dtypes,
    devices, shapes; never values), shared by :func:`build_tree_mask` and ``verify_attention(custom_mask=...)``.
    Returns custom_mask's device; raises TypeError / ValueError naming the argument."""
    _require_tensor(custom_mask, "custom_mask")
    if custom_mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(f"custom_mask must be bool or uint8, got {custom_mask.dtype}")
    if custom_mask.dim() != 1:
        raise ValueError(f"custom_mask must be 1-D (SGLang's flat layout), got shape {tuple(custom_mask.shape)}")
    device = custom_mask.device
    _check_indptr(mask_indptr, "mask_indptr", (torch.int64, torch.int32), device)
    _check_indptr(qo_indptr, "qo_indptr", (torch.int32, torch.int64), device)
    _check_indptr(kv_indptr, "kv_indptr", (torch.int32, torch.int64), device)
    if not (mask_indptr.shape[0] == qo_indptr.shape[0] == kv_indptr.shape[0] >= 2):
        raise ValueError(
            f"mask_indptr, qo_indptr and kv_indptr must all be [B + 1] with B >= 1, got lengths "
            f"{mask_indptr.shape[0]}, {qo_indptr.shape[0]}, {kv_indptr.shape[0]}")
    return device


def build_tree_mask(
    custom_mask: Optional[torch.Tensor],
    mask_indptr: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    num_tokens: int,
    max_n: int,
) -> Optional[torch.Tensor]:
    """Pack the draft block of SGLang's flat ``custom_mask`` into the kernel's bit mask.

    Args:
        custom_mask: 1-D bool or uint8, at least ``mask_indptr[B]`` bytes (a CUDA-graph buffer may be
            longer; only what the indptrs delimit is read), or None.
        mask_indptr: ``[B + 1]`` int64 (int32 accepted), start of each request's block.
        qo_indptr: ``[B + 1]`` int32 or int64, verify rows of each request.
        kv_indptr: ``[B + 1]`` int32 (int64 accepted), committed prefix of each request (P_b).
        num_tokens: T, the number of verify rows (``qo_indptr[B]``), a host int.
        max_n: host upper bound on the verify tokens per request; fixes ``W = ceil(max_n / 64)``.
    Returns:
        ``[T, W]`` int64 on custom_mask's device, bit j of word ``j // 64`` of row
        ``qo_indptr[b] + n`` set iff ``custom_mask[mask_indptr[b] + n*(P_b+N_b) + P_b + j] != 0``;
        bits at ``j >= N_b`` are 0. None when ``custom_mask`` is None (causal chain).

    CUDA: one kernel on ``torch.cuda.current_stream()``, no host synchronisation, output from
    ``torch.empty`` (graph-capturable); requests longer than ``64 * W`` are the caller's bug and
    are not detected. CPU: vectorised torch, validated (raises ValueError).
    """
    if custom_mask is None:
        return None
    device = check_custom_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    words = mask_words(max_n)

    if device.type == "cuda":
        return _build_tree_mask_cuda(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_tokens, words)
    return _build_tree_mask_torch(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_tokens, words)


def _build_tree_mask_cuda(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_tokens, words):
    ext = _ext.load()
    batch = qo_indptr.shape[0] - 1
    # dtype conversions are stream-ordered torch ops (no sync); the common SGLang dtypes need none
    mask_indptr = mask_indptr.to(torch.int64).contiguous()
    kv_indptr = kv_indptr.to(torch.int32).contiguous()
    qo_indptr = qo_indptr.contiguous()
    custom_mask = custom_mask.contiguous()
    out = torch.empty((num_tokens, words), dtype=torch.int64, device=custom_mask.device)
    with torch.cuda.device(custom_mask.device):
        ext.pack_tree_mask(
            custom_mask=custom_mask.data_ptr(),
            mask_indptr=mask_indptr.data_ptr(),
            qo_indptr=qo_indptr.data_ptr(),
            qo_indptr_dtype=0 if qo_indptr.dtype == torch.int32 else 1,
            kv_indptr=kv_indptr.data_ptr(),
            batch_size=batch,
            num_tokens=num_tokens,
            out=out.data_ptr(),
            out_words=words,
            stream=torch.cuda.current_stream(custom_mask.device).cuda_stream,
        )
    return out


def _build_tree_mask_torch(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_tokens, words):
    qo = qo_indptr.long()
    kv = kv_indptr.long()
    mi = mask_indptr.long()
    n_req = qo[1:] - qo[:-1]
    p_req = kv[1:] - kv[:-1]
    if bool((n_req < 0).any()) or bool((p_req < 0).any()) or int(qo[0]) != 0:
        raise ValueError(f"qo_indptr must rise from 0 and kv_indptr must not decrease, got "
                         f"qo_indptr={qo.tolist()}, kv_indptr={kv.tolist()}")
    if int(qo[-1]) != num_tokens:
        raise ValueError(f"qo_indptr[B]={int(qo[-1])} must equal num_tokens={num_tokens}")
    if int(n_req.max()) > 64 * words:
        raise ValueError(f"max_n gives {words} mask words ({64 * words} draft tokens) but a request has "
                         f"{int(n_req.max())} verify tokens")
    block_end = mi[:-1] + n_req * (p_req + n_req)
    if bool((block_end > mi[1:]).any()) or int(mi[0]) < 0 or int(block_end.max()) > custom_mask.numel():
        raise ValueError(f"mask_indptr does not delimit N_b x (P_b + N_b) blocks inside custom_mask "
                         f"({custom_mask.numel()} bytes): mask_indptr={mi.tolist()}")

    device = custom_mask.device
    t = torch.arange(num_tokens, device=device)
    req = torch.searchsorted(qo[1:], t, right=True)  # request of each verify row (empty ones skipped)
    n = t - qo[req]
    n_b, p_b = n_req[req], p_req[req]
    row_start = mi[req] + n * (p_b + n_b) + p_b  # first draft column of the row
    j = torch.arange(64 * words, device=device)
    inside = j[None, :] < n_b[:, None]  # [T, 64W]
    flat = torch.where(inside, row_start[:, None] + j[None, :], torch.zeros_like(j)[None, :])
    bits = (custom_mask[flat] != 0) & inside  # [T, 64W] bool

    bits = bits.view(num_tokens, words, 64).long()
    shifts = torch.arange(63, device=device)
    low = (bits[..., :63] << shifts).sum(dim=-1)  # bits 0..62: the sum stays below 2**63
    sign = torch.where(bits[..., 63].bool(), torch.full_like(low, -(2 ** 63)), torch.zeros_like(low))
    return low | sign
