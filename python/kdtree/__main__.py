"""Command line: ``python -m kdtree info`` and ``python -m kdtree check [...]``.

``info``   the package version, the extension's compiled CUDA architectures (when built), torch's
           version and the GPU (or "no GPU").
``check``  builds a synthetic DDTree-style verify batch exactly as SGLang lays it out (random
           draft trees with parents before children, all-False padding rows, a shuffled paged pool
           several times larger than needed with NaN in every slot the call must not read, a flat
           ``custom_mask`` in an oversized buffer), converts it with kdtree.layout, runs
           kdtree.verify_attention (the CUDA kernel when a GPU and the extension are there, the
           float32 reference on CPU otherwise) and compares with a float64 reference. Exit status
           1 on a mismatch or a non-finite output.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from types import SimpleNamespace
from typing import List, Optional

import torch

from . import __version__, _ext
from .layout import build_tree_mask, kv_cache_2d, split_mla_q
from .ops import verify_attention
from .reference import verify_attention_reference

# bf16-level agreement: |out - ref| <= ATOL + RTOL * |ref| elementwise
ATOL = 1e-2
RTOL = 1e-2


def _info(_args) -> int:
    print(f"kdtree {__version__}")
    try:
        ext = _ext.load()
        print(f"extension: {getattr(ext, '__file__', 'kdtree._verify')}")
        print(f"compiled archs: {ext.compiled_archs()}")
    except ImportError as exc:
        print(f"extension: not available ({exc.__cause__ or exc})")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), Python {platform.python_version()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            print(f"GPU {i}: {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    else:
        print("GPU: no GPU")
    return 0


def random_tree_rows(n: int, num_padding: int, gen: torch.Generator) -> torch.Tensor:
    """``[n, n]`` bool draft-visibility block of a random tree: node i > 0 gets a parent in [0, i)
    (parents before children, as EAGLE and DDTree order them) and sees its ancestors and itself;
    the last ``num_padding`` rows are all-False padding nodes (DDTree's unused budget)."""
    vis = torch.zeros((n, n), dtype=torch.bool)
    live = n - num_padding
    for i in range(live):
        if i > 0:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            vis[i] = vis[parent]
        vis[i, i] = True
    return vis


def make_verify_batch(prefix_lens: List[int], num_tokens: int, num_heads: int, seed: int = 0,
                      pool_factor: int = 4) -> SimpleNamespace:
    """A synthetic TARGET_VERIFY batch in SGLang's layout (CPU tensors, bfloat16 data).

    Returns a namespace with SGLang's tensors (``q [T,H,576]``, ``k [T,1,576]``, ``key_buffer
    [S,1,576]``, ``qo_indptr`` int32, ``kv_indptr`` int32, ``kv_indices`` int64 with a garbage tail,
    ``custom_mask`` bool with a garbage tail, ``mask_indptr`` int64, ``max_n``) and ``sm_scale``.
    Unused pool slots hold NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    B, N, H = len(prefix_lens), num_tokens, num_heads
    T = B * N
    num_padding = min(2, N - 1)
    S = pool_factor * (sum(prefix_lens) + T) + 1  # slot 0 is SGLang's dummy slot
    slots = torch.randperm(S - 1, generator=gen) + 1
    key_buffer = torch.full((S, 1, 576), float("nan"), dtype=torch.bfloat16)

    kv_indices, blocks = [], []
    offset = 0
    for p in prefix_lens:
        idx = slots[offset:offset + p]
        offset += p
        key_buffer[idx] = torch.randn((p, 1, 576), generator=gen).to(torch.bfloat16)
        kv_indices.append(idx)
        block = torch.zeros((N, p + N), dtype=torch.bool)
        tree = random_tree_rows(N, num_padding, gen)
        live = tree.any(dim=1)
        block[:, :p] = live[:, None]  # padding rows are all-False, prefix columns too
        block[:, p:] = tree
        blocks.append(block.flatten())
    # the drafts' own rows are also written to the pool (SGLang's set_kv_buffer at out_cache_loc)
    k = torch.randn((T, 1, 576), generator=gen).to(torch.bfloat16)
    key_buffer[slots[offset:offset + T]] = k

    def indptr(lengths, dtype):
        return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(dtype)

    tail = torch.randint(0, S, (37,), generator=gen)  # graph buffers run past kv_indptr[B]
    flat_mask = torch.cat(blocks + [torch.rand((1000,), generator=gen) < 0.5])
    return SimpleNamespace(
        q=torch.randn((T, H, 576), generator=gen).to(torch.bfloat16),
        k=k,
        key_buffer=key_buffer,
        qo_indptr=indptr([N] * B, torch.int32),
        kv_indptr=indptr(list(prefix_lens), torch.int32),
        kv_indices=torch.cat(kv_indices + [tail]).to(torch.int64),
        custom_mask=flat_mask,
        mask_indptr=indptr([N * (p + N) for p in prefix_lens], torch.int64),
        max_n=N,
        num_tokens=T,
        sm_scale=0.1147,
    )


def _check(args) -> int:
    if args.tokens < 1 or args.heads < 1 or args.batch < 1:
        print("check: --tokens, --heads and --batch must be >= 1", file=sys.stderr)
        return 2
    prefixes = [args.prefix[b % len(args.prefix)] for b in range(args.batch)]
    batch = make_verify_batch(prefixes, args.tokens, args.heads, seed=args.seed)
    q_nope, q_pe = split_mla_q(batch.q)
    kv_cache = kv_cache_2d(batch.key_buffer)
    k_new = batch.k[:, 0]
    tree_cpu = build_tree_mask(batch.custom_mask, batch.mask_indptr, batch.qo_indptr, batch.kv_indptr,
                               batch.num_tokens, batch.max_n)
    ref = verify_attention_reference(q_nope, q_pe, kv_cache, batch.kv_indptr, batch.kv_indices,
                                     batch.qo_indptr, k_new, tree_cpu, batch.sm_scale, dtype=torch.float64)

    use_gpu = torch.cuda.is_available() and not args.cpu
    if use_gpu and not _ext.available():
        print("a GPU is present but kdtree._verify is not built; using the CPU reference path")
        use_gpu = False
    print(f"B={args.batch} H={args.heads} N={args.tokens} prefixes={prefixes} seed={args.seed} "
          f"pool={kv_cache.shape[0]} slots")
    mask_ok = True
    if use_gpu:
        dev = torch.device("cuda")
        print(f"path: CUDA kernel on {torch.cuda.get_device_name(dev)}")
        g = {name: getattr(batch, name).to(dev) for name in
             ("q", "key_buffer", "k", "qo_indptr", "kv_indptr", "kv_indices", "custom_mask", "mask_indptr")}
        tree = build_tree_mask(g["custom_mask"], g["mask_indptr"], g["qo_indptr"], g["kv_indptr"],
                               batch.num_tokens, batch.max_n)
        mask_ok = torch.equal(tree.cpu(), tree_cpu)
        gq_nope, gq_pe = split_mla_q(g["q"])
        call_args = (gq_nope, gq_pe, kv_cache_2d(g["key_buffer"]), g["kv_indptr"], g["kv_indices"],
                     g["qo_indptr"], g["k"][:, 0], tree, batch.sm_scale)
        out = verify_attention(*call_args)  # warm-up (also grows the workspace cache)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeat):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = verify_attention(*call_args, out=out)
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
        elapsed_us = sorted(times)[len(times) // 2]
        out = out.cpu()
    else:
        print("path: CPU reference (float32) via kdtree.verify_attention" +
              ("" if torch.cuda.is_available() else " (no GPU)"))
        t0 = time.perf_counter()
        out = verify_attention(q_nope, q_pe, kv_cache, batch.kv_indptr, batch.kv_indices, batch.qo_indptr,
                               k_new, tree_cpu, batch.sm_scale)
        elapsed_us = (time.perf_counter() - t0) * 1e6

    out64 = out.to(torch.float64)
    finite = bool(torch.isfinite(out64).all())
    err = (out64 - ref).abs()
    max_abs = float(err.max()) if finite else math.nan
    max_rel = max_abs / max(float(ref.abs().max()), 1e-30) if finite else math.nan
    within = finite and bool((err <= ATOL + RTOL * ref.abs()).all())
    print(f"max abs error {max_abs:.3e}, max error / max|ref| {max_rel:.3e} "
          f"(tolerance {ATOL:g} + {RTOL:g}*|ref|), time {elapsed_us:.1f} us")
    if not mask_ok:
        print("FAIL: the CUDA-packed tree mask differs from the CPU one")
    if not finite:
        print(f"FAIL: {int((~torch.isfinite(out64)).sum())} non-finite output values")
    elif not within:
        print("FAIL: output differs from the float64 reference beyond bf16 tolerance")
    ok = finite and within and mask_ok
    if ok:
        print("OK")
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kdtree", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, compiled archs, torch, GPU").set_defaults(func=_info)
    check = sub.add_parser("check", help="run a synthetic verify batch and compare with a float64 reference")
    check.add_argument("--prefix", type=int, nargs="+", default=[1000, 300],
                       help="prefix lengths, cycled over the batch (default: 1000 300)")
    check.add_argument("--heads", type=int, default=16)
    check.add_argument("--tokens", type=int, default=9, help="verify tokens per request (N)")
    check.add_argument("--batch", type=int, default=2)
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--repeat", type=int, default=20, help="timed GPU calls (median reported)")
    check.add_argument("--cpu", action="store_true", help="use the CPU path even when a GPU is present")
    check.set_defaults(func=_check)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
