// verify_plan.cuh: the plan (prep) kernel. One block writes each request's plan (ReqPlan: split count and chunk from the
// split rule, row tiles, the offsets of its work items and partial rows) and the totals the split and combine
// kernels read; other blocks pack the tree mask and split q into e4m3 terms when the call asks for them. A request's
// plan depends only on its own length and row tiles, so a request gets the same splits alone and inside any batch
// (batch invariance).
#pragma once

#include "verify_common.cuh"
#include "verify_mask.cuh"
#include "verify_profiling.cuh"
#include "verify_ptx.cuh"
#include "verify_q8.cuh"

namespace kdtree {

constexpr int kPlanThreads = 256;
static_assert(kQ8RowsPerBlock * 32 == kPlanThreads, "the q blocks run one warp a row");

// The plan of request b alone (item_begin and partial_row are the caller's scan): its lengths, row tiles, splits and
// chunk; `items` its work items, `rows` its partial rows (0 when it is not split).
// The split rule (verify_split_rule.h) cuts the request's keys into `chunked` splits of `chunk` keys. Where the drafts
// stand apart (Params::drafts_apart: an e4m3 pool, or KV scales), the rule cuts only the P prefix keys, and the N
// drafts form one more split of their own, so that an item's keys are either all prefix keys (read from the pool,
// scaled) or all drafts (bf16 from k_new, unscaled).
__device__ __forceinline__ ReqPlan request_plan(const Params& prm, int b, int& items, long long& rows) {
  ReqPlan rp = {};
  const int qb = (int)load_index(prm.qo_indptr, prm.qo_indptr_64, b);
  const int qe = (int)load_index(prm.qo_indptr, prm.qo_indptr_64, b + 1);
  const int kb = prm.kv_indptr[b];
  const int ke = prm.kv_indptr[b + 1];
  rp.qo_begin = qb;
  rp.n = max(qe - qb, 0);
  rp.kv_begin = kb;
  rp.p = max(ke - kb, 0);
  const int r = rp.n * prm.heads;
  rp.mtiles = (r + prm.block_m - 1) / prm.block_m;
  const int len = prm.drafts_apart ? rp.p : rp.p + rp.n;
  const SplitShape sh = len > 0 ? split_shape(len, rp.mtiles, prm.split_target, prm.tile_n, prm.min_chunk)
                                : SplitShape{0, prm.tile_n};
  rp.chunked = sh.nsplit;
  rp.nsplit = sh.nsplit + (prm.drafts_apart ? 1 : 0);
  rp.chunk = sh.chunk;
  items = rp.mtiles * rp.nsplit;
  rows = rp.nsplit > 1 ? (long long)rp.nsplit * r : 0;
  return rp;
}

// Partial row of request-local row rr, split `split`. A row's splits are adjacent, so that a combine thread's loads
// are one base and immediate offsets (the combine's summing took ~4 us at the tail of a call with a split's rows
// adjacent instead, H200).
__device__ __forceinline__ long long partial_index(const ReqPlan& rp, int rr, int split) {
  return rp.partial_row + (long long)rr * rp.nsplit + split;
}
// The first row of request-local row rr's row tile (of block_m rows), and the tile's entry in Params::tile_done /
// tile_seen: its first row's partial row at split 0 (distinct per tile; a tile is split only when it has partial rows).
__device__ __forceinline__ int tile_row0(int block_m, int rr) { return rr / block_m * block_m; }
__device__ __forceinline__ long long tile_done_index(const ReqPlan& rp, int row0) { return partial_index(rp, row0, 0); }
// The plan's zeroes for request rp's split row tiles (a fresh workspace; afterwards the combine leaves them zero).
__device__ __forceinline__ void zero_tile_counters(const Params& prm, const ReqPlan& rp) {
  if (rp.nsplit <= 1) return;
  const int r = rp.n * prm.heads;
  for (int row0 = 0; row0 < r; row0 += prm.block_m) {
    const long long i = tile_done_index(rp, row0);
    prm.tile_done[i] = 0;
    prm.tile_seen[i] = 0;
  }
}

// The plan's totals for the split and combine kernels: the work counter reset, the item count, and the
// combine's loop bound from the largest split count of any request.
__device__ __forceinline__ void write_plan_totals(const Params& prm, int items, int max_nsplit) {
  prm.counter[0] = 0;
  prm.counter[1] = items;
  prm.counter[2] = combine_slices(max_nsplit);
}

// The prep kernel of a call: everything the split pass reads besides the caller's tensors, in one launch.
// - Block 0, unless the call reuses a plan (Params::plan_blocks 0), plans: exclusive scans of items and partial rows over
//   the requests, batches of up to 32 requests in one warp with shuffle scans and no block barrier (the split pass waits
//   on this kernel), larger ones block-wide.
// - The next Params::pack_blocks blocks pack the tree mask, kPlanThreads words each, when the call packs its own.
// - The rest, for an FP8 call, split q into e4m3 terms (verify_q8.cuh), kQ8RowsPerBlock rows each.
// (launch bounds with one block an SM: without it ptxas held the q blocks' work to 48 registers and spilled)
__global__ void __launch_bounds__(kPlanThreads, 1) kdtree_verify_plan_kernel(Params prm) {
  __shared__ int s_items[kPlanThreads];
  __shared__ long long s_rows[kPlanThreads];
  __shared__ int s_carry_items;
  __shared__ int s_max_nsplit;
  __shared__ long long s_carry_rows;
  const int tid = threadIdx.x;
  KDTREE_TIMELINE(1, 0);
  grid_dependency_launch_dependents();
  grid_dependency_wait();   // the indptr arrays (and q) may come from the previous kernel on the stream
  KDTREE_TIMELINE(1, 1);
  const int block = (int)blockIdx.x - prm.plan_blocks;
  if (block >= prm.pack_blocks) {   // q's e4m3 terms
    const int row = (block - prm.pack_blocks) * kQ8RowsPerBlock + tid / 32;
    if (row < prm.num_tokens * prm.heads) quantize_q_row(prm, row, tid & 31);
    return;
  }
  if (block >= 0) {   // the tree mask
    pack_tree_mask_word(prm.pack_mask, prm.pack_mask_indptr, prm.qo_indptr, prm.qo_indptr_64, prm.kv_indptr, prm.batch,
                        prm.num_tokens, const_cast<uint64_t*>(prm.tree_mask), prm.mask_words,
                        (long long)block * kPlanThreads + tid);
    KDTREE_TIMELINE(1, 2);
    return;
  }
  __nv_bfloat16* zero_row = const_cast<__nv_bfloat16*>(prm.zero_row);
  for (int i = tid; i < kDimQK; i += kPlanThreads) zero_row[i] = __float2bfloat16(0.f);
  if (prm.batch <= 32) {   // one warp: shuffle scans, no block barriers (the split waits on this)
    if (tid < 32) {
      int items = 0;
      long long rows = 0;
      ReqPlan rp = {};
      if (tid < prm.batch) rp = request_plan(prm, tid, items, rows);
      int inc_items = items, max_nsplit = tid < prm.batch ? rp.nsplit : 1;
      long long inc_rows = rows;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int vi = __shfl_up_sync(0xffffffffu, inc_items, off);
        const long long vr = __shfl_up_sync(0xffffffffu, inc_rows, off);
        if (tid >= off) {
          inc_items += vi;
          inc_rows += vr;
        }
        max_nsplit = max(max_nsplit, __shfl_xor_sync(0xffffffffu, max_nsplit, off));
      }
      if (tid < prm.batch) {
        rp.item_begin = inc_items - items;
        rp.partial_row = inc_rows - rows;
        prm.plan[tid] = rp;
        zero_tile_counters(prm, rp);
      }
      if (tid == 31) write_plan_totals(prm, inc_items, max_nsplit);
    }
    KDTREE_TIMELINE(1, 2);
    return;
  }
  if (tid == 0) {
    s_carry_items = 0;
    s_max_nsplit = 1;
    s_carry_rows = 0;
  }
  __syncthreads();
  for (int base = 0; base < prm.batch; base += kPlanThreads) {
    const int b = base + tid;
    ReqPlan rp = {};
    int items = 0;
    long long rows = 0;
    if (b < prm.batch) {
      rp = request_plan(prm, b, items, rows);
      atomicMax(&s_max_nsplit, rp.nsplit);
    }
    s_items[tid] = items;
    s_rows[tid] = rows;
    __syncthreads();
    // Hillis-Steele inclusive scan over a chunk of 256 requests.
    for (int off = 1; off < kPlanThreads; off <<= 1) {
      const int vi = tid >= off ? s_items[tid - off] : 0;
      const long long vr = tid >= off ? s_rows[tid - off] : 0;
      __syncthreads();
      s_items[tid] += vi;
      s_rows[tid] += vr;
      __syncthreads();
    }
    if (b < prm.batch) {
      rp.item_begin = s_carry_items + s_items[tid] - items;
      rp.partial_row = s_carry_rows + s_rows[tid] - rows;
      prm.plan[b] = rp;
      zero_tile_counters(prm, rp);
    }
    __syncthreads();
    if (tid == kPlanThreads - 1) {
      s_carry_items += s_items[tid];
      s_carry_rows += s_rows[tid];
    }
    __syncthreads();
  }
  if (tid == 0) write_plan_totals(prm, s_carry_items, s_max_nsplit);
  KDTREE_TIMELINE(1, 2);
}

}  // namespace kdtree
