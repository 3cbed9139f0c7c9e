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
from typing import List, Optional

import torch

from . import __version__, _ext
from .layout import build_tree_mask, kv_cache_2d, split_mla_q
from .ops import verify_attention
from .reference import verify_attention_reference
from .synthetic import make_verify_batch

# bf16-level agreement: |out - ref| <= ATOL + RTOL * |ref| elementwise
ATOL = 1e-2
RTOL = 1e-2
SM_SCALE = 0.1147   # a DeepSeek-V3-like layer.scaling (192**-0.5 times a yarn mscale)


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
        try:
            print(f"split kernel on GPU {torch.cuda.current_device()}: {_ext.load().split_kernel()}")
        except (ImportError, RuntimeError) as exc:
            print(f"split kernel: not available ({exc})")
    else:
        print("GPU: no GPU")
    return 0


def _check(args) -> int:
    if args.tokens < 1 or args.heads < 1 or args.batch < 1:
        print("check: --tokens, --heads and --batch must be >= 1", file=sys.stderr)
        return 2
    prefixes = [args.prefix[b % len(args.prefix)] for b in range(args.batch)]
    batch = make_verify_batch(prefixes, args.heads, args.tokens, kind="tree", pad=min(2, args.tokens - 1),
                              seed=args.seed, pool_factor=4, graph_tails=True, sm_scale=SM_SCALE)
    q_nope, q_pe = split_mla_q(batch.q)
    kv_cache = kv_cache_2d(batch.kv_buffer)
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
        print(f"path: CUDA kernel ({_ext.load().split_kernel()}) on {torch.cuda.get_device_name(dev)}")
        g = {name: getattr(batch, name).to(dev) for name in
             ("q", "kv_buffer", "k", "qo_indptr", "kv_indptr", "kv_indices", "custom_mask", "mask_indptr")}
        tree = build_tree_mask(g["custom_mask"], g["mask_indptr"], g["qo_indptr"], g["kv_indptr"],
                               batch.num_tokens, batch.max_n)
        mask_ok = torch.equal(tree.cpu(), tree_cpu)
        gq_nope, gq_pe = split_mla_q(g["q"])
        call_args = (gq_nope, gq_pe, kv_cache_2d(g["kv_buffer"]), g["kv_indptr"], g["kv_indices"],
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
