"""kdtree vs SGLang's Triton extend kernel on the benchmark's shape set, in one process, on the same inputs.

Run on a GPU machine (SGLang importable; on the device machine `source .carry/sglang/activate` first):
    python benchmarks/bench.py --out bench.json [--quick] [--no-sglang] [--small-rows] [--kv e4m3]
Writes one JSON record per shape; benchmarks/report.py turns it into docs/results/<gpu>_<date>.md and .png.

Conventions (docs/performance.md): CUDA-event medians after warm-up (triton.testing.do_bench), the whole kdtree
call timed (mask packing + plan + split + combine), a pool several times larger than L2 with shuffled
slots, random data, floors from this GPU's ceilings measured at the start of the run (measure_ceilings).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import kdtree  # noqa: E402
from kdtree import _ext  # noqa: E402
from kdtree.layout import build_tree_mask, kv_cache_2d, split_mla_q  # noqa: E402
from kdtree.synthetic import make_verify_batch  # noqa: E402

# The H200's ceilings (docs/performance.md, "The floor"): the floors of a run that does not measure its own
MEM_BW = 4.23e12        # B/s, a 2 GiB device-to-device copy, bytes read + written
MMA_WGMMA = 773e12      # FLOP/s, a cuBLAS bf16 matmul (the floor's compute rate)
MMA_SYNC = 640e12       # FLOP/s, an mma.sync m16n8k16 register-only loop (not measured by this script: the H100 and
                        # H200 have the same SMs and clocks)
BYTES_PER_KEY = {"bf16": 576 * 2, "e4m3": 576}
KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
FLOP_PER_ROW_KEY = 2 * (576 + 512)
MIN_POOL_SLOTS = 262_144  # 302 MB of bf16 latent rows: several times the 50-60 MB L2


def shapes(quick: bool, small_rows: bool = False):
    rows = []
    for p in [8192, 32768, 131072, 185000]:
        rows.append(dict(name=f"H16 N9 tree P{p}", prefixes=[p], heads=16, n=9))
    for n, none in [(1, False), (16, True), (33, False), (65, False)]:
        rows.append(dict(name=f"H16 N{n} {'chain(None)' if none else 'tree'} P131072", prefixes=[131072],
                         heads=16, n=n, causal_none=none, pad=4 if n == 33 else 0))
    # multi-token-prediction chains as the README's deployments draft them (EAGLE top-k 1, 4 draft tokens): GLM-5.x at
    # TP8 has 8 heads a rank (32 rows), DeepSeek-V3 16 (64 rows)
    for h in (8, 16):
        rows.append(dict(name=f"H{h} N4 chain(None) P131072", prefixes=[131072], heads=h, n=4, causal_none=True))
    for h, p in [(8, 131072), (32, 131072), (128, 32768)]:
        rows.append(dict(name=f"H{h} N9 tree P{p}", prefixes=[p], heads=h, n=9))
    rag = [4096, 65536, 12288, 40960, 8192, 57344, 20480, 32768]
    rows.append(dict(name="B8 ragged 4k..64k H16 N9", prefixes=rag, heads=16, n=9))
    rows.append(dict(name="H16 N9 tree P131072 contiguous", prefixes=[131072], heads=16, n=9, shuffle=False))
    if quick:
        rows = [r for r in rows if r["name"] in ("H16 N9 tree P8192", "H16 N9 tree P131072", "H16 N1 tree P131072")]
    if small_rows:   # requests of <= 32 rows (the skinny kernels' calls on sm_90a) beyond the table's H16 N1 and H8 N4
        for h, n, p in [(16, 1, 8192), (16, 1, 32768), (16, 1, 185000), (8, 2, 131072), (1, 9, 131072),
                        (16, 2, 131072), (6, 3, 131072)]:
            rows.append(dict(name=f"H{h} N{n} tree P{p}", prefixes=[p], heads=h, n=n))
        for p in [8192, 32768]:
            rows.append(dict(name=f"H8 N4 chain(None) P{p}", prefixes=[p], heads=8, n=4, causal_none=True))
        # batches of such requests (SGLang's verify of several requests, each with few drafts)
        rows.append(dict(name="B8 ragged 4k..64k H8 N2", prefixes=rag, heads=8, n=2))
        rows.append(dict(name="B8 ragged 4k..64k H8 N4 chain(None)", prefixes=rag, heads=8, n=4, causal_none=True))
        # whether the gather's slot order binds a memory-bound call
        rows.append(dict(name="H16 N1 tree P131072 contiguous", prefixes=[131072], heads=16, n=1, shuffle=False))
        # a DSA model's pool (GLM-5.x, DeepSeek-V3.2): 64-token pages in random order
        rows.append(dict(name="H16 N1 tree P131072 page64", prefixes=[131072], heads=16, n=1, page_size=64))
        rows.append(dict(name="H8 N4 chain(None) P131072 page64", prefixes=[131072], heads=8, n=4, causal_none=True,
                         page_size=64))
    return rows


def floors(prefixes, heads, n, kv="bf16", mem_bw=MEM_BW, mma=MMA_WGMMA):
    """Bytes, FLOPs and the floors at the given ceilings (B/s, FLOP/s; the H200's by default). An e4m3 pool moves half
    the bytes; its FLOPs are bounded here at the bf16 matrix rate, so its floor is a lower bound only where bytes
    bind."""
    keys = sum(p + n for p in prefixes)
    rows = heads * n
    byts = keys * BYTES_PER_KEY[kv]
    flops = FLOP_PER_ROW_KEY * rows * keys
    return byts, flops, max(byts / mem_bw, flops / mma), max(byts / mem_bw, flops / MMA_SYNC)


def measure_ceilings(rep_ms=200, warmup_ms=300):
    """This GPU's ceilings, measured as the H200's were (docs/performance.md): a 2 GiB bf16 device-to-device copy
    (bytes read + written, the floor's memory rate), a cuBLAS bf16 8192^3 matmul (its compute rate); and, not a
    ceiling but the rate a plain gather gets from the benchmark's pool, torch.index_select of 131,072 shuffled rows
    of 576 and 1,152 bytes (one e4m3 / bf16 key) as 16-byte elements, bytes read + written. Each after 300 ms of
    warm-up: with 25 ms, two processes in a row on one H100 measured the matmul at 702 and 777 TFLOP/s."""
    from triton.testing import do_bench

    def med_s(fn):
        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_bps = 2 * src.numel() * src.element_size() / med_s(lambda: dst.copy_(src))
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_flops = 2 * 8192 ** 3 / med_s(lambda: a @ b)
    del a, b
    ceil = dict(copy_tbps=copy_bps / 1e12, matmul_tflops=mm_flops / 1e12)
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randperm(MIN_POOL_SLOTS, generator=g)[:131072].cuda()
    for kv, row in BYTES_PER_KEY.items():
        pool = torch.zeros(MIN_POOL_SLOTS, row // 16, dtype=torch.complex128, device="cuda")
        out = torch.empty(idx.numel(), row // 16, dtype=torch.complex128, device="cuda")
        t = med_s(lambda: torch.index_select(pool, 0, idx, out=out))
        ceil[f"gather_{kv}_tbps"] = 2 * idx.numel() * row / t / 1e12
        del pool, out
    torch.cuda.empty_cache()
    return ceil


def bench_ms(fn, rep_ms):
    from triton.testing import do_bench
    return do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")


def sglang_extend():
    try:
        from sglang_env import import_sglang  # tests/sglang_env.py
        return import_sglang().extend_attention_fwd
    except BaseException as e:  # noqa: BLE001 - pytest.skip raises a BaseException; run without it
        print(f"[bench] SGLang Triton baseline unavailable: {e!r}", file=sys.stderr)
        return None


def verify_call(prefixes, heads, n, seed, separate_mask=False, kv="bf16", **batch_kw):
    """A benchmark batch on the GPU and the timed calls on it: (batch, out, kd, layer). kd() is the whole verify
    call: kdtree.verify_attention into out, packing SGLang's custom_mask in its plan kernel, as kdtree.sglang_patch
    does on a pass's first layer (separate_mask: kdtree.build_tree_mask's pack kernel first, then the call);
    layer() is the per-layer call of the SGLang integration, which packs the mask once per forward pass
    (kdtree.sglang_patch reuses it for every later layer): plan, split and combine on a mask packed here."""
    b = make_verify_batch(prefixes, heads, n, kind="tree", device="cuda", seed=seed,
                          min_pool_slots=MIN_POOL_SLOTS, poison=False, kv_dtype=KV_DTYPES[kv], **batch_kw)
    t, h = b.q.shape[:2]
    q_nope, q_pe = split_mla_q(b.q)
    pool = kv_cache_2d(b.kv_buffer)
    out = torch.empty(t, h, 512, dtype=torch.bfloat16, device="cuda")

    def mask():
        return build_tree_mask(b.custom_mask, b.mask_indptr, b.qo_indptr, b.kv_indptr, t, b.max_n)

    def attend(tree, **pack):
        kdtree.verify_attention(q_nope, q_pe, pool, b.kv_indptr, b.kv_indices, b.qo_indptr, b.k[:, 0], tree,
                                b.sm_scale, out=out, **pack)

    tree = mask()
    if separate_mask or tree is None:
        return b, out, lambda: attend(mask()), lambda: attend(tree)
    packed = torch.empty_like(tree)
    return b, out, lambda: attend(packed, custom_mask=b.custom_mask, mask_indptr=b.mask_indptr), lambda: attend(tree)


def graph_bench_ms(fn, rep_ms=300):
    """fn() captured in a CUDA graph, replayed: its GPU time without Python launch cost."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    return bench_ms(g.replay, rep_ms)


def batch_kwargs(s):
    """The make_verify_batch arguments a shape of shapes() sets, with their defaults where it does not."""
    return dict(pad=s.get("pad", 0), causal_none=s.get("causal_none", False), shuffle=s.get("shuffle", True),
                page_size=s.get("page_size", 1))


def run_shape(s, extend_fwd, seed, separate_mask=False, kv="bf16", ceil=None):
    bk = batch_kwargs(s)
    b, out, kd, layer = verify_call(s["prefixes"], s["heads"], s["n"], seed, separate_mask=separate_mask, kv=kv, **bk)
    t, h = b.q.shape[:2]
    kd()
    torch.cuda.synchronize()
    kd_ms = bench_ms(kd, 300)
    # the same call captured in a CUDA graph (as SGLang runs verify): GPU time without Python launch cost
    graph_ms = graph_bench_ms(kd)
    layer_ms = graph_bench_ms(layer)
    rec = dict(name=s["name"], batch=len(s["prefixes"]), heads=h, n=s["n"], prefixes=s["prefixes"],
               kv=kv, split_kernel=_ext.load().split_kernel(len(s["prefixes"]), t, h, kdtree.ops.KV_DTYPES[KV_DTYPES[kv]]),
               shuffled=bk["shuffle"], page_size=bk["page_size"],
               mask_packed="separately" if separate_mask else "in the call",
               kdtree_us=kd_ms * 1e3, kdtree_graph_us=graph_ms * 1e3,
               kdtree_layer_graph_us=layer_ms * 1e3)
    rates = dict(mem_bw=ceil["copy_tbps"] * 1e12, mma=ceil["matmul_tflops"] * 1e12) if ceil else {}
    byts, flops, floor, floor_sync = floors(s["prefixes"], h, s["n"], kv, **rates)
    rec.update(kv_bytes=byts, flops=flops, floor_us=floor * 1e6, floor_mma_sync_us=floor_sync * 1e6,
               kdtree_gbps=byts / (kd_ms * 1e-3) / 1e9, kdtree_tflops=flops / (kd_ms * 1e-3) / 1e12,
               pct_floor=100 * floor / (kd_ms * 1e-3))
    if extend_fwd is not None:
        o = torch.empty(t, h, 512, dtype=torch.bfloat16, device="cuda")
        kb = b.kv_buffer
        vb = kb[..., :512]
        qo = b.qo_indptr
        mask = b.custom_mask

        def tri():
            extend_fwd(b.q, b.k, b.k[..., :512], o, kb, vb, qo, b.kv_indptr, b.kv_indices, mask, True,
                       b.mask_indptr, b.max_n, 1.0, 1.0, sm_scale=b.sm_scale)

        tri()
        torch.cuda.synchronize()
        tri_ms = bench_ms(tri, 400)
        rec["sglang_us"] = tri_ms * 1e3
        rec["speedup"] = tri_ms / kd_ms
        kd()
        torch.cuda.synchronize()
        diff = (out.float() - o.float()).norm() / o.float().norm()
        rec["rel_err_vs_sglang"] = diff.item()
        if kv != "bf16":   # both against the float32 reference on the dequantised pool (kdtree's must not exceed)
            from kdtree.reference import verify_attention_reference
            args = b.verify_args()
            ref = verify_attention_reference(**args).float()
            rec["rel_err_kdtree"] = ((out.float() - ref).norm() / ref.norm()).item()
            rec["rel_err_sglang"] = ((o.float() - ref).norm() / ref.norm()).item()
            del ref, args
    del b
    torch.cuda.empty_cache()
    return rec


def environment():
    import triton
    env = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, cuda=torch.version.cuda, python=platform.python_version(),
               kdtree=kdtree.__version__)
    env["split_kernel"] = _ext.load().split_kernel()
    try:
        import subprocess
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        env["driver"] = "unknown"
    try:
        import importlib.metadata as md
        env["sglang"] = md.version("sglang")
    except Exception:  # noqa: BLE001
        try:
            import sglang
            env["sglang"] = getattr(sglang, "__version__", "0.5.23 (device bundle)")
        except Exception:  # noqa: BLE001
            env["sglang"] = "not importable"
    return env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated substrings: keep shapes whose name has one")
    ap.add_argument("--small-rows", action="store_true", help="add shapes of <= 32 rows per request")
    ap.add_argument("--separate-mask", action="store_true",
                    help="the whole call packs the mask with build_tree_mask's kernel first")
    ap.add_argument("--kv", choices=sorted(KV_DTYPES), default="bf16", help="the pool's element type")
    ap.add_argument("--h200-ceilings", action="store_true",
                    help="floors at the H200's ceilings instead of this GPU's, measured at the start")
    args = ap.parse_args()
    extend_fwd = None if args.no_sglang else sglang_extend()
    env = environment()
    print(f"[bench] {env['gpu']}, split kernel {env['split_kernel']}", file=sys.stderr)
    ceil = None
    if not args.h200_ceilings:
        ceil = env["ceilings"] = measure_ceilings()
        print("[bench] ceilings: " + ", ".join(f"{k} {v:.3g}" for k, v in ceil.items()), file=sys.stderr)
    recs = []
    for i, s in enumerate(shapes(args.quick, args.small_rows)):
        if args.only and not any(o and o in s["name"] for o in args.only.split(",")):
            continue
        rec = run_shape(s, extend_fwd, seed=100 + i, separate_mask=args.separate_mask, kv=args.kv, ceil=ceil)
        recs.append(rec)
        print(f"{rec['name']:<34} kdtree {rec['kdtree_us']:8.1f} us (graph {rec['kdtree_graph_us']:8.1f}, "
              f"layer {rec['kdtree_layer_graph_us']:7.1f})  floor {rec['floor_us']:7.1f} us "
              f"({rec['pct_floor']:5.1f}%)  {rec['kdtree_gbps']:7.0f} GB/s {rec['kdtree_tflops']:6.1f} TF/s"
              + (f"  sglang {rec['sglang_us']:9.1f} us  x{rec['speedup']:6.1f}  err {rec['rel_err_vs_sglang']:.1e}"
                 if "sglang_us" in rec else "")
              + (f"  vs ref: kdtree {rec['rel_err_kdtree']:.2e} sglang {rec['rel_err_sglang']:.2e}"
                 if "rel_err_kdtree" in rec else ""), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(env=env, results=recs), f, indent=1)


if __name__ == "__main__":
    main()
