// verify_plan.cuh: the plan kernel. One block writes each request's plan (ReqPlan: split count and chunk from the
// split rule, row tiles, the offsets of its work items and partial rows) and the totals the split and combine
// kernels read; blocks 1.. pack the tree mask when the call asks for it. A request's plan depends only on its own
// length and row tiles, so a request gets the same splits alone and inside any batch (batch invariance).
#pragma once

#include "verify_common.cuh"
#include "verify_mask.cuh"
#include "verify_profiling.cuh"
#include "verify_ptx.cuh"

namespace kdtree {

// ---------------------------------------------------------------------------------------------
// Plan: one block; per request its split count, chunk, row tiles and offsets (exclusive scans). A call that packs its
// own tree mask (Params::pack_mask) launches more blocks: blocks 1.. pack it, kPlanThreads words each.
// ---------------------------------------------------------------------------------------------
constexpr int kPlanThreads = 256;
// Batches of up to 32 requests are planned by one warp with shuffle scans (session 8); 0: the block-wide scan
// for every batch, as before (an experiment switch: the same plan either way).
#ifndef KDTREE_PLAN_WARP
#define KDTREE_PLAN_WARP 1
#endif

// The plan of request b alone (item_begin and partial_row are the caller's scan): its lengths, row tiles,
// splits and chunk; `items` its work items, `rows` its partial rows (0 when it is not split).
__device__ __forceinline__ ReqPlan request_plan(const Params& prm, int b, int& items, long long& rows, int& items_s) {
  ReqPlan rp = {};
  const int qb = (int)load_index(prm.qo_indptr, prm.qo_indptr_64, b);
  const int qe = (int)load_index(prm.qo_indptr, prm.qo_indptr_64, b + 1);
  const int kb = prm.kv_indptr[b];
  const int ke = prm.kv_indptr[b + 1];
  rp.qo_begin = qb;
  rp.n = max(qe - qb, 0);
  rp.kv_begin = kb;
  rp.p = max(ke - kb, 0);
  const int len = rp.p + rp.n;
  const int r = rp.n * prm.heads;
  rp.mtiles = (r + prm.block_m - 1) / prm.block_m;
  rp.rows_f = r;
  const int rem = r % prm.block_m;
  const bool skinny_rem = prm.mixed && r > prm.block_m && rem > 0 && rem <= kMixedRemRows;
  if (skinny_rem) {
    rp.mtiles = r / prm.block_m;
    rp.rows_f = rp.mtiles * prm.block_m;
  }
  const SplitShape sh = split_shape(len, rp.mtiles, prm.split_target, prm.tile_n, kMinChunk);
  const int nsplit = sh.nsplit;
  const int chunk = sh.chunk;
  rp.nsplit = nsplit;
  rp.chunk = chunk;
  items = rp.mtiles * nsplit;
  rows = nsplit > 1 ? (long long)nsplit * rp.rows_f : 0;
  items_s = 0;
  if (skinny_rem) {
    rp.cells_s = nsplit * ((chunk + kMixedTileN - 1) / kMixedTileN);
    const int ns = max(1, min(min((len + kMinChunk - 1) / kMinChunk, prm.split_target_s), rp.cells_s));
    rp.nsplit_s = ns;
    items_s = ns;
    if (ns > 1) rows += (long long)ns * (r - rp.rows_f);
  }
  return rp;
}

// Partial row of request-local row rr, split `split` (of the row's own kind: the split kernel's rows [0, rows_f), then
// the remainder's skinny splits after all of theirs). A row's splits are adjacent (session 35; before, a split's rows
// were), so that a combine thread's loads are one base and immediate offsets.
__device__ __forceinline__ long long partial_index(const ReqPlan& rp, int heads, int rr, int split) {
  if (rr < rp.rows_f) return rp.partial_row + (long long)rr * rp.nsplit + split;
  const long long base = rp.partial_row + (rp.nsplit > 1 ? (long long)rp.nsplit * rp.rows_f : 0);
  return base + (long long)(rr - rp.rows_f) * rp.nsplit_s + split;
}
// How many splits request-local row rr's keys were cut into (1: its item wrote the output row).
__device__ __forceinline__ int row_nsplit(const ReqPlan& rp, int rr) { return rr < rp.rows_f ? rp.nsplit : rp.nsplit_s; }
// The first row of request-local row rr's row tile (a split kernel's tile of block_m rows, or a mixed call's remainder),
// and the tile's entry in Params::tile_done / tile_seen: its first row's partial row at split 0 (distinct per tile; a
// tile is split only when it has partial rows).
__device__ __forceinline__ int tile_row0(const ReqPlan& rp, int block_m, int rr) {
  return rr < rp.rows_f ? rr / block_m * block_m : rp.rows_f;
}
__device__ __forceinline__ long long tile_done_index(const ReqPlan& rp, int heads, int row0) {
  return partial_index(rp, heads, row0, 0);
}
// The plan's zeroes for request rp's split row tiles (a fresh workspace; afterwards the combine leaves them zero).
__device__ __forceinline__ void zero_tile_counters(const Params& prm, const ReqPlan& rp) {
  const int r = rp.n * prm.heads;
  for (int row0 = 0; row0 < r; row0 = row0 < rp.rows_f ? row0 + prm.block_m : r) {
    if (row_nsplit(rp, row0) <= 1) continue;
    const long long i = tile_done_index(rp, prm.heads, row0);
    prm.tile_done[i] = 0;
    prm.tile_seen[i] = 0;
  }
}


// The plan's totals for the split and combine kernels: the work counter reset, the item count, and the
// combine's loop bound from the largest split count of any request.
__device__ __forceinline__ void write_plan_totals(const Params& prm, int items, int max_nsplit, int items_s) {
  prm.counter[0] = 0;
  prm.counter[1] = items;
  prm.counter[2] = combine_slices(max_nsplit);
  prm.counter[3] = items_s;
  prm.counter[4] = 0;
}

__global__ void __launch_bounds__(kPlanThreads) kdtree_verify_plan_kernel(Params prm) {
  __shared__ int s_items[kPlanThreads];
  __shared__ int s_items_s[kPlanThreads];
  __shared__ long long s_rows[kPlanThreads];
  __shared__ int s_carry_items, s_carry_items_s;
  __shared__ int s_max_nsplit;
  __shared__ long long s_carry_rows;
  const int tid = threadIdx.x;
  KDTREE_TIMELINE(1, 0);
  grid_dependency_launch_dependents();
  grid_dependency_wait();   // the indptr arrays may come from the previous kernel on the stream
  KDTREE_TIMELINE(1, 1);
  if (blockIdx.x > 0) {   // the tree mask, packed beside the plan (launched only with prm.pack_mask)
    pack_tree_mask_word(prm.pack_mask, prm.pack_mask_indptr, prm.qo_indptr, prm.qo_indptr_64, prm.kv_indptr, prm.batch,
                        prm.num_tokens, const_cast<uint64_t*>(prm.tree_mask), prm.mask_words,
                        (long long)(blockIdx.x - 1) * kPlanThreads + tid);
    KDTREE_TIMELINE(1, 2);
    return;
  }
  __nv_bfloat16* zero_row = const_cast<__nv_bfloat16*>(prm.zero_row);
  for (int i = tid; i < kDimQK; i += kPlanThreads) zero_row[i] = __float2bfloat16(0.f);
  if (KDTREE_PLAN_WARP && prm.batch <= 32) {   // one warp: shuffle scans, no block barriers (the split waits on this)
    if (tid < 32) {
      int items = 0, items_s = 0;
      long long rows = 0;
      ReqPlan rp = {};
      if (tid < prm.batch) rp = request_plan(prm, tid, items, rows, items_s);
      int inc_items = items, inc_items_s = items_s, max_nsplit = tid < prm.batch ? max(rp.nsplit, rp.nsplit_s) : 1;
      long long inc_rows = rows;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int vi = __shfl_up_sync(0xffffffffu, inc_items, off);
        const int vs = __shfl_up_sync(0xffffffffu, inc_items_s, off);
        const long long vr = __shfl_up_sync(0xffffffffu, inc_rows, off);
        if (tid >= off) {
          inc_items += vi;
          inc_items_s += vs;
          inc_rows += vr;
        }
        max_nsplit = max(max_nsplit, __shfl_xor_sync(0xffffffffu, max_nsplit, off));
      }
      if (tid < prm.batch) {
        rp.item_begin = inc_items - items;
        rp.item_begin_s = inc_items_s - items_s;
        rp.partial_row = inc_rows - rows;
        prm.plan[tid] = rp;
        zero_tile_counters(prm, rp);
      }
      if (tid == 31) write_plan_totals(prm, inc_items, max_nsplit, inc_items_s);
    }
    KDTREE_TIMELINE(1, 2);
    return;
  }
  if (tid == 0) {
    s_carry_items = 0;
    s_carry_items_s = 0;
    s_max_nsplit = 1;
    s_carry_rows = 0;
  }
  __syncthreads();
  for (int base = 0; base < prm.batch; base += kPlanThreads) {
    const int b = base + tid;
    ReqPlan rp = {};
    int items = 0, items_s = 0;
    long long rows = 0;
    if (b < prm.batch) {
      rp = request_plan(prm, b, items, rows, items_s);
      atomicMax(&s_max_nsplit, max(rp.nsplit, rp.nsplit_s));
    }
    s_items[tid] = items;
    s_items_s[tid] = items_s;
    s_rows[tid] = rows;
    __syncthreads();
    // Hillis-Steele inclusive scan over a chunk of 256 requests.
    for (int off = 1; off < kPlanThreads; off <<= 1) {
      const int vi = tid >= off ? s_items[tid - off] : 0;
      const int vs = tid >= off ? s_items_s[tid - off] : 0;
      const long long vr = tid >= off ? s_rows[tid - off] : 0;
      __syncthreads();
      s_items[tid] += vi;
      s_items_s[tid] += vs;
      s_rows[tid] += vr;
      __syncthreads();
    }
    if (b < prm.batch) {
      rp.item_begin = s_carry_items + s_items[tid] - items;
      rp.item_begin_s = s_carry_items_s + s_items_s[tid] - items_s;
      rp.partial_row = s_carry_rows + s_rows[tid] - rows;
      prm.plan[b] = rp;
      zero_tile_counters(prm, rp);
    }
    __syncthreads();
    if (tid == kPlanThreads - 1) {
      s_carry_items += s_items[tid];
      s_carry_items_s += s_items_s[tid];
      s_carry_rows += s_rows[tid];
    }
    __syncthreads();
  }
  if (tid == 0) write_plan_totals(prm, s_carry_items, s_max_nsplit, s_carry_items_s);
  KDTREE_TIMELINE(1, 2);
}

}  // namespace kdtree
