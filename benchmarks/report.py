"""Turn benchmark JSON (benchmarks/bench.py, bench_sglang_layer.py) into the committed Markdown table
and the PNG plot of time against prefix length.

    python benchmarks/report.py benchmarks/results/h200_2026-11-29_wgmma.json \
        [--layer benchmarks/results/h200_2026-11-29_forward_extend.json] \
        [--alt benchmarks/results/h200_2026-11-29.json --alt-label "mma.sync 3-stage us"] --md out.md --png out.png
--alt adds a column of graph-replay times from another run of bench.py (another kernel, another path).
Needs matplotlib only for --png.
"""
import argparse
import json


def table(d, other=None, other_label="2-stage (sm_120 path) us"):
    env = d["env"]
    alt = {r["name"]: r for r in (other["results"] if other else [])}
    per_call = any("split_kernel" in r for r in d["results"])   # the kernel each call ran (bench.py since session 12)
    lines = [
        f"Device: {env['gpu']}, driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, "
        f"triton {env['triton']}, sglang {env['sglang']}, kdtree {env['kdtree']}, {env['date']}"
        + (f", split kernel {env['split_kernel']}" if "split_kernel" in env else "") + ".",
        "",
        "| shape | kdtree us (eager) | kdtree us (graph) | KV GB/s | TFLOP/s | floor us | % of floor "
        "| SGLang Triton us | speed-up | rel. diff vs SGLang | graph, mask reused (per layer) us |"
        + (" split kernel |" if per_call else "") + (f" {other_label} |" if alt else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if per_call else "") + ("---|" if alt else ""),
    ]
    for r in d["results"]:
        t = r["kdtree_graph_us"]
        row = (f"| {r['name']} | {r['kdtree_us']:.1f} | {t:.1f} | {r['kv_bytes'] / t / 1e3:.0f} | "
               f"{r['flops'] / t / 1e6:.1f} | {r['floor_us']:.1f} | {100 * r['floor_us'] / t:.1f} | "
               f"{r.get('sglang_us', float('nan')):.0f} | {r.get('sglang_us', float('nan')) / t:.1f} | "
               f"{r.get('rel_err_vs_sglang', float('nan')):.1e} | {r.get('kdtree_layer_graph_us', float('nan')):.1f} |")
        if per_call:
            row += f" {r.get('split_kernel', '')} |"
        if alt:
            a = alt.get(r["name"])
            row += f" {a['kdtree_graph_us']:.1f} |" if a else " |"
        lines.append(row)
    lines += ["", "GB/s, TFLOP/s, % of floor and speed-up use the graph-replay time (the whole call: mask rebuild, "
              "plan, split, combine), as SGLang runs verify under CUDA graphs; floor = max(KV bytes / 4.23 TB/s, "
              "FLOPs / 773 TFLOP/s) (PERF.md). \"Graph, mask reused\" is the per-layer call of the SGLang "
              "integration, which packs the tree mask once per forward pass: plan, split, combine."]
    return "\n".join(lines)


def layer_table(rows):
    passes = all("pass_reuse_us" in r for r in rows)
    head = ("| prefix | SGLang forward_extend us | patched (KDTREE_VERIFY=on) eager us | patched, graph replay us "
            "| speed-up (graph) | rel. diff |")
    rule = "|---|---|---|---|---|---|"
    if passes:
        head += " captured pass, per layer, plan reused us | same, planned per layer us |"
        rule += "---|---|"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r['prefix']:,} | {r['original_us']:.0f} | {r['patched_us']:.1f} | {r['patched_graph_us']:.1f} "
                f"| {r['original_us'] / r['patched_graph_us']:.1f} | {r['rel_err']:.1e} |")
        if passes:
            line += f" {r['pass_reuse_us']:.1f} | {r['pass_noreuse_us']:.1f} |"
        lines.append(line)
    return "\n".join(lines)


def plot(d, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in d["results"] if r["name"].startswith("H16 N9 tree P") and "contiguous" not in r["name"]]
    rows.sort(key=lambda r: r["prefixes"][0])
    x = [r["prefixes"][0] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kernel = f", {d['env']['split_kernel']}" if "split_kernel" in d["env"] else ""
    ax.plot(x, [r["kdtree_graph_us"] for r in rows], "o-", label=f"kdtree (graph replay{kernel})")
    if all("sglang_us" in r for r in rows):
        ax.plot(x, [r["sglang_us"] for r in rows], "s-", label="SGLang Triton extend_attention_fwd")
    ax.plot(x, [r["floor_us"] for r in rows], "k--", label="floor (4.23 TB/s, 773 TFLOP/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("time per verify call (us)")
    env = d["env"]
    ax.set_title(f"MLA tree verify, B=1, H=16, N=9 - {env['gpu']}, {env['date']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench")
    ap.add_argument("--layer")
    ap.add_argument("--alt", "--sm120", dest="alt", help="another bench.py JSON: one more column")
    ap.add_argument("--alt-label", default="2-stage (sm_120 path) us")
    ap.add_argument("--md")
    ap.add_argument("--png")
    a = ap.parse_args()
    d = json.load(open(a.bench))
    other = json.load(open(a.alt)) if a.alt else None
    text = table(d, other, a.alt_label)
    if a.layer:
        text += "\n\n" + layer_table(json.load(open(a.layer)))
    if a.md:
        open(a.md, "w").write(text + "\n")
    else:
        print(text)
    if a.png:
        plot(d, a.png)


if __name__ == "__main__":
    main()
