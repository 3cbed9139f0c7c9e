"""Float64 models of the FP8 verify numerics, for the tests: SGLang's Triton extend kernel on an e4m3 pool, and the
e4m3 split of q that kdtree's FP8 kernel computes with (src/cuda/verify_q8.cuh).

SGLang's kernel cannot be run for this on CPU: Triton's interpreter (triton 3.x) casts float32 to float8e4nv wrongly
for some values (21 of 1,024 N(0, 3) samples differ from torch's round-to-nearest cast, by up to 50%), so its
fp8 results are far off what the GPU computes. This model follows `extend_attention_fwd`'s source instead
(sglang 0.5.23, `kernels/ops/attention/extend_attention.py`, the prefix loop with USE_FP8_PREFIX and the extend
loop): q cast to e4m3 unscaled, scores times sm_scale * k_scale, a running maximum per block of keys, P * 448 cast to
e4m3 for P V, times v_scale / 448, the row sums of the float P; the drafts in bf16, unscaled.
"""

from __future__ import annotations

import math

import torch

from kdtree.reference import tree_mask_bits

E4M3 = torch.float8_e4m3fn
LOG2E = 1.0 / math.log(2.0)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 (nearest even, saturating as the kernels' satfinite casts do) and back, in float64."""
    return x.clamp(-448.0, 448.0).to(E4M3).to(torch.float64)


def sglang_fp8(q, kv_cache, kv_indptr, kv_indices, qo_indptr, k_new, tree_mask, sm_scale, k_scale=1.0, v_scale=1.0,
               block=64):
    """SGLang's fp8 verify on CPU tensors: q [T, H, 576] bf16, kv_cache [S, 576] e4m3, k_new [T, 576] bf16, tree_mask
    as kdtree packs it (None: causal). Returns [T, H, 512] float64."""
    q = q.double()
    t_all, heads = q.shape[:2]
    out = torch.zeros(t_all, heads, 512, dtype=torch.float64)
    qo, kp = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        t0, t1 = qo[b], qo[b + 1]
        n = t1 - t0
        if n == 0:
            continue
        keys = kv_cache[kv_indices[kp[b]:kp[b + 1]].long()].double()
        q8 = e4m3(q[t0:t1])
        m = torch.full((n, heads), -1e20, dtype=torch.float64)
        l = torch.zeros(n, heads, dtype=torch.float64)
        acc = torch.zeros(n, heads, 512, dtype=torch.float64)
        for s0 in range(0, keys.shape[0], block):
            k = keys[s0:s0 + block]
            s = torch.einsum("nhd,kd->nhk", q8, k) * (sm_scale * k_scale * LOG2E)
            m_new = torch.maximum(m, s.amax(-1))
            re = torch.exp2(m - m_new)
            p = torch.exp2(s - m_new[..., None])
            l = l * re + p.sum(-1)
            acc = acc * re[..., None] + torch.einsum("nhk,kd->nhd", e4m3(p * 448.0), k[:, :512]) * (v_scale / 448.0)
            m = m_new
        kn = k_new[t0:t1].double()
        vis = torch.ones(n, n, dtype=torch.bool).tril() if tree_mask is None else tree_mask_bits(tree_mask[t0:t1], n)
        s = (torch.einsum("nhd,kd->nhk", q[t0:t1], kn) * (sm_scale * LOG2E)).masked_fill(~vis[:, None, :], -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        re = torch.exp2(m - m_new)
        p = torch.exp2(s - m_new[..., None])
        l = l * re + p.sum(-1)
        acc = acc * re[..., None] + torch.einsum("nhk,kd->nhd", p.to(torch.bfloat16).double(), kn[:, :512])
        out[t0:t1] = torch.where(l[..., None] > 0, acc / l[..., None].clamp_min(1e-300), torch.zeros_like(acc))
    return out


def q8_row_exponent(amax: float) -> int:
    """The power of two e with amax / 2^e in (224, 448]; 0 for amax 0, -126 for a subnormal amax
    (verify_q8.cuh's q8_row_exponent)."""
    if not amax > 0:
        return 0
    if amax < 2.0 ** -126:
        return -126
    mant, exp = math.frexp(amax)   # amax = mant * 2^exp, mant in [0.5, 1)
    return exp - 9 + (1 if mant > 0.875 else 0)


def q8_split(q_row: torch.Tensor):
    """(hi, lo, e) of one row of q (float values): q = 2^e (hi + lo), hi = e4m3(q / 2^e), lo = e4m3(q / 2^e - hi)."""
    x = q_row.double()
    e = q8_row_exponent(float(x.abs().max()))
    scaled = x * 2.0 ** -e
    hi = e4m3(scaled)
    lo = e4m3(scaled - hi)
    return hi, lo, e
