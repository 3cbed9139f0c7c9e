// verify_skinny.cuh: the sm_90a split pass for calls whose requests have at most 16 rows (H x N <= 16: one verify
// token at H16, H8 N2, ...), with both products transposed so that the keys, not the rows, fill the wgmma M.
//
// Why (docs/design.md): the dual kernel computes 64 rows per item, so a 16-row item pays a 64-row
// item's tensor and shared-memory work and its chain through the key buffers: H16 N1 P131072 took 66 us (2.3 TB/s,
// the copy bandwidth is 4.2). Here, per 64-key tile:
// - S^T = K q^T: 36 wgmma m64n16k16, A = the key tile (64 keys = M, K-major), B = q (16 rows = N, K-major);
// - the online softmax runs down the columns (a query row is a column): the column maxima meet over the 4 warps in
//   shared memory; P^T (bf16) goes to shared memory as the next product's B operand (K-major, 128-byte swizzle);
// - O^T += V^T P^T: 8 value blocks x 4 k-steps of wgmma m64n16k16, A = the same key tile read MN-major (each
//   64-column slab of the tile is one block of 64 value dims), B = P^T. O^T (512 x 16 fp32) is 64 registers per
//   thread of one warpgroup.
// The tensor and shared-memory work per key is about a quarter of a 64-row item's, so the keys' delivery sets the time.
// - 2 warpgroups, 256 threads: the consumer (products and softmax) and the producer (the gather: cp.async into
//   64-key tiles of the 128-byte swizzled layout, 2 stages of 72 KB; a third does not fit beside q). Eight producer
//   threads share a key (a warp's copy is four whole 128-byte lines: with 2 threads per key and scattered chunks
//   every 32-byte sector was fetched twice, 74.6 us at H16 N1 P131072). The producer runs on into the next item
//   while the consumer ends the current one.
// Measured (H200; graph, against the dual kernel in the same run): H16 N1 P131072 61.1 us (66.1), P185000 75.6
// (81.7), P8192 23.4 (28.2), H8 N2 61.8 (66.4); the split kernel alone 46.4 us at 3.33 TB/s from DRAM (ncu). With its
// products knocked out it is ~3% faster: the gather, not the consumer, sets the time.
// - The plan, partials and combine are every split kernel's, with 16-row items and 64-key tiles
//   (prm.block_m / prm.tile_n); the tree mask, padding rows and split ends follow the same rules (key_visible_n).
#pragma once

#include "verify_wgmma.cuh"

namespace kdtree {
namespace sk {

using wg::SmemDesc;
using wg::kSlabs;          // 9 slabs of 64 dims
using wg::kSlabDims;       // 64
using wg::kChunksPerKey;   // 72 chunks of 16 bytes per key

constexpr int kRows = 16;                          // rows per item: the wgmma N
// 64 keys per tile, the wgmma M: 2 stages of 72 KB fit beside q. (48- and 32-key tiles, with 3 and 4 stages and the
// products still m64 over a zeroed pad, measured 3-9% slower on the H200; a second producer warpgroup 5% slower at
// H16 N1 P131072.)
constexpr int kTileN = 64;
// The skinny kernels' shortest split, in keys (the others': kdtree::kMinChunk, 256). One tile: a short request
// then spreads over more SMs, and its items' fixed costs (plan wait, q, the partials' stores) overlap. Against 256 on
// the FP8 form (H100, e4m3 pool, two rounds of each build, alternating, one run): H16 N1 P8192 19.0 against 22.6 us
// (-16%; 128 keys: 20.1), P32768 and H8 N2 P131072 within 0.7% (the same plan); a batch of eight few-row requests
// (B8 ragged 4k..64k H8 N2), whose short requests now add items to a full GPU, 113.8 against 111.7 (+1.9%; 128 keys:
// +2.7%). On a bf16 pool: 20.9 against 22.3 at P8192, 136.6 against 135.1 on the batch.
#ifndef KDTREE_SKINNY_MIN_CHUNK
#define KDTREE_SKINNY_MIN_CHUNK 64
#endif
constexpr int kMinChunk = KDTREE_SKINNY_MIN_CHUNK;
static_assert(kMinChunk % kTileN == 0 && kMinChunk > 0, "splits are whole tiles");
constexpr int kStages = 2;
constexpr int kMmaM = 64;                          // the wgmma M of both products
constexpr int kConsumerThreads = 128;
constexpr int kProducerThreads = 128;
constexpr int kThreads = kConsumerThreads + kProducerThreads;   // consumer + producer warpgroups
constexpr int kSlabBytes = kTileN * 128;           // 8,192: one 64-dim slab of a tile
constexpr int kTileBytes = kSlabs * kSlabBytes;    // 73,728
constexpr int kStageBytes = kTileBytes;
constexpr int kQSlabBytes = kRows * 128;           // 2,048
constexpr int kPvSteps = kTileN / 16;              // 4
constexpr int kVBlocks = kDimNope / kSlabDims;     // 8 blocks of 64 value dims
constexpr int kBarConsumer = 1;                    // named barrier of the consumer warpgroup (0 is __syncthreads)

static_assert(kMmaM == 64 && kRows == 16 && kTileN == kMmaM, "one wgmma m64n16k16 per k-step of either product");

struct Smem {
  unsigned char kv[kStages][kStageBytes];  // 147,456 at 64 keys: [stage][slab][key][128 B] + pad (1 KB boundary)
  unsigned char q[kSlabs * kQSlabBytes];   // 18,432: q of the item, [slab][row][128 B]; then its result rows (bf16)
  unsigned char p[kRows * 128];            // P^T of the latest tile: [row][64 keys], 128-byte swizzle
  float red[4][kRows];                     // per-warp column maxima of a tile
  float lred[4][kRows];                    // per-warp column sums at the end of an item
  float row_m[kRows], row_l[kRows];        // the item's row statistics, for the partial lse
  unsigned long long full[kStages];        // tile landed: 128 producer arrivals (cp.async.mbarrier.arrive)
  unsigned long long empty[kStages];       // tile consumed: 128 consumer arrivals
  unsigned long long item_full[2];         // the block's item k stored in item[k % 2]: 1 arrival (release)
  unsigned long long item_empty[2];        // item[k % 2] read by every thread: 256 arrivals
  int item[2];
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;   // + room to align the base to 1 KB
static_assert(kSmemBytes <= 232448, "sm_90 gives a block at most 227 KB of shared memory");
static_assert(kSlabBytes % 1024 == 0 && kStageBytes % 1024 == 0 && (kSlabs * kQSlabBytes) % 1024 == 0,
              "slabs, stages and q on 1 KB swizzle atoms");

using km::col_of;   // the accumulator mapping of kernels with the keys as the wgmma M (verify_wgmma.cuh)
using km::col_q;

// The online-softmax step of one key tile of a kernel with the keys as the wgmma M, by the consumer warpgroup: the
// thread's S^T values s (keys key_base + 16 warp + g + 8 row_half(i), columns col_of(c, col_q(i))) scaled to log2
// units (scale: a factor per column), masked (a tile of prefix keys inside the split needs no mask; `live` false: the
// warp's keys are not in the tile, all masked), the column maxima met over the 4 warps in `red`, P = 2^(s - m) handed
// to sink(pv) (which stores P^T for the next product and may round pv to the values it stored), the column sums
// advanced by pv; alpha rescales what O^T holds. Ends with P^T fenced for the async proxy behind a consumer barrier
// (`bar`: the named barrier of the calling consumer warpgroup's 128 threads).
template <class Sink>
__device__ __forceinline__ void column_softmax(const Params& prm, const ItemCtx& cx, int key_base, const int (&rn)[4],
                                               const float (&scale)[4], bool live, float (&s)[8], float (&m_run)[4],
                                               float (&l_part)[4], float (&alpha)[4], float (&red)[4][kRows],
                                               int warp, int g, int c, Sink sink, int bar = kBarConsumer) {
  const bool plain = key_base + kTileN <= cx.k1 && key_base + kTileN <= cx.rp.p;
  const int key0 = key_base + warp * 16 + g;
  float cm[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int q = col_q(i);
    s[i] = live && (plain || key_visible_n(prm, cx, key0 + 8 * ((i >> 1) & 1), rn[q])) ? s[i] * scale[q] : -INFINITY;
    cm[q] = fmaxf(cm[q], s[i]);
  }
  km::reduce_over_key_rows(cm, km::fmax_op);
  if (g == 0) {
#pragma unroll
    for (int q = 0; q < 4; ++q) red[warp][col_of(c, q)] = cm[q];
  }
  bar_sync(bar, kConsumerThreads);   // (the reads below end before this tile's P barrier, which every thread passes
                                     // before it writes red again)
  float m_use[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int col = col_of(c, q);
    const float tmax = fmaxf(fmaxf(red[0][col], red[1][col]), fmaxf(red[2][col], red[3][col]));
    const float m_new = fmaxf(m_run[q], tmax);
    m_use[q] = m_new == -INFINITY ? 0.f : m_new;
    alpha[q] = fast_exp2(m_run[q] - m_use[q]);
    m_run[q] = m_new;
  }
  // P^T into shared memory (the previous tile's O^T product is complete: every thread waited for it before the
  // barrier above), the column sums advanced
  float pv[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) pv[i] = fast_exp2(s[i] - m_use[col_q(i)]);
  sink(pv);
  float ps[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < 8; ++i) ps[col_q(i)] += pv[i];
#pragma unroll
  for (int q = 0; q < 4; ++q) l_part[q] = l_part[q] * alpha[q] + ps[q];
  fence_proxy_async();   // P^T is read next by wgmma (the async proxy)
  bar_sync(bar, kConsumerThreads);
}

// A column_softmax sink: P^T as bf16 into `p` ([row][64 keys], 128-byte swizzle: the B operand of O^T, K-major).
struct PtBf16 {
  unsigned char* p;
  int warp, g, c;
  __device__ __forceinline__ void operator()(float (&pv)[8]) const {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      *reinterpret_cast<__nv_bfloat16*>(&p[km::pt_offset(col_of(c, col_q(i)), warp * 16 + g + 8 * km::row_half(i))]) =
          __float2bfloat16(pv[i]);
  }
};

// O^T *= alpha of each column, skipped when the whole warp's factors are 1.
__device__ __forceinline__ void rescale_o_t(float (&o)[kVBlocks][8], const float (&alpha)[4]) {
  if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f && alpha[2] == 1.f && alpha[3] == 1.f)) {
#pragma unroll
    for (int mb = 0; mb < kVBlocks; ++mb)
#pragma unroll
      for (int i = 0; i < 8; ++i) o[mb][i] *= alpha[col_q(i)];
  }
}

// End of an item, by the consumer warpgroup: the column sums met over the warpgroup (lred), O^T * out_scale / l staged
// as the item's bf16 rows (dim_of(mb, warp, g, h): the value dim of the thread's accumulator row 16 warp + g + 8 h of
// value block mb), then stored 16 B a thread; the row statistics for the partial log-sum-exps of a split request.
// The rows are staged in the item's q buffer, free after its last product; the caller's next q copies wait for a
// consumer barrier (lred and the row statistics are written again only after the next item's barriers). `tid`: the
// thread's index in its consumer warpgroup, `bar` that warpgroup's named barrier.
template <size_t QBytes, class DimOf>
__device__ __forceinline__ void store_item(const Params& prm, const ItemCtx& cx, int H, const float (&o)[kVBlocks][8],
                                           const float (&m_run)[4], float (&l_part)[4], float out_scale,
                                           float (&lred)[4][kRows], float* row_m, float* row_l,
                                           unsigned char (&q_bytes)[QBytes], int tid, DimOf dim_of,
                                           int bar = kBarConsumer) {
  static_assert(QBytes >= kRows * kDimNope * sizeof(__nv_bfloat16), "q's bytes hold the item's result rows");
  __nv_bfloat16* stage = reinterpret_cast<__nv_bfloat16*>(q_bytes);
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  km::reduce_over_key_rows(l_part, km::add_op);
  if (g == 0) {
#pragma unroll
    for (int q = 0; q < 4; ++q) lred[warp][col_of(c, q)] = l_part[q];
  }
  bar_sync(bar, kConsumerThreads);
  float inv[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int col = col_of(c, q);
    const float l = (lred[0][col] + lred[1][col]) + (lred[2][col] + lred[3][col]);
    inv[q] = l > 0.f ? out_scale / l : 0.f;
    if (warp == 0 && g == 0) {
      row_m[col] = m_run[q];
      row_l[col] = l;
    }
  }
#pragma unroll
  for (int mb = 0; mb < kVBlocks; ++mb)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      stage[col_of(c, col_q(i)) * kDimNope + dim_of(mb, warp, g, km::row_half(i))] =
          __float2bfloat16(o[mb][i] * inv[col_q(i)]);
  bar_sync(bar, kConsumerThreads);
  for (int idx = tid; idx < cx.rows * (kDimNope / 8); idx += kConsumerThreads) {
    const int r = idx / (kDimNope / 8), ch = idx - r * (kDimNope / 8);
    *reinterpret_cast<uint4*>(result_row(prm, cx, r) + ch * 8) = *reinterpret_cast<const uint4*>(&stage[r * kDimNope + ch * 8]);
  }
  if (cx.rp.nsplit > 1 && tid < cx.rows) write_partial_lse(prm, cx, H, tid, row_m[tid], row_l[tid]);
}

// The mbarriers of a kernel of this shape (the skinny kernels), by one thread before a block barrier: each key stage's
// full (full_arrivals: the producer's) and empty (the consumers' arrivals), the item hand-off's full and empty (every
// thread of the block).
template <class SmemT>
__device__ __forceinline__ void init_barriers(SmemT& sm, int full_arrivals, int consumer_threads = kConsumerThreads,
                                              int block_threads = kThreads) {
  constexpr int kRing = sizeof(sm.full) / sizeof(sm.full[0]);
  for (int b = 0; b < kRing; ++b) {
    mbar_init(&sm.full[b], full_arrivals);
    mbar_init(&sm.empty[b], consumer_threads);
  }
  for (int i = 0; i < 2; ++i) {
    mbar_init(&sm.item_full[i], 1);
    mbar_init(&sm.item_empty[i], block_threads);
  }
  fence_proxy_async();
}

__global__ void __launch_bounds__(kThreads, 1) kdtree_verify_split_skinny_kernel(Params prm) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem& sm = wg::smem_1k<Smem>(smem_raw);
  const int tid = threadIdx.x;
  KDTREE_TIMELINE(2, 0);
  // the combine may be scheduled at once (and its blocks fit beside this kernel's): with small calls it waits for the
  // whole pass (SplitLaunch::done_arrivals 0; letting it start only after this wait, as the early combine would
  // need, costs H16 N1 P131072 ~2 us on the H200)
  grid_dependency_launch_dependents();
  grid_dependency_wait();   // the plan kernel's counter and plan
  KDTREE_TIMELINE(2, 1);
  const int total = prm.counter[1];
  const int H = prm.heads;

  if (tid == 0) init_barriers(sm, kProducerThreads);
  __syncthreads();

  // The block's k-th work item: the producer's first thread claims it (the producer runs up to one item ahead of
  // the consumer)
  auto fetch_item = [&](int k) {
    return wg::fetch_item_ahead(prm, k, tid, kConsumerThreads, sm.item, sm.item_full, sm.item_empty);
  };

  if (tid < kConsumerThreads) {
    // =========================== consumer warpgroup ===========================
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int c = lane & 3;
    const SmemDesc qd(smem_u32(&sm.q[0]), 16, 1024);
    const SmemDesc pd(smem_u32(&sm.p[0]), 16, 1024);
    uint32_t seq = 0;   // tiles consumed by this block: buffer seq % kStages, phase seq / kStages
    for (int k = 0;; ++k) {
      const int item = fetch_item(k);
      if (item >= total) {
        KDTREE_TIMELINE(2, 2);   // (the consumer's last stores are issued)
        break;
      }
      KDTREE_SKSTART(k == 0 && tid == 0, 0);
      const ItemCtx cx = item_ctx<kRows, kTileN>(prm, item);
      if (k > 0) bar_sync(kBarConsumer, kConsumerThreads);   // the previous item's result rows (in q) are stored
      wg::issue_q_copies<kRows>(prm, cx, H, sm.q, tid, kConsumerThreads);
      KDTREE_SKSTART(k == 0 && tid == 0, 1);
      cp_async_wait_all();   // this thread's q copies (the consumer issues no other cp.async)
      fence_proxy_async();   // read next by wgmma (the async proxy)
      bar_sync(kBarConsumer, kConsumerThreads);
      KDTREE_SKSTART(k == 0 && tid == 0, 2);

      int rn[4];   // verify token of each of the thread's four columns (-1: a padding row)
#pragma unroll
      for (int q = 0; q < 4; ++q) rn[q] = row_token(cx, col_of(c, q), H);
      const float scale[4] = {prm.scale_log2, prm.scale_log2, prm.scale_log2, prm.scale_log2};
      float m_run[4], l_part[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        m_run[q] = -INFINITY;
        l_part[q] = 0.f;
      }
      float o[kVBlocks][8];
#pragma unroll
      for (int mb = 0; mb < kVBlocks; ++mb)
#pragma unroll
        for (int i = 0; i < 8; ++i) o[mb][i] = 0.f;

      for (int t = 0; t < cx.ntiles; ++t) {
        const int key_base = cx.k0 + t * kTileN;   // the tile's keys: [key_base, min(key_base + 64, k1))
        const int b = seq % kStages;
        mbar_wait(&sm.full[b], (seq / kStages) & 1);   // every producer thread's copies landed
        KDTREE_SKSTART(k == 0 && tid == 0 && t == 0, 3);
        fence_proxy_async();   // cp.async wrote the tile (generic proxy); wgmma reads it (async proxy)
        const uint32_t kv = smem_u32(&sm.kv[b][0]);
        float s[8];
        km::scores_t<kRows, kSlabBytes, kQSlabBytes>(s, kv, qd);
        KDTREE_SKSTART(k == 0 && tid == 0 && t == 0, 4);
        float alpha[4];
        column_softmax(prm, cx, key_base, rn, scale, true, s, m_run, l_part, alpha, sm.red, warp, g, c,
                       PtBf16{sm.p, warp, g, c});
        rescale_o_t(o, alpha);
        km::values_t<kRows, kVBlocks, kSlabBytes, kPvSteps>(o, kv, pd);
        mbar_arrive(&sm.empty[b]);   // release: the producer refills the buffer
        ++seq;
      }

      // end of the item: the column sums over the warpgroup, O^T / l staged as the item's bf16 rows, then stored
      store_item(prm, cx, H, o, m_run, l_part, 1.f, sm.lred, sm.row_m, sm.row_l, sm.q, tid,
                 [](int mb, int w, int g, int h) { return mb * kSlabDims + w * 16 + g + 8 * h; });
      KDTREE_SKSTART(k == 0 && tid == 0, 5);
      KDTREE_SKTRACE_ITEM(k == 0 && tid == 0, item, cx.ntiles);
    }
  } else {
    // =========================== producer warpgroup ===========================
    km::key_producer<kRows, kTileN, kStages, kProducerThreads>(sm, prm, tid - kConsumerThreads, total, fetch_item);
  }
#else
  __trap();   // built without sm_90a: the launcher never selects this kernel
#endif
}

}  // namespace sk
}  // namespace kdtree
