"""Per-tile summary of the dual kernel's TRACE stamps: what tools/trace_case.py printed, read from its log.

    python tools/trace_summary.py trace.log [--repeat 1] [--first 4]

For block 0's first item in the chosen repeat of the call (the last one by default), over its recorded tiles from
--first on (the ring's first tiles start cold), in SM clocks (medians; stamp numbers as in verify_dual.cuh's
KDTREE_DTRACE):
- period: the time between a score warpgroup's P published (3) for tile t and for tile t + 2, halved;
- value work: the value warpgroup's tile, from P ready or its own loop top (4), whichever is later, to its release (7);
- value waits for P: the tiles whose P was published after the value side reached them, and how long those waited;
- P after its buffer: from the later of the score side's m wait (2) and the value side's release of tile t - 2 (7,
  which frees this warpgroup's P buffer) to P published (3);
- S: from S issued (8) to S done (1), with whatever the form issues between (the FP8 form's tile copies, when they
  follow S).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys

_TILE = re.compile(r"TRACE block 0 item 0 it\s+(\d+) \|(.*)")


def tiles_of(text: str, repeat: int | None = None) -> dict[int, list[int]]:
    """The stamps of block 0's first item, tile -> 16 values, from one repeat of trace_case.py's output."""
    parts = re.split(r"^=== repeat (\d+).*$", text, flags=re.M)
    # re.split with a group: [before, n0, body0, n1, body1, ...]
    bodies = {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    if not bodies:
        raise ValueError("no '=== repeat N' line: not a tools/trace_case.py log")
    body = bodies[max(bodies) if repeat is None else repeat]
    out = {}
    for line in body.splitlines():
        m = _TILE.match(line)
        if m:
            stamps = [int(x) for x in re.findall(r"-?\d+", m.group(2))]
            if len(stamps) != 16:
                raise ValueError(f"tile line with {len(stamps)} stamps, not 16: {line!r}")
            out[int(m.group(1))] = stamps
    return out


def summarise(tiles: dict[int, list[int]], first: int = 4) -> dict[str, float]:
    ts = [t for t in sorted(tiles) if t >= first and t - 2 in tiles]
    if len(ts) < 3:
        raise ValueError(f"too few tiles from {first} on: {sorted(tiles)}")
    st = tiles   # st[t][e]: stamp e of tile t
    period = [(st[t + 2][3] - st[t][3]) / 2 for t in ts if t + 2 in st]
    value = [st[t][7] - max(st[t][4], st[t][3]) for t in ts]
    waits = [st[t][3] - st[t][4] for t in ts if st[t][3] > st[t][4]]
    p_after = [st[t][3] - max(st[t][2], st[t - 2][7]) for t in ts]
    s = [st[t][1] - st[t][8] for t in ts]
    return {"tiles": len(ts), "period": statistics.median(period), "value_work": statistics.median(value),
            "value_waits": len(waits), "value_wait": statistics.median(waits) if waits else 0.0,
            "p_after_buffer": statistics.median(p_after), "s": statistics.median(s)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--repeat", type=int, default=None, help="which of trace_case.py's repeats (default: the last)")
    ap.add_argument("--first", type=int, default=4, help="the first tile counted")
    args = ap.parse_args(argv)
    with open(args.log) as f:
        r = summarise(tiles_of(f.read(), args.repeat), args.first)
    print(f"tiles {r['tiles']} from {args.first} | period {r['period']:.0f} | value work {r['value_work']:.0f} | "
          f"value waits for P on {r['value_waits']} tiles ({r['value_wait']:.0f} each) | P after its buffer "
          f"{r['p_after_buffer']:.0f} | S {r['s']:.0f}  (SM clocks, medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
