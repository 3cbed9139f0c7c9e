"""Where the split kernel's warps stall, per SASS instruction (from ncu's source page as CSV).

    ncu --clock-control none --set full --import-source no --kernel-name regex:split --launch-skip 3 \
        --launch-count 1 -o /tmp/split python3 benchmarks/bench.py --no-sglang --only "H16 N9 tree P131072"
    ncu -i /tmp/split.ncu-rep --page source --csv --print-source sass > split_source.csv
    python tools/ncu_source.py split_source.csv [top]
Prints the instructions with the most warp-stall samples, each with its largest stall reasons, then
the samples summed per opcode (HGMMA, SYNCS, BAR, LDGSTS, ...): which instruction the warps wait at,
and for what.
"""
from __future__ import annotations

import csv
import sys
from collections import defaultdict


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(path: str, top: int = 30) -> None:
    with open(path, newline="") as f:
        lines = [line for line in f if line.strip()]
    # ncu may print a banner before the table: the header is the first line naming the source column
    start = next(i for i, line in enumerate(lines) if '"Source"' in line or line.startswith("Source,"))
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        sys.exit(f"{path}: no rows under the CSV header")
    cols = list(rows[0].keys())
    total_col = next((c for c in cols if c.startswith("Warp Stall Sampling (All")), None)
    if total_col is None:
        sys.exit(f"{path}: no 'Warp Stall Sampling (All Samples)' column; columns: {cols}")
    reason_cols = [c for c in cols if c.lower().startswith("stall_") or c.startswith("smsp__pcsamp_warps_issue_stalled")]
    total = sum(number(r[total_col]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} warp-stall samples; stall columns: {len(reason_cols)}")
    print("  " + ", ".join(c for c in reason_cols if "(Not Issued)" not in c))
    ranked = sorted(rows, key=lambda r: -number(r[total_col]))
    for r in ranked[:top]:
        share = number(r[total_col]) / total
        reasons = sorted(((number(r[c]), c) for c in reason_cols), reverse=True)[:3]
        why = ", ".join(f"{c.replace('smsp__pcsamp_warps_issue_stalled_', '')} {v:.0f}" for v, c in reasons if v > 0)
        print(f"{share:6.1%}  {r.get('Address', ''):>8}  {r['Source'][:70]:70}  {why}")
    per_op = defaultdict(float)
    per_op_reason = defaultdict(lambda: defaultdict(float))
    for r in rows:
        op = [t for t in r["Source"].strip().split(" ") if t and not t.startswith("@")]
        name = op[0].split(".")[0] if op else "?"
        if name in ("HGMMA", "WARPGROUP", "SYNCS"):   # keep the shape / kind: which product, arrive or wait
            name = op[0] + (" " + op[1].split(",")[0] if name == "HGMMA" and len(op) > 1 else "")
        per_op[name] += number(r[total_col])
        for c in reason_cols:
            if "(Not Issued)" not in c:
                per_op_reason[name][c] += number(r[c])
    print("samples per opcode, with its largest stall reasons (the samples of the instruction a warp waits to issue):")
    for op, v in sorted(per_op.items(), key=lambda kv: -kv[1])[:18]:
        reasons = sorted(((val, c) for c, val in per_op_reason[op].items()), reverse=True)[:4]
        why = ", ".join(f"{c.replace('smsp__pcsamp_warps_issue_stalled_', '')} {val / total:.1%}" for val, c in reasons if val > 0)
        print(f"  {v / total:6.1%}  {op[:40]:40}  {why}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
