"""Synthetic TARGET_VERIFY batches in SGLang's exact layout, for checks, tests and benchmarks.

A batch holds what SGLang hands ``forward_extend`` on a verify step of an MLA model:
``q`` [T, H, 576], the new latent rows ``k`` [T, 1, 576], a page-size-1 KV pool [S, 1, 576] whose
slots are a random permutation (unused slots poisoned with NaN), ``kv_indptr``/``kv_indices``,
``qo_indptr`` and SGLang's flat ``custom_mask`` (or None for a causal chain).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["VerifyBatch", "make_verify_batch", "random_tree_visibility"]


@dataclass
class VerifyBatch:
    q: torch.Tensor              # [T, H, 576] bf16
    k: torch.Tensor              # [T, 1, 576] bf16, the verify tokens' latent rows
    kv_buffer: torch.Tensor      # [S, 1, 576] bf16 or float8_e4m3fn pool; unused slots NaN when poisoned
    kv_indptr: torch.Tensor      # [B + 1] int32
    kv_indices: torch.Tensor     # [sum P] int64
    qo_indptr: torch.Tensor      # [B + 1] int32
    custom_mask: Optional[torch.Tensor]  # flat bool, SGLang layout, or None (causal)
    mask_indptr: torch.Tensor    # [B + 1] int64
    out_cache_loc: torch.Tensor  # [T] int64 free slots where SGLang would save k
    sm_scale: float
    max_n: int
    visibility: list             # per request: [N, N] bool tree block (what the mask encodes)

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    def verify_args(self) -> dict:
        """Keyword arguments of ``kdtree.verify_attention`` (and of the reference) for this batch: q
        split into nope/pe, the pool viewed as [slots, 576], the tree mask rebuilt from custom_mask."""
        from .layout import build_tree_mask, kv_cache_2d, split_mla_q

        q_nope, q_pe = split_mla_q(self.q)
        tree = build_tree_mask(self.custom_mask, self.mask_indptr, self.qo_indptr, self.kv_indptr,
                               self.num_tokens, self.max_n)
        return dict(q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache_2d(self.kv_buffer), kv_indptr=self.kv_indptr,
                    kv_indices=self.kv_indices, qo_indptr=self.qo_indptr, k_new=self.k[:, 0], tree_mask=tree,
                    sm_scale=self.sm_scale)


def random_tree_visibility(n: int, kind: str, gen: torch.Generator, pad: int = 0) -> torch.Tensor:
    """[n, n] bool: row i sees draft j. kinds: 'tree' (random parents before children, node 0 the root),
    'chain' (causal), 'star' (everyone sees the root and itself), 'deep' (a chain). The last ``pad`` rows
    are all False (DDTree padding nodes)."""
    vis = torch.zeros(n, n, dtype=torch.bool)
    if kind in ("chain", "deep"):
        vis = torch.ones(n, n, dtype=torch.bool).tril()
    elif kind == "star":
        vis[:, 0] = True
        vis |= torch.eye(n, dtype=torch.bool)
    elif kind == "tree":
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        for i in range(n):
            j = i
            while j >= 0:
                vis[i, j] = True
                j = parent[j]
    else:
        raise ValueError(f"kind must be one of tree/chain/star/deep, got {kind!r}")
    if pad:
        vis[n - pad:] = False
    return vis


def make_verify_batch(
    prefixes: Sequence[int],
    num_heads: int,
    num_tokens: int,
    *,
    kind: str = "tree",
    pad: int = 0,
    causal_none: bool = False,
    device: str | torch.device = "cpu",
    seed: int = 0,
    pool_factor: float = 2.0,
    min_pool_slots: int = 0,
    shuffle: bool = True,
    poison: bool = True,
    sm_scale: float = 192 ** -0.5,
    graph_tails: bool = False,
    kv_dtype: torch.dtype = torch.bfloat16,
    page_size: int = 1,
) -> VerifyBatch:
    """Build one verify batch: ``len(prefixes)`` requests, each with ``num_tokens`` verify tokens.

    ``causal_none=True`` passes ``custom_mask=None`` (DFlash chains); otherwise SGLang's flat mask is
    built from a random visibility of ``kind`` with ``pad`` all-False rows (prefix columns too).
    ``graph_tails=True`` lays ``kv_indices`` and ``custom_mask`` out as SGLang's CUDA-graph buffers
    hold them: longer than the indptrs delimit, the tails garbage (slot ids that may name poisoned
    slots, random mask bytes) that a correct consumer never reads. ``kv_dtype=torch.float8_e4m3fn`` builds an e4m3
    pool (SGLang's fp8_e4m3 KV cache: the rows are the bf16 values rounded to e4m3; poisoned slots hold the e4m3 NaN
    byte 0x7F). ``page_size > 1`` allocates as SGLang's paged pools do: each request's prefix, then its drafts, fill
    whole pages of its own in order, the pages drawn at random (``shuffle``) or in order, page 0 never handed out."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)                 # trees (host)
    dgen = torch.Generator(device=dev).manual_seed(seed)      # tensors, drawn where they live
    b = len(prefixes)
    n = num_tokens
    total_p = int(sum(prefixes))
    t = b * n
    need = total_p + t + 1
    slots = max(int(math.ceil(need * pool_factor)), need, min_pool_slots)

    def randn(*shape):
        return torch.randn(*shape, generator=dgen, device=dev).to(torch.bfloat16)

    if kv_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"kv_dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {kv_dtype}")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if page_size == 1:
        # slot 0 is SGLang's padding slot: never handed out
        perm = (torch.randperm(slots - 1, generator=dgen, device=dev) + 1 if shuffle
                else torch.arange(1, slots, device=dev))
        kv_indices = perm[:total_p].to(torch.int64)
        out_cache_loc = perm[total_p:total_p + t].to(torch.int64)
    else:
        pages_of = [-(-(p + n) // page_size) for p in prefixes]
        num_pages = max(-(-slots // page_size), sum(pages_of) + 1)
        slots = num_pages * page_size
        # page 0 holds SGLang's padding slot: never handed out
        order = (torch.randperm(num_pages - 1, generator=dgen, device=dev) + 1 if shuffle
                 else torch.arange(1, num_pages, device=dev))
        offs = torch.arange(page_size, device=dev)
        prefix_slots, draft_slots, first = [], [], 0
        for p, np_ in zip(prefixes, pages_of):
            req = (order[first:first + np_, None] * page_size + offs).flatten()
            prefix_slots.append(req[:p])
            draft_slots.append(req[p:p + n])
            first += np_
        kv_indices = torch.cat(prefix_slots).to(torch.int64)
        out_cache_loc = torch.cat(draft_slots).to(torch.int64)
    if poison:
        pool = torch.full((slots, 1, 576), float("nan"), dtype=torch.bfloat16, device=dev).to(kv_dtype)
    else:
        pool = randn(slots, 1, 576).to(kv_dtype)
    pool[kv_indices] = randn(total_p, 1, 576).to(kv_dtype)
    q = randn(t, num_heads, 576)
    k = randn(t, 1, 576)
    kv_indptr = torch.zeros(b + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(list(prefixes), dtype=torch.int64).cumsum(0).to(torch.int32)
    qo_indptr = torch.arange(0, t + 1, n, dtype=torch.int32)
    vis_all, blocks, mask_indptr = [], [], [0]
    for p in prefixes:
        vis = random_tree_visibility(n, "chain" if causal_none else kind, gen, pad=0 if causal_none else pad)
        vis_all.append(vis)
        block = torch.zeros(n, p + n, dtype=torch.bool)
        block[:, :p] = True
        if pad and not causal_none:
            block[n - pad:, :p] = False
        block[:, p:] = vis
        blocks.append(block.flatten())
        mask_indptr.append(mask_indptr[-1] + n * (p + n))
    custom_mask = None if causal_none else torch.cat(blocks)
    if graph_tails:
        kv_indices = torch.cat([kv_indices, torch.randint(0, slots, (37,), generator=dgen, device=dev)])
        if custom_mask is not None:
            custom_mask = torch.cat([custom_mask, torch.rand((1000,), generator=gen) < 0.5])
    return VerifyBatch(
        q=q, k=k, kv_buffer=pool, kv_indptr=kv_indptr.to(dev),
        kv_indices=kv_indices, qo_indptr=qo_indptr.to(dev),
        custom_mask=None if custom_mask is None else custom_mask.to(dev),
        mask_indptr=torch.tensor(mask_indptr, dtype=torch.int64, device=dev),
        out_cache_loc=out_cache_loc, sm_scale=float(sm_scale), max_n=n, visibility=vis_all,
    )
