"""Plain-torch reference of the paged tree-verify attention (the semantics of kdtree_verify.h).

Used by the CPU path of :func:`kdtree.verify_attention`, by the tests and by ``python -m kdtree
check``. It favours obviousness over speed: one loop over the requests, every product in
``dtype`` (float32 by default, float64 for ground truth).

Semantics, per request b (rows ``qo_indptr[b]:qo_indptr[b+1]``, N_b of them; prefix slots
``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, P_b of them):

* keys are the P_b prefix rows ``kv_cache[slot]`` in that order, then the N_b rows ``k_new[qo_indptr[b]:]``;
  a prefix key scores as ``k_scale * kv_cache[slot]`` and its value is ``v_scale * kv_cache[slot][:512]`` (SGLang's
  k_descale / v_descale, on the pool's values dequantised exactly: bf16 or e4m3 to float); drafts are unscaled;
* ``score = sm_scale * (q_nope . key[:512] + q_pe . key[512:])``;
* every prefix key is visible; draft key j is visible to verify token n iff bit j of
  ``tree_mask[qo_indptr[b] + n]`` is set, or ``j <= n`` when ``tree_mask`` is None (causal chain);
* ``out = softmax(visible scores) @ key[:512]``; a row that sees no key at all gets zeros.

Only the listed slots are read, so NaN in unused pool rows can never reach the result.
"""

from __future__ import annotations

from typing import Optional

import torch

HEAD_DIM_NOPE = 512
HEAD_DIM_PE = 64
HEAD_DIM_QK = HEAD_DIM_NOPE + HEAD_DIM_PE
HEAD_DIM_V = HEAD_DIM_NOPE

__all__ = ["verify_attention_reference", "tree_mask_bits"]


def tree_mask_bits(tree_mask: torch.Tensor, n: int) -> torch.Tensor:
    """Decode the first ``n`` bits of each row of a packed ``[R, W]`` int64 mask -> ``[R, n]`` bool.

    Bit j lives in word ``j // 64`` at position ``j % 64``; bit 63 is the sign bit of the int64 word
    (an arithmetic shift keeps it readable: ``(w >> 63) & 1``).
    """
    j = torch.arange(n, device=tree_mask.device)
    words = tree_mask[:, j // 64]
    return ((words >> (j % 64)) & 1).bool()


def _host_list(t: torch.Tensor, name: str) -> list:
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return [int(x) for x in t.tolist()]


def verify_attention_reference(
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
    dtype: torch.dtype = torch.float32,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Reference tree-verify attention; returns ``[T, H, 512]`` in ``dtype`` on q_nope's device.

    Args:
        q_nope: ``[T, H, 512]`` floating point, the absorbed latent part of the queries.
        q_pe: ``[T, H, 64]`` floating point, the rope part.
        kv_cache: ``[S, 576]`` (or SGLang's ``[S, 1, 576]``) latent pool; ``[:, :512]`` are the values.
        kv_indptr: ``[B + 1]`` integer, prefix of request b at ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``.
        kv_indices: 1-D integer slot ids into ``kv_cache`` (may be longer than ``kv_indptr[B]``).
        qo_indptr: ``[B + 1]`` integer, verify rows of request b; ``qo_indptr[B] == T``.
        k_new: ``[T, 576]`` (or ``[T, 1, 576]``) the verify tokens' own latent rows.
        tree_mask: ``[T, W]`` int64 packed visibility of the drafts (bit j of word j // 64),
            or None for a causal chain.
        sm_scale: softmax scale.
        dtype: computation and output dtype, ``torch.float32`` or ``torch.float64``.
        k_scale, v_scale: the prefix keys' score and value factors (1: none).

    Index tensors are read on the host (this is a reference, not a graph-capturable path).
    Raises ValueError for inconsistent sizes (indptr lengths, ``qo_indptr[B] != T``, indices out of
    range, a request with more drafts than ``64 * W`` mask bits).
    """
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if kv_cache.dim() == 3 and kv_cache.shape[1] == 1:
        kv_cache = kv_cache[:, 0]
    if k_new.dim() == 3 and k_new.shape[1] == 1:
        k_new = k_new[:, 0]
    if q_nope.dim() != 3 or q_nope.shape[-1] != HEAD_DIM_NOPE:
        raise ValueError(f"q_nope must be [T, H, {HEAD_DIM_NOPE}], got shape {tuple(q_nope.shape)}")
    T, H = q_nope.shape[:2]
    if tuple(q_pe.shape) != (T, H, HEAD_DIM_PE):
        raise ValueError(f"q_pe must be [T, H, {HEAD_DIM_PE}] = {(T, H, HEAD_DIM_PE)}, got {tuple(q_pe.shape)}")
    if kv_cache.dim() != 2 or kv_cache.shape[1] != HEAD_DIM_QK:
        raise ValueError(f"kv_cache must be [S, {HEAD_DIM_QK}], got shape {tuple(kv_cache.shape)}")
    if tuple(k_new.shape) != (T, HEAD_DIM_QK):
        raise ValueError(f"k_new must be [T, {HEAD_DIM_QK}] = {(T, HEAD_DIM_QK)}, got {tuple(k_new.shape)}")

    kv_ptr = _host_list(kv_indptr, "kv_indptr")
    qo_ptr = _host_list(qo_indptr, "qo_indptr")
    if len(kv_ptr) != len(qo_ptr) or len(qo_ptr) < 2:
        raise ValueError(
            f"kv_indptr and qo_indptr must both have B + 1 >= 2 entries, got {len(kv_ptr)} and {len(qo_ptr)}")
    B = len(qo_ptr) - 1
    if qo_ptr[0] != 0 or qo_ptr[B] != T or any(qo_ptr[b + 1] < qo_ptr[b] for b in range(B)):
        raise ValueError(f"qo_indptr must rise from 0 to T={T}, got {qo_ptr}")
    if kv_ptr[0] < 0 or any(kv_ptr[b + 1] < kv_ptr[b] for b in range(B)):
        raise ValueError(f"kv_indptr must be non-negative and non-decreasing, got {kv_ptr}")
    if kv_ptr[B] > kv_indices.numel():
        raise ValueError(f"kv_indptr[B]={kv_ptr[B]} exceeds kv_indices' length {kv_indices.numel()}")
    if tree_mask is not None:
        if tree_mask.dim() != 2 or tree_mask.shape[0] != T:
            raise ValueError(f"tree_mask must be [T={T}, W], got shape {tuple(tree_mask.shape)}")
        max_n = max(qo_ptr[b + 1] - qo_ptr[b] for b in range(B))
        if max_n > 64 * tree_mask.shape[1]:
            raise ValueError(
                f"tree_mask has {tree_mask.shape[1]} words per row ({64 * tree_mask.shape[1]} draft tokens) "
                f"but a request has {max_n} verify tokens")

    S = kv_cache.shape[0]
    out = torch.zeros((T, H, HEAD_DIM_V), dtype=dtype, device=q_nope.device)
    for b in range(B):
        t0, t1 = qo_ptr[b], qo_ptr[b + 1]
        n_b = t1 - t0
        if n_b == 0:
            continue
        slots = kv_indices[kv_ptr[b]:kv_ptr[b + 1]].long()
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= S):
            raise ValueError(f"kv_indices of request {b} leave the pool [0, {S})")
        p_b = slots.numel()
        prefix = kv_cache[slots].to(dtype)
        keys = torch.cat([prefix * k_scale, k_new[t0:t1].to(dtype)], dim=0)  # [P+N, 576]
        values = torch.cat([prefix[:, :HEAD_DIM_V] * v_scale, k_new[t0:t1, :HEAD_DIM_V].to(dtype)], dim=0)
        q = torch.cat([q_nope[t0:t1].to(dtype), q_pe[t0:t1].to(dtype)], dim=-1)  # [N, H, 576]
        scores = torch.einsum("nhd,kd->nhk", q, keys) * sm_scale

        if tree_mask is None:
            draft_vis = torch.ones((n_b, n_b), dtype=torch.bool, device=q.device).tril()
        else:
            draft_vis = tree_mask_bits(tree_mask[t0:t1], n_b)
        visible = torch.cat(
            [torch.ones((n_b, p_b), dtype=torch.bool, device=q.device), draft_vis], dim=1)[:, None, :]

        scores = scores.masked_fill(~visible, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        # -inf only for a row that sees no key; NaN (from a NaN key that IS read) must propagate
        row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
        p = torch.exp(scores - row_max)  # exactly 0 for the invisible keys (exp(-inf))
        denom = p.sum(dim=-1, keepdim=True)
        acc = torch.einsum("nhk,kd->nhd", p, values)
        # a row with no visible key has denom == 0 and gets zeros, never 0/0
        out[t0:t1] = torch.where(denom == 0, torch.zeros_like(acc), acc / torch.where(denom == 0, 1.0, denom))
    return out
