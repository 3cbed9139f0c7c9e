// verify_split_rule.h: how a request's keys are cut into splits (the plan kernel's rule, verify_plan.cuh's
// request_plan). Plain C++, so that the host can compute the same plan: tests/test_split_rule.py compiles it with the
// host compiler and checks it against a model of the persistent grid (tools/sim_schedule.py).
//
// The split count and chunk depend on the request's own length and row tiles and on the split kernel's grid only
// (batch-invariant: a request's partials, and so its result, do not depend on its batch mates).
#pragma once

#if defined(__CUDACC__)
#define KDTREE_HD __host__ __device__
#else
#define KDTREE_HD
#endif

namespace kdtree {

// KDTREE_PLAN_BALANCE (1, the default; 0: the base rule alone, every split of a request equal but the last).
// Measured (H200, A/B within one run, means of three): H16 N65 P131072 -3.6% (601.6 against 624.1 us), H16 N33 -2.3%,
// H128 N9 P32768 -2.2% (167.0 against 170.8), H32 N9 -0.9%; the model below predicted -6.6 / -3.4 / -4.0 / -1.2%.
// Every other benchmark shape has the same plan and bit-identical outputs.
#ifndef KDTREE_PLAN_BALANCE
#define KDTREE_PLAN_BALANCE 1
#endif
// What an item costs beyond its key tiles, in tiles: its start (q and the first tiles land, ~2,400-4,000 SM clocks in
// the dual kernel's TRACE stamps on the H200) and its end (the partials' store, ~3,550), against ~1,760 clocks a
// 32-key tile in the steady state.
#ifndef KDTREE_PLAN_ITEM_TILES
#define KDTREE_PLAN_ITEM_TILES 4
#endif

struct SplitShape {
  int nsplit;   // splits of the key range
  int chunk;    // keys per split (a multiple of tile_n); the last split may be shorter
};

KDTREE_HD inline int split_ceil_div(int a, int b) { return (a + b - 1) / b; }   // (32-bit: the base rule, every call)
KDTREE_HD inline long long split_ceil_div(long long a, long long b) { return (a + b - 1) / b; }

// The splits of a request of `len` keys (prefix + drafts) and `mtiles` row tiles, for a grid of `blocks` persistent
// blocks that claim items in order (block i item i first, then the next unclaimed one), items numbered split-major
// within the request.
// - Base rule: nsplit = min(len / min_chunk, blocks / mtiles), equal chunks of whole tiles.
// - Balance (KDTREE_PLAN_BALANCE): when mtiles does not divide `blocks`, the base rule leaves
//   F = blocks - nsplit * mtiles blocks idle (H128 N9: 18 x 7 = 126 of 132; H16 N65: 17 x 7 = 119). One more split per
//   row tile, with shorter chunks c and a short last split s, lets the F blocks take the mtiles short items, r = ceil(
//   mtiles / F) each, while the others run one long item: a makespan of max(c + e, r (s + e)) tiles, e the item's own
//   cost (KDTREE_PLAN_ITEM_TILES), against the base rule's chunk + e. c is where the two terms meet; the rule takes it
//   only when that is shorter. Every request's rows then need at most nsplit + 1 <= blocks partials, and a request at
//   most blocks x block_m + its own rows of them (verify_launch.cu's workspace_layout).
KDTREE_HD inline SplitShape split_shape(int len, int mtiles, int blocks, int tile_n, int min_chunk) {
  SplitShape sh;
  int nsplit = 1;
  if (mtiles > 0) {
    const int by_len = split_ceil_div(len, min_chunk);
    const int by_fill = blocks / mtiles > 1 ? blocks / mtiles : 1;
    nsplit = by_len < by_fill ? by_len : by_fill;
    if (nsplit < 1) nsplit = 1;
  }
  int chunk = split_ceil_div(len, nsplit);
  chunk = split_ceil_div(chunk, tile_n) * tile_n;
  if (chunk < tile_n) chunk = tile_n;
  nsplit = len > 0 ? split_ceil_div(len, chunk) : 1;
#if KDTREE_PLAN_BALANCE
  // (a chunk of min_chunk keys cannot get shorter: skipped before the 64-bit divisions, so that the plan kernel, on
  // every call's path, pays for them only on long requests with idle blocks)
  const long long idle = (long long)blocks - (long long)nsplit * mtiles;
  if (mtiles >= 2 && chunk > min_chunk && idle > 0) {
    const long long e = KDTREE_PLAN_ITEM_TILES;
    const long long tiles = split_ceil_div((long long)len, (long long)tile_n);
    const long long r = split_ceil_div((long long)mtiles, idle);   // short items per idle block
    long long c = split_ceil_div(r * tiles + (r - 1) * e, 1 + r * nsplit);
    if (c < min_chunk / tile_n) c = min_chunk / tile_n;
    if (c * nsplit < tiles) {   // a short last split is left (so ceil(len / chunk) is nsplit + 1)
      const long long s = tiles - c * nsplit;
      const long long balanced = c + e > r * (s + e) ? c + e : r * (s + e);
      if (balanced < chunk / tile_n + e) {
        chunk = (int)(c * tile_n);
        nsplit = split_ceil_div(len, chunk);
      }
    }
  }
#endif
  sh.nsplit = nsplit;
  sh.chunk = chunk;
  return sh;
}

}  // namespace kdtree
