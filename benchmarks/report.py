"""The report step: benchmark JSON in, the committed results of one GPU out (docs/results/<gpu>_<date>.json, .md, .png).

    python benchmarks/report.py bench.json --layer layer.json            # a run of bench.py (+ bench_sglang_layer.py)
    python benchmarks/report.py bench.json --alt bench_2stage.json --alt-label "sm_120 code path us"
    python benchmarks/report.py bench_e4m3.json                          # an e4m3 pool: <gpu>_<date>_e4m3.*
    python benchmarks/report.py docs/results/h200_2026-12-03.json        # regenerate the table and plot from it

The JSON written next to the table holds everything the table and plot are made from (bench.py's environment and
records, the layer rows, the extra column), so the last form rebuilds them alone. The name comes from the GPU and the
date of the run (`--name` overrides it); `--out-dir` changes the folder. The plot needs matplotlib; without it the
table and JSON are written and the plot is left as it is.
"""
import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200_CEILINGS = dict(copy_tbps=4.23, matmul_tflops=773)   # docs/performance.md, "The floor"


def _floor_rates(c):
    return f"max(KV bytes / {c['copy_tbps']:.2f} TB/s, FLOPs / {c['matmul_tflops']:.0f} TFLOP/s)"


def floor_note(env):
    """How the run's floors were taken: this GPU's ceilings measured in the run (bench.py), or the H200's."""
    c = env.get("ceilings")
    if not c:
        return (f"floor = {_floor_rates(H200_CEILINGS)}, the H200's measured copy and bf16 matmul rates "
                "(docs/performance.md)")
    note = (f"floor = {_floor_rates(c)}, this GPU's copy (2 GiB device to device, bytes read + written) and cuBLAS "
            "bf16 matmul rates measured at the start of the run")
    if "gather_e4m3_tbps" in c:
        note += (f"; a plain gather of the pool's shuffled rows (torch.index_select, bytes read + written) ran at "
                 f"{c['gather_e4m3_tbps']:.2f} TB/s with 576-byte rows and {c['gather_bf16_tbps']:.2f} with 1,152")
    return note


def floor_label(env):
    c = env.get("ceilings") or H200_CEILINGS
    return f"floor ({c['copy_tbps']:.2f} TB/s, {c['matmul_tflops']:.0f} TFLOP/s)"


def gpu_slug(gpu: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    name = re.sub(r"^nvidia\s+", "", gpu.strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def kv_type(d):
    """The pool's element type of a run: 'bf16' or 'e4m3' (bench.py --kv)."""
    return d["results"][0].get("kv", "bf16") if d["results"] else "bf16"


def table(d):
    env = d["env"]
    alt = d.get("alt")
    per_call = any("split_kernel" in r for r in d["results"])   # the kernel each call ran
    vs_ref = all("rel_err_kdtree" in r for r in d["results"])  # a quantised pool: both against the float reference
    lines = [
        f"Device: {env['gpu']}, driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, "
        f"triton {env['triton']}, sglang {env['sglang']}, kdtree {env['kdtree']}, {env['date']}"
        + (f", split kernel {env['split_kernel']}" if "split_kernel" in env and not per_call else "") + ".",
        "",
        "| shape | kdtree us (eager) | kdtree us (graph) | KV GB/s | TFLOP/s | floor us | % of floor "
        "| SGLang Triton us | speed-up | rel. diff vs SGLang | graph, mask reused (per layer) us |"
        + (" rel. err vs reference, kdtree / SGLang |" if vs_ref else "")
        + (" split kernel |" if per_call else "") + (f" {alt['label']} |" if alt else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if vs_ref else "") + ("---|" if per_call else "")
        + ("---|" if alt else ""),
    ]
    for r in d["results"]:
        t = r["kdtree_graph_us"]
        row = (f"| {r['name']} | {r['kdtree_us']:.1f} | {t:.1f} | {r['kv_bytes'] / t / 1e3:.0f} | "
               f"{r['flops'] / t / 1e6:.1f} | {r['floor_us']:.1f} | {100 * r['floor_us'] / t:.1f} | "
               f"{r.get('sglang_us', float('nan')):.0f} | {r.get('sglang_us', float('nan')) / t:.1f} | "
               f"{r.get('rel_err_vs_sglang', float('nan')):.1e} | {r.get('kdtree_layer_graph_us', float('nan')):.1f} |")
        if vs_ref:
            row += f" {r['rel_err_kdtree']:.1e} / {r['rel_err_sglang']:.1e} |"
        if per_call:
            row += f" {r.get('split_kernel', '')} |"
        if alt:
            a = alt["graph_us"].get(r["name"])
            row += f" {a:.1f} |" if a is not None else " |"
        lines.append(row)
    lines += ["", "GB/s, TFLOP/s, % of floor and speed-up use the graph-replay time (the whole call: mask, plan, split, "
              f"combine), as SGLang runs verify under CUDA graphs; {floor_note(env)}. \"Graph, mask reused\" is the "
              "per-layer call of the SGLang integration, which packs the tree mask once per forward pass: plan, split, "
              "combine."]
    if vs_ref:
        lines += ["", "On an e4m3 pool both outputs are compared with a float32 reference on the dequantised pool "
                  "(relative L2); \"rel. diff vs SGLang\" is then mostly SGLang's own fp8 rounding."]
    return "\n".join(lines)


def layer_call(r):
    """A bench_sglang_layer.py row's call: H16 N9 tree (or chain) P131,072, and the pool and KV dtype where not
    SGLang's default MLA pool of bf16 (rows written before those keys existed are H16 N9 tree calls on it)."""
    mask = "chain" if r.get("mask", "tree") == "none" else "tree"   # (none: no custom mask, a causal chain)
    call = f"H{r.get('heads', 16)} N{r.get('n', 9)} {mask} P{r['prefix']:,}"
    pool, kv = r.get("pool", "mla"), r.get("kv", "bf16")
    return call + ("" if pool == "mla" else f" {pool} pool") + ("" if kv == "bf16" else f" {kv}")


def layer_table(rows):
    passes = all("pass_reuse_us" in r for r in rows)
    head = ("| call | SGLang forward_extend us | patched (KDTREE_VERIFY=on) eager us | patched, graph replay us "
            "| speed-up (graph) | rel. diff |")
    rule = "|---|---|---|---|---|---|"
    if passes:
        head += " captured pass, per layer, plan reused us | same, planned per layer us |"
        rule += "---|---|"
    lines = [head, rule]
    for r in rows:
        line = (f"| {layer_call(r)} | {r['original_us']:.0f} | {r['patched_us']:.1f} | {r['patched_graph_us']:.1f} "
                f"| {r['original_us'] / r['patched_graph_us']:.1f} | {r['rel_err']:.1e} |")
        if passes:
            line += f" {r['pass_reuse_us']:.1f} | {r['pass_noreuse_us']:.1f} |"
        lines.append(line)
    return "\n".join(lines)


def document(d, name):
    env = d["env"]
    parts = [
        f"# kdtree on the {env['gpu']}, {env['date']}",
        "",
        "Written by `benchmarks/report.py` from `" + name + ".json` (`benchmarks/bench.py`, "
        "`benchmarks/bench_sglang_layer.py`). B=1, H=16, N=9, random tree, " + kv_type(d)
        + " KV with page size 1 and shuffled slots "
        "in a 302 MB pool unless the shape says otherwise; CUDA-event medians; SGLang's Triton `extend_attention_fwd` "
        "on the same inputs in the same process.",
        "",
        "## Every shape",
        "",
        table(d),
    ]
    if d.get("layer"):
        parts += ["", "## The patched SGLang layer (`TritonAttnBackend.forward_extend`, KV save included)", "",
                  layer_table(d["layer"])]
    parts += ["", f"Plot: `{name}.png` (time against prefix length at H=16, N=9: kdtree, SGLang Triton and the floor)."]
    return "\n".join(parts) + "\n"


def plot(d, path):
    try:
        import matplotlib
    except ImportError:
        print(f"report.py: no matplotlib, {path} not written", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in d["results"] if r["name"].startswith("H16 N9 tree P") and "contiguous" not in r["name"]]
    rows.sort(key=lambda r: r["prefixes"][0])
    x = [r["prefixes"][0] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kernels = sorted({r["split_kernel"] for r in rows if "split_kernel" in r}) or [d["env"].get("split_kernel")]
    kernel = f", {' / '.join(kernels)}" if kernels != [None] else ""
    ax.plot(x, [r["kdtree_graph_us"] for r in rows], "o-", label=f"kdtree (graph replay{kernel})")
    if all("sglang_us" in r for r in rows):
        ax.plot(x, [r["sglang_us"] for r in rows], "s-", label="SGLang Triton extend_attention_fwd")
    ax.plot(x, [r["floor_us"] for r in rows], "k--", label=floor_label(d["env"]))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("time per verify call (us)")
    env = d["env"]
    ax.set_title(f"MLA tree verify, B=1, H=16, N=9, {kv_type(d)} KV - {env['gpu']}, {env['date']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench", help="bench.py's JSON, or a JSON this script wrote")
    ap.add_argument("--layer", help="bench_sglang_layer.py's JSON")
    ap.add_argument("--alt", help="another bench.py JSON (another kernel or code path): one more column")
    ap.add_argument("--alt-label", default="sm_120 code path us")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "docs", "results"))
    ap.add_argument("--name", help="file name without extension (default: <gpu>_<date>, "
                    "<gpu>_<date>_<kv> for a quantised pool)")
    a = ap.parse_args()
    with open(a.bench) as f:
        d = json.load(f)
    if a.layer:
        with open(a.layer) as f:
            d["layer"] = json.load(f)
    if a.alt:
        with open(a.alt) as f:
            other = json.load(f)
        d["alt"] = dict(label=a.alt_label, graph_us={r["name"]: r["kdtree_graph_us"] for r in other["results"]})
    kv = kv_type(d)
    name = a.name or f"{gpu_slug(d['env']['gpu'])}_{d['env']['date']}" + ("" if kv == "bf16" else f"_{kv}")
    os.makedirs(a.out_dir, exist_ok=True)
    base = os.path.join(a.out_dir, name)
    if os.path.abspath(a.bench) != os.path.abspath(base + ".json") or a.layer or a.alt:
        with open(base + ".json", "w") as f:
            json.dump(d, f, indent=1)
            f.write("\n")
    with open(base + ".md", "w") as f:
        f.write(document(d, name))
    wrote = plot(d, base + ".png")
    print(f"report.py: {base}.json, .md" + (", .png" if wrote else ""))


if __name__ == "__main__":
    main()
