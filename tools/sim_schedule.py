"""How the split kernel's persistent blocks take work items (a model), and the split rule's Python mirror (no GPU).

    python tools/sim_schedule.py [--per-tile-us 1.67] [--start-us 5] [--chained-start-us 1]
    python tools/sim_schedule.py --shapes     # the split rule with and without its balance on the uneven shapes

`split_shape` is src/cuda/verify_split_rule.h line for line; tests/test_split_rule.py compiles the header for the host
and checks the two against each other and against this model. The default mode builds the plan of benchmarks/bench.py's
B8 ragged batch (H16 N9, 64-row items, 32-key tiles, 132 SMs) and plays the items through 132 blocks, each item
costing a start-up plus its tiles x a per-tile time. It prints the makespan for (a) claim-at-end (a block claims its
next item when it finishes one, item i first on block i: what the kernels do), (b) claim-ahead with chained items (a
block claims its next item when it starts one, and the next item's start costs less), (c) like (b) with the items
numbered longest first and (d) chained items claimed a few tiles before the running item ends. The model is
optimistic about chaining: (c) predicts -7% against (a) at B8, a chained kernel measured -1.4% on the H200.
"""
import argparse
import heapq

RAGGED = [4096, 65536, 12288, 40960, 8192, 57344, 20480, 32768]   # bench.py's "B8 ragged 4k..64k"


ITEM_TILES = 4   # the split rule's item cost in tiles (verify_split_rule.h, KDTREE_PLAN_ITEM_TILES)


def ceil_div(a, b):
    return -(-a // b)


def split_shape(length, mtiles, blocks, tile_n=32, min_chunk=256, balance=True, item_tiles=ITEM_TILES):
    """(nsplit, chunk) of one request: src/cuda/verify_split_rule.h's split_shape, line for line."""
    nsplit = max(1, min(ceil_div(length, min_chunk), max(1, blocks // mtiles))) if mtiles > 0 else 1
    chunk = max(tile_n, ceil_div(ceil_div(length, nsplit), tile_n) * tile_n)
    nsplit = ceil_div(length, chunk) if length > 0 else 1
    idle = blocks - nsplit * mtiles
    if balance and mtiles >= 2 and chunk > min_chunk and idle > 0:
        e, tiles = item_tiles, ceil_div(length, tile_n)
        r = ceil_div(mtiles, idle)
        c = max(ceil_div(r * tiles + (r - 1) * e, 1 + r * nsplit), min_chunk // tile_n)
        if c * nsplit < tiles:
            s = tiles - c * nsplit
            if max(c + e, r * (s + e)) < chunk // tile_n + e:
                chunk = c * tile_n
                nsplit = ceil_div(length, chunk)
    return nsplit, chunk


def request_items(p, n=9, heads=16, block_m=64, tile_n=32, sms=132, min_chunk=256, balance=False):
    """Tiles of each work item of one request, split-major as the split kernels number them (item_ctx)."""
    length, rows = p + n, n * heads
    mtiles = ceil_div(rows, block_m)
    nsplit, chunk = split_shape(length, mtiles, sms, tile_n, min_chunk, balance)
    items = []
    for s in range(nsplit):
        k0, k1 = s * chunk, min(length, (s + 1) * chunk)
        items += [(k1 - k0 + tile_n - 1) // tile_n] * mtiles
    return items


def claim_at_end(items, sms, per_tile, start):
    events = [(start + items[b] * per_tile, b) for b in range(min(sms, len(items)))]
    heapq.heapify(events)
    nxt, end = sms, 0.0
    while events:
        t, b = heapq.heappop(events)
        end = max(end, t)
        if nxt < len(items):
            heapq.heappush(events, (t + start + items[nxt] * per_tile, b))
            nxt += 1
    return end


def claim_ahead(items, sms, per_tile, start_first, start_chained):
    events, held, nxt, end = [], {}, min(sms, len(items)), 0.0
    for b in range(min(sms, len(items))):
        heapq.heappush(events, (start_first + items[b] * per_tile, b))
        if nxt < len(items):
            held[b], nxt = items[nxt], nxt + 1
    while events:
        t, b = heapq.heappop(events)
        end = max(end, t)
        if b in held:
            cur = held.pop(b)
            if nxt < len(items):
                held[b], nxt = items[nxt], nxt + 1
            heapq.heappush(events, (t + start_chained + cur * per_tile, b))
    return end


def claim_late(items, sms, per_tile, start_first, start_chained, lead_tiles):
    """A block claims its next item when its running item has lead_tiles tiles left (at its start if shorter)."""
    events, nxt, end = [], min(sms, len(items)), 0.0
    for b in range(min(sms, len(items))):
        dur = start_first + items[b] * per_tile
        heapq.heappush(events, (max(start_first, dur - lead_tiles * per_tile), b, dur))
    while events:
        t, b, fin = heapq.heappop(events)
        if nxt < len(items):
            dur = start_chained + items[nxt] * per_tile
            nxt += 1
            heapq.heappush(events, (fin + max(start_chained, dur - lead_tiles * per_tile), b, fin + dur))
        else:
            end = max(end, fin)
    return end


# bench.py's shapes whose row tiles do not divide 132 (the split rule's balance changes their plan), as (heads, n, prefix)
UNEVEN = [(128, 9, 32768), (32, 9, 131072), (16, 33, 131072), (16, 65, 131072)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-tile-us", type=float, default=1.67)   # B8's per-tile time on the H200 (ncu)
    ap.add_argument("--start-us", type=float, default=5.0)       # an item's start on the H200 (clock64 trace)
    ap.add_argument("--chained-start-us", type=float, default=1.0)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--shapes", action="store_true",
                    help="the split rule with and without its balance on UNEVEN (makespan in tiles, claim at end)")
    a = ap.parse_args()
    if a.shapes:
        for heads, n, p in UNEVEN:
            line = f"H{heads} N{n} P{p}:"
            mt = ceil_div(heads * n, 64)
            for bal in (False, True):
                items = request_items(p, n=n, heads=heads, sms=a.sms, balance=bal)
                line += (f"  {'balanced' if bal else 'base'} {len(items) // mt} splits x {mt} tiles,"
                         f" longest {max(items)}, makespan {claim_at_end(items, a.sms, 1.0, ITEM_TILES):.0f}")
            print(line)
        return
    by_request = [request_items(p, sms=a.sms) for p in RAGGED]
    items = [t for r in by_request for t in r]
    longest_first = [t for r in sorted(by_request, key=lambda r: -max(r)) for t in r]
    print(f"B8 ragged: {len(items)} items, {sum(items)} tiles, {a.sms} blocks")
    print(f"claim at end            {claim_at_end(items, a.sms, a.per_tile_us, a.start_us):7.1f} us")
    print(f"claim ahead, chained    {claim_ahead(items, a.sms, a.per_tile_us, a.start_us, a.chained_start_us):7.1f} us")
    print(f"  + longest first       {claim_ahead(longest_first, a.sms, a.per_tile_us, a.start_us, a.chained_start_us):7.1f} us")
    for lead in (4, 8):
        print(f"claim {lead} tiles before the end, chained "
              f"{claim_late(items, a.sms, a.per_tile_us, a.start_us, a.chained_start_us, lead):7.1f} us")


if __name__ == "__main__":
    main()
