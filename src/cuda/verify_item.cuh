// verify_item.cuh: what the split passes (mma.sync, dual, skinny) share about a work item: its context (request,
// split, row tile, key range), the hand-out of items, key addressing and visibility, the online-softmax steps on
// mma-shaped accumulators, the partial log-sum-exps and where a result row goes, and the release of a finished item
// to the combine.
#pragma once

#include <type_traits>

#include "verify_common.cuh"
#include "verify_plan.cuh"
#include "verify_profiling.cuh"
#include "verify_ptx.cuh"

namespace kdtree {

struct ItemCtx {
  ReqPlan rp;
  int split, mtile;
  int row0, rows;        // first request-local row of this tile, valid rows in it (<= the kernel's BlockM)
  int k0, k1;            // key range [k0, k1) of this split, keys >= p are drafts
  int ntiles;
};

// In a call whose drafts stand apart (Params::drafts_apart): whether item cx is the drafts' split (bf16 keys from
// k_new, unscaled) rather than one of the prefix splits (pool keys, scaled by k_scale / v_scale).
__device__ __forceinline__ bool drafts_split(const ItemCtx& cx) { return cx.split >= cx.rp.chunked; }

// The work item `item` of the plan: its request, split, row tile and key range, for row tiles of BlockM rows and key
// tiles of TileN keys (the split kernel's own sizes, as the plan used them). A kernel that serves calls whose drafts
// stand apart (Params::drafts_apart) passes DraftsApart: a split past the chunked ones is the drafts' [p, p + n).
template <int BlockM, int TileN, bool DraftsApart = false>
__device__ __forceinline__ ItemCtx item_ctx(const Params& prm, int item) {
  ItemCtx cx;
  cx.rp = prm.plan[owning_request(prm.batch, item, [&](int b) { return prm.plan[b].item_begin; })];
  const int local = item - cx.rp.item_begin;
  cx.split = local / cx.rp.mtiles;
  cx.mtile = local - cx.split * cx.rp.mtiles;
  cx.row0 = cx.mtile * BlockM;
  cx.rows = min(BlockM, cx.rp.n * prm.heads - cx.row0);
  if (DraftsApart && drafts_split(cx)) {
    cx.k0 = cx.rp.p;
    cx.k1 = cx.rp.p + cx.rp.n;
  } else {
    cx.k0 = cx.split * cx.rp.chunk;
    cx.k1 = min(DraftsApart && prm.drafts_apart ? cx.rp.p : cx.rp.p + cx.rp.n, cx.k0 + cx.rp.chunk);
  }
  cx.ntiles = (cx.k1 - cx.k0 + TileN - 1) / TileN;
  return cx;
}

// The block's k-th work item: block i starts with item i (no atomic on the way to the first tile), later ones come
// from the plan's counter (reset to 0 by the plan kernel and by every combine), after the grid's first items.
__device__ __forceinline__ int claim_item(const Params& prm, int k) {
  return k == 0 ? (int)blockIdx.x : (int)gridDim.x + atomicAdd(prm.counter, 1);
}

// End of split item cx, by one thread of the kernel after a barrier that follows every store of the item's partials
// (its rows' partial O and log-sum-exp): the release that lets the combine read them (CUTLASS's generic barrier
// pattern: the writers' barrier, then one thread's gpu-scope fence and relaxed add). Nothing for an unsplit tile, or
// when done_arrivals is 0 (the combine then waits for the whole pass and reads no counter).
__device__ __forceinline__ void signal_item_done(const Params& prm, const ItemCtx& cx) {
  if (cx.rp.nsplit <= 1 || prm.done_arrivals == 0) return;
  int* const done = prm.tile_done + tile_done_index(cx.rp, cx.row0);
  asm volatile("fence.acq_rel.gpu;\n"
               "red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(done) : "memory");
  KDTREE_TILE_RELEASE(done - prm.tile_done);
}

// Slot id of a prefix key (-1 otherwise): the only global load on the address path, issued one
// tile before its copy so its latency never stalls the pipeline.
__device__ __forceinline__ long long key_slot(const Params& prm, const ItemCtx& c, int key) {
  return key < c.k1 && key < c.rp.p ? load_index(prm.kv_indices, prm.kv_indices_64, (long long)c.rp.kv_begin + key) : -1;
}
__device__ __forceinline__ const __nv_bfloat16* key_ptr(const Params& prm, const ItemCtx& c, int key, long long slot) {
  if constexpr (kExpNoGather) return prm.zero_row;   // the knock-out: every key the (L2-resident) zero row
  if (key >= c.k1) return prm.zero_row;
  if (key < c.rp.p) return prm.kv + slot * prm.kv_ss;
  return prm.k_new + (long long)(c.rp.qo_begin + key - c.rp.p) * prm.k_new_st;
}

// The e4m3 pool row (576 bytes) of prefix key `key` of an item of an e4m3 call (slot: its pool slot id), or the
// zero row past the split end.
__device__ __forceinline__ const void* key_ptr8(const Params& prm, const ItemCtx& c, int key, long long slot) {
  if constexpr (kExpNoGather) return prm.zero_row;   // the knock-out, as key_ptr's
  return key < c.k1 ? static_cast<const void*>(reinterpret_cast<const uint8_t*>(prm.kv) + slot * prm.kv_ss)
                    : static_cast<const void*>(prm.zero_row);
}

// Is request-local key `key` (keys >= p are drafts) visible to verify token n (-1: a padding row)?
// Prefix keys inside the split are; drafts follow the tree mask (or the causal chain without one);
// padding rows see none.
__device__ __forceinline__ bool key_visible_n(const Params& prm, const ItemCtx& cx, int key, int n) {
  bool vis = key < cx.k1;
  if (vis && key >= cx.rp.p) {
    const int j = key - cx.rp.p;
    if (n < 0 || (prm.tree_mask && (j >> 6) >= prm.mask_words)) {
      // padding row; or a request longer than the mask's 64 * words columns (a caller bug the host
      // cannot see without a sync): never read past the mask row
      vis = false;
    } else if (prm.tree_mask) {
      const uint64_t w = prm.tree_mask[(long long)(cx.rp.qo_begin + n) * prm.mask_words + (j >> 6)];
      vis = (w >> (j & 63)) & 1ull;
    } else {
      vis = j <= n;
    }
  }
  return vis;
}
// The verify token of tile row r (-1: a padding row).
__device__ __forceinline__ int row_token(const ItemCtx& cx, int r, int H) {
  return r < cx.rows ? (cx.row0 + r) / H : -1;
}

// A thread's scores of a tile (16 of 32 keys; 32 of the dual kernel's 64-key pairs), as the split kernels hold them:
// key group j (8 keys) x value e (rows r0 / r0 + 8 for e < 2 / e >= 2, keys 2c / 2c + 1 of the group for even / odd e).
template <int N>
__device__ __forceinline__ float& score_at(float (&v)[N], int j, int e) { return v[4 * j + e]; }
template <int G>
__device__ __forceinline__ float& score_at(float (&v)[G][4], int j, int e) { return v[j][e]; }

// Scale the tile's scores to log2 units (times `scale`: Params::scale_log2, or that times k_scale; or a factor per row
// of the thread's two, row_scale), mask them, and take the maxima of the thread's two rows. A plain
// tile (all prefix keys inside the split) needs no mask and takes the short path; otherwise the rows'
// verify tokens are found once and each key tested against them. Groups: the thread's n8 key groups (keys
// key0 .. key0 + 8 Groups - 1).
__device__ __forceinline__ float row_scale(float scale, int) { return scale; }
__device__ __forceinline__ float row_scale(const float (&scale)[2], int half) { return scale[half]; }
template <int Groups = kTileN / 8, typename Scores, typename Scale>
__device__ __forceinline__ void scale_mask_max(const Params& prm, const ItemCtx& cx, int H, int key0, int r0, int c,
                                               const Scale& scale, Scores& v, float (&tmax)[2]) {
  tmax[0] = tmax[1] = -INFINITY;
  const bool plain = key0 + Groups * 8 <= cx.k1 && key0 + Groups * 8 <= cx.rp.p;
  if (plain) {
#pragma unroll
    for (int j = 0; j < Groups; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& x = score_at(v, j, e);
        x *= row_scale(scale, e >> 1);
        tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
      }
  } else {
    const int rn[2] = {row_token(cx, r0, H), row_token(cx, r0 + 8, H)};
#pragma unroll
    for (int j = 0; j < Groups; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& x = score_at(v, j, e);
        x = key_visible_n(prm, cx, key0 + j * 8 + 2 * c + (e & 1), rn[e >> 1]) ? x * row_scale(scale, e >> 1) : -INFINITY;
        tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
      }
  }
}

// A thread's row maximum reduced over its quad (the four threads that hold a row's columns).
__device__ __forceinline__ float quad_max(float m) {
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  return fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
}

// One online-softmax step for the two rows (g, g+8) of an mma / wgmma accumulator: the tile's row
// maxima (tmax, per thread) are reduced over the quad, the running maxima advance, and the factor
// that rescales what was accumulated before comes back (m_use: the max to subtract, 0 for a row
// that has seen nothing visible yet).
__device__ __forceinline__ void softmax_advance(float (&tmax)[2], float (&m_run)[2], float (&m_use)[2],
                                                float (&alpha)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    tmax[half] = quad_max(tmax[half]);
    const float m_new = fmaxf(m_run[half], tmax[half]);
    m_use[half] = m_new == -INFINITY ? 0.f : m_new;
    alpha[half] = fast_exp2(m_run[half] - m_use[half]);
    m_run[half] = m_new;
  }
}

// softmax_advance with a lazy reference for Tau > 0 (FlashAttention-4's conditional rescale; Tau 0: softmax_advance):
// m_run is the reference a row's P subtracts, and it moves to the row's maximum only when that exceeds it by more than
// Tau (log2 units; at the row's first visible key it always does), so P <= 2^Tau and alpha is exactly 1 wherever the
// reference stays.
// KDTREE_MMA_LAZY_RESCALE = Tau (0 turns it off): the mma.sync split kernel (the sm_120 path) takes it, as the dual
// kernel's KDTREE_DUAL_LAZY_RESCALE. Measured on the H200 with the sm_120 depth (KDTREE_SPLIT_STAGES=2; A/B within
// one run, means of two): 8 -1.3% at H16 N9 P131072 (187.1 against 189.5 us), -2.0% B8, -0.3% H128 N9 P32768.
#ifndef KDTREE_MMA_LAZY_RESCALE
#define KDTREE_MMA_LAZY_RESCALE 8
#endif
static_assert(KDTREE_MMA_LAZY_RESCALE >= 0, "KDTREE_MMA_LAZY_RESCALE: 0 (off) or tau > 0");
template <int Tau>
__device__ __forceinline__ void softmax_advance_tau(float (&tmax)[2], float (&m_run)[2], float (&m_use)[2],
                                                    float (&alpha)[2]) {
  if constexpr (Tau <= 0) {
    softmax_advance(tmax, m_run, m_use, alpha);
  } else {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      tmax[half] = quad_max(tmax[half]);
      const bool keep = tmax[half] <= m_run[half] + float(Tau);   // (-inf <= -inf: nothing visible yet keeps -inf)
      const float m_new = keep ? m_run[half] : tmax[half];
      m_use[half] = m_new == -INFINITY ? 0.f : m_new;
      alpha[half] = keep ? 1.f : fast_exp2(m_run[half] - m_use[half]);
      m_run[half] = m_new;
    }
  }
}

// A warpgroup's own row sums move from its previous step's reference mu to this step's m_use: lfac is the factor that
// rescales them (softmax_p_pairs' alpha, where each of two warpgroups keeps sums of its own steps).
__device__ __forceinline__ void move_sums_reference(float (&mu)[2], const float (&m_use)[2], float (&lfac)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    lfac[half] = fast_exp2(mu[half] - m_use[half]);
    mu[half] = m_use[half];
  }
}

// The tile's P = 2^(score - m_use) for the thread's 4 x Groups scores, as bf16 pairs handed to sink(j, half, pair)
// (key group j, row r0 / r0 + 8 for half 0 / 1, keys 2c / 2c + 1), and the rows' running sums advanced:
// l = alpha * l + this thread's part of the tile's row sums.
// A sink that takes the pair as floats, sink(j, half, p0, p1), gets them unpacked (the dual kernel's e4m3 P^T, which
// rounds them and accounts for the rounding in the sums itself).
template <int Groups = kTileN / 8, typename Scores, typename Sink>
__device__ __forceinline__ void softmax_p_pairs(Scores& v, const float (&m_use)[2], const float (&alpha)[2],
                                                float (&l_run)[2], Sink sink) {
  float psum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < Groups; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float p0 = fast_exp2(score_at(v, j, 2 * half) - m_use[half]);
      const float p1 = fast_exp2(score_at(v, j, 2 * half + 1) - m_use[half]);
      psum[half] += p0 + p1;
      if constexpr (std::is_invocable_v<Sink, int, int, float, float>)
        sink(j, half, p0, p1);
      else
        sink(j, half, pack_bf16(p0, p1));
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) l_run[half] = l_run[half] * alpha[half] + psum[half];
}

// The partial log2-sum-exp of tile row r of a split request's item (-inf for a row that saw no key).
__device__ __forceinline__ void write_partial_lse(const Params& prm, const ItemCtx& cx, int H, int r, float m, float l) {
  prm.partial_lse[partial_index(cx.rp, cx.row0 + r, cx.split)] = l > 0.f ? m + log2f(l) : -INFINITY;
}

// The partial log2-sum-exps of a split item's rows r0 and r0 + 8 (those inside the tile), by the quad's thread c == 0.
__device__ __forceinline__ void write_partial_lse_rows(const Params& prm, const ItemCtx& cx, int H, int r0, int c,
                                                       const float (&m)[2], const float (&l)[2]) {
  if (cx.rp.nsplit > 1 && c == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + half * 8;
      if (r < cx.rows) write_partial_lse(prm, cx, H, r, m[half], l[half]);
    }
  }
}

// A thread's partial row sums of its two rows (a quad of threads holds each row's columns) reduced over the quad.
__device__ __forceinline__ void quad_sum_rows(float (&l)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
  }
}

// End of an item, score side: l (a per-thread partial) reduced over the quad, the row statistics
// stored for the value side, and for a split request the partial log2-sum-exp of each row (after
// `bar`, the barrier the value side waits on before it reads row_m / row_l).
template <typename Bar>
__device__ __forceinline__ void finish_rows(const Params& prm, const ItemCtx& cx, int H, int wrow, int g, int c,
                                            const float (&m_run)[2], float (&l_run)[2], float* row_m,
                                            float* row_l, Bar bar) {
  quad_sum_rows(l_run);
  if (c == 0) {
    row_m[wrow + g] = m_run[0];
    row_m[wrow + g + 8] = m_run[1];
    row_l[wrow + g] = l_run[0];
    row_l[wrow + g + 8] = l_run[1];
  }
  bar();
  write_partial_lse_rows(prm, cx, H, wrow + g, c, m_run, l_run);
}

// An item's result rows on their way out through shared memory: row r at r * 1 KB (512 bf16), its 16-byte chunk k
// at (k ^ (r % 8)) * 16, so that stmatrix's 8 rows of one chunk and a warp's 32 chunks of one row are free of bank
// conflicts. Value threads store their accumulators there (stmatrix), then copy whole rows out, 16 B per lane.
__device__ __forceinline__ uint32_t stage_chunk(uint32_t stage, int r, int k) {
  return stage + r * 1024 + ((k ^ (r & 7)) << 4);
}

// Where tile row r of the item goes: its partial row (split requests) or the output row.
__device__ __forceinline__ __nv_bfloat16* result_row(const Params& prm, const ItemCtx& cx, int r) {
  const int rr = cx.row0 + r;
  const int n = rr / prm.heads, h = rr - n * prm.heads;
  __nv_bfloat16* const partial = prm.partial_o + partial_index(cx.rp, rr, cx.split) * kDimNope;
  __nv_bfloat16* const out = prm.out + (long long)(cx.rp.qo_begin + n) * prm.out_st + (long long)h * prm.out_sh;
  return cx.rp.nsplit > 1 ? partial : out;
}

}  // namespace kdtree
