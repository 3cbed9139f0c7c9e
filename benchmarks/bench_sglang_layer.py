"""Per-layer cost of SGLang's TritonAttnBackend.forward_extend on a TARGET_VERIFY call, original vs
patched by kdtree (KDTREE_VERIFY=on): the KV save, the mask rebuild, the kernel, all of it.

Run on a GPU machine with SGLang importable (`source .carry/sglang/activate` there):
    python benchmarks/bench_sglang_layer.py --out layer.json
Real backend, pool and layer objects (tests/sglang_harness.py), B=1, H=16, N=9, random tree,
page size 1, shuffled slots in a pool of >= 262,144 slots (302 MB, several times L2).
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

POOL_SLOTS = 262_144


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="layer.json")
    ap.add_argument("--prefixes", default="8192,32768,131072")
    args = ap.parse_args()
    rows = []
    for p in [int(x) for x in args.prefixes.split(",")]:
        case = build_case(batch=1, heads=16, n=9, prefix_lens=[p], mask="tree", device="cuda", seed=p,
                          spare_slots=max(7, POOL_SLOTS - p - 9))
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
        patch.uninstall()
        row = dict(prefix=p, heads=16, n=9, original_us=orig_ms * 1e3, patched_us=on_ms * 1e3,
                   patched_graph_us=graph_ms * 1e3, speedup=orig_ms / on_ms, rel_err=err)
        rows.append(row)
        print(f"forward_extend P={p:>6}: original {row['original_us']:9.1f} us  kdtree on {row['patched_us']:7.1f} us "
              f"(graph replay {row['patched_graph_us']:6.1f})  x{row['speedup']:6.1f}  rel err {err:.1e}", flush=True)
        del case, g
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
