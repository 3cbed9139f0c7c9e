"""Host time of one patched TritonAttnBackend.forward_extend call (KDTREE_VERIFY=on, eager), and
where it goes: what an eager step (no CUDA graph) pays per layer on top of the GPU work.

Run on a GPU machine with SGLang importable (`source .carry/sglang/activate` there):
    python tools/layer_host.py [--prefix 8192] [--calls 300]
Prints the host microseconds per call of the whole patched call, of the original's and of each
stage of the patched path (timed alone, same inputs), then the functions with the most host time
(cProfile, own time) over the patched calls.
"""
import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from sglang_harness import build_case, parallel_context  # noqa: E402

import kdtree.sglang_patch as patch  # noqa: E402
from kdtree import layout, ops  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, calls=300):
    """(host microseconds per call: the loop's wall time with no synchronisation inside it, microseconds per call
    until the GPU is done with the loop's work), after min(20, calls) warm-up calls."""
    for _ in range(min(20, calls)):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (the reference path)")
    args = ap.parse_args()
    case = build_case(batch=1, heads=16, n=9, prefix_lens=[args.prefix], mask="tree", device=args.device, seed=1)
    b, md, layer, fb = case.backend, case.backend.forward_metadata, case.layer, case.forward_batch
    T = case.q.shape[0]
    H = layer.tp_q_head_num
    q3 = case.q.view(T, H, 576)
    q_nope, q_pe = layout.split_mla_q(q3)
    k2 = case.k.select(1, 0) if case.k.dim() == 3 else case.k
    kv = layout.kv_cache_2d(b.token_to_kv_pool.get_key_buffer(layer.layer_id))
    out3 = torch.empty(T, H, 512, dtype=torch.bfloat16, device=args.device)
    mask = layout.build_tree_mask(md.custom_mask, md.mask_indptr, md.qo_indptr, md.kv_indptr, T, md.max_extend_len)

    def in_context(fn):
        """fn under the parallel context the harness (and SGLang's ModelRunner) sets for the call."""
        def run():
            with parallel_context(case.sg):
                return fn()
        return run

    patch.uninstall()
    stages = {"original forward_extend (whole call)": case.call}
    patch.install("on", propagate=False)
    stages.update({
        "patched forward_extend (whole call)": case.call,
        "  gate": lambda: patch._gate(b, case.q, case.k, case.v, layer, fb, {}, False),
        "  save KV (SGLang set_kv_buffer)": in_context(lambda: patch._save_kv(b, layer, fb, case.k, case.v)),
        "  build_tree_mask": lambda: layout.build_tree_mask(md.custom_mask, md.mask_indptr, md.qo_indptr,
                                                            md.kv_indptr, T, md.max_extend_len),
        "  verify_attention": lambda: ops.verify_attention(q_nope, q_pe, kv, md.kv_indptr, md.kv_indices,
                                                           md.qo_indptr, k2, mask, layer.scaling, out=out3),
    })
    print(f"host time per call, B=1 H=16 N=9 P={args.prefix} ({args.calls} calls each; 'with sync' = until the "
          f"GPU is done)")
    for name, fn in stages.items():
        h, s = host_us(fn, args.calls)
        print(f"  {name:<40} host {h:8.1f} us   with sync {s:8.1f} us", flush=True)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        case.call()
    prof.disable()
    sync()
    print(f"cProfile of {args.calls} patched calls (own time, top 20):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    patch.uninstall()


if __name__ == "__main__":
    main()
