"""Per-layer cost of SGLang's TritonAttnBackend.forward_extend on a TARGET_VERIFY call, original vs
patched by kdtree (KDTREE_VERIFY=on): the KV save, the mask rebuild, the kernel, all of it.

Run on a GPU machine with SGLang importable (`source .carry/sglang/activate` there):
    python benchmarks/bench_sglang_layer.py --out layer.json
Real backend, pool and layer objects (tests/sglang_harness.py), B=1, by default H=16, N=9, random tree,
a bf16 MLATokenToKVPool of page size 1, shuffled slots in a pool of >= 262,144 slots (302 MB per layer
of bf16, several times L2). The reference deployment's multi-token-prediction verify (GLM-5.x at TP8 on
a DSA pool of 64-token pages, FP8 cache):
    python benchmarks/bench_sglang_layer.py --pool dsa --kv e4m3 --heads 8 --n 4 --mask none

A forward pass of `--pass-layers` layers (ids 0, 1, ...; one metadata object) is also captured in one
CUDA graph, as SGLang's graph runner captures target verify: the first layer packs the mask and plans,
the later ones reuse both. Its replay time per layer is reported with the plan reused (the default)
and with every layer planning for itself, which is what plan reuse saves.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from sglang_harness import build_case, parallel_context  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import kdtree.sglang_patch as patch  # noqa: E402
from bench import KV_DTYPES  # noqa: E402  (the pool dtypes bench.py's --kv names)

POOL_SLOTS = 262_144


def pass_timing(case, layers, fresh_q=False):
    """Per-layer replay time of a captured forward pass of ``layers`` layers, with the plan reused by
    layers 1.. (the patch's default) and with every layer planning for itself. ``fresh_q``: each layer's q
    is first written by a copy kernel (timed with it), as a model's q projection leaves q in L2 right
    before attention; otherwise every layer reads the one q, which the layers' KV streams evict from L2."""
    layer_objs = [case.layer] + [type(case.layer)(case.layer.tp_q_head_num, 576, case.layer.scaling, 1, i,
                                                  v_head_dim=512) for i in range(1, layers)]
    real_pass_for = patch._pass_for
    result, outs = {}, {}
    for key, reuse in (("pass_reuse_us", True), ("pass_noreuse_us", False)):
        if not reuse:
            patch._pass_for = lambda *a: (real_pass_for(*a)[0], False)
        try:
            def run():
                return [case.backend.forward_extend(case.q.clone() if fresh_q else case.q, case.k, case.v, lyr,
                                                    case.forward_batch)
                        for lyr in layer_objs]
            with parallel_context(case.sg):
                run()                                          # eager warm-up (sizes the workspace)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    captured = run()
            g.replay()
            torch.cuda.synchronize()
            outs[key] = torch.stack([o.clone() for o in captured])
            result[key] = do_bench(g.replay, warmup=20, rep=300, return_mode="median") * 1e3 / layers
        finally:
            patch._pass_for = real_pass_for
        del g
    result["pass_equal"] = bool(torch.equal(outs["pass_reuse_us"], outs["pass_noreuse_us"]))
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="layer.json")
    ap.add_argument("--prefixes", default="8192,32768,131072")
    ap.add_argument("--pass-layers", type=int, default=8, help="layers of the captured forward pass (0: none)")
    ap.add_argument("--heads", type=int, default=16, help="query heads on the rank")
    ap.add_argument("--n", type=int, default=9, help="verify tokens of the request")
    ap.add_argument("--mask", choices=("tree", "none"), default="tree",
                    help="a random tree (SGLang's custom mask) or none (a causal chain)")
    ap.add_argument("--pool", choices=("mla", "dsa"), default="mla",
                    help="MLATokenToKVPool (page size 1) or DSATokenToKVPool (64-token pages)")
    ap.add_argument("--kv", choices=sorted(KV_DTYPES), default="bf16", help="the pool's KV dtype")
    ap.add_argument("--fresh-q", action="store_true",
                    help="in the captured pass, a copy kernel writes each layer's q right before its call")
    args = ap.parse_args()
    shape = dict(heads=args.heads, n=args.n, mask=args.mask, pool=args.pool, kv=args.kv)
    rows = []
    for p in [int(x) for x in args.prefixes.split(",")]:
        case = build_case(batch=1, heads=args.heads, n=args.n, prefix_lens=[p], mask=args.mask, device="cuda",
                          seed=p, spare_slots=max(7, POOL_SLOTS - p - args.n), layer_num=max(1, args.pass_layers),
                          pool_kind=args.pool, kv_dtype=KV_DTYPES[args.kv])
        patch.uninstall()
        case.call()
        torch.cuda.synchronize()
        orig_ms = do_bench(case.call, warmup=50, rep=400, return_mode="median")
        ref = case.call().clone()
        patch.install("on", propagate=False)
        out = case.call()
        torch.cuda.synchronize()
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        on_ms = do_bench(case.call, warmup=50, rep=300, return_mode="median")
        g = torch.cuda.CUDAGraph()
        with parallel_context(case.sg):
            with torch.cuda.graph(g):
                case.backend.forward_extend(case.q, case.k, case.v, case.layer, case.forward_batch)
        g.replay()
        torch.cuda.synchronize()
        graph_ms = do_bench(g.replay, warmup=50, rep=300, return_mode="median")
        row = dict(prefix=p, **shape, original_us=orig_ms * 1e3, patched_us=on_ms * 1e3,
                   patched_graph_us=graph_ms * 1e3, speedup=orig_ms / on_ms, rel_err=err)
        if args.pass_layers > 0:
            row.update(pass_timing(case, args.pass_layers, args.fresh_q), fresh_q=args.fresh_q)
        patch.uninstall()
        rows.append(row)
        print(f"forward_extend H{args.heads} N{args.n} {args.mask} {args.pool} {args.kv} P={p:>6}: "
              f"original {row['original_us']:9.1f} us  kdtree on {row['patched_us']:7.1f} us "
              f"(graph replay {row['patched_graph_us']:6.1f})  x{row['speedup']:6.1f}  rel err {err:.1e}", flush=True)
        if args.pass_layers > 0:
            saved = row['pass_noreuse_us'] - row['pass_reuse_us']
            print(f"  pass of {args.pass_layers} layers in one graph, per layer: "
                  f"plan reused {row['pass_reuse_us']:6.1f} us, planned per layer {row['pass_noreuse_us']:6.1f} us "
                  f"(saves {saved:.1f}); "
                  f"outputs equal: {row['pass_equal']}", flush=True)
        del case, g
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
