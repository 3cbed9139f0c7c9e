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
  unsigned char q[kSlabs * kQSlabBytes];   // 18,432: q of the item, [slab][row][128 B]
  unsigned char p[kRows * 128];            // P^T of the latest tile: [row][64 keys], 128-byte swizzle
  __nv_bfloat16 stage[kRows * kDimNope];   // the item's result rows, staged for 16-byte stores
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

  if (tid == 0) {
    for (int b = 0; b < kStages; ++b) {
      mbar_init(&sm.full[b], kProducerThreads);
      mbar_init(&sm.empty[b], kConsumerThreads);
    }
    for (int i = 0; i < 2; ++i) {
      mbar_init(&sm.item_full[i], 1);
      mbar_init(&sm.item_empty[i], kThreads);
    }
    fence_proxy_async();
  }
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
      wg::issue_q_copies<kRows>(prm, cx, H, sm.q, tid, kConsumerThreads);
      KDTREE_SKSTART(k == 0 && tid == 0, 1);
      cp_async_wait_all();   // this thread's q copies (the consumer issues no other cp.async)
      fence_proxy_async();   // read next by wgmma (the async proxy)
      bar_sync(kBarConsumer, kConsumerThreads);
      KDTREE_SKSTART(k == 0 && tid == 0, 2);

      int rn[4];   // verify token of each of the thread's four columns (-1: a padding row)
#pragma unroll
      for (int q = 0; q < 4; ++q) rn[q] = row_token(cx, col_of(c, q), H);
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
        ItemCtx tcx = cx;   // the tile's keys: [k0 + 64 t, k1)
        tcx.k0 = cx.k0 + t * kTileN;
        const int b = seq % kStages;
        mbar_wait(&sm.full[b], (seq / kStages) & 1);   // every producer thread's copies landed
        KDTREE_SKSTART(k == 0 && tid == 0 && t == 0, 3);
        fence_proxy_async();   // cp.async wrote the tile (generic proxy); wgmma reads it (async proxy)
        const uint32_t kv = smem_u32(&sm.kv[b][0]);
        float s[8];
        km::scores_t<kRows, kSlabBytes, kQSlabBytes>(s, kv, qd);
        KDTREE_SKSTART(k == 0 && tid == 0 && t == 0, 4);
        // scale to log2 units, mask (a tile of prefix keys inside the split needs none), column maxima
        const int key_base = tcx.k0;
        const bool plain = key_base + kTileN <= tcx.k1 && key_base + kTileN <= cx.rp.p;
        const int key0 = key_base + warp * 16 + g;
        float cm[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int q = col_q(i);
          s[i] = (plain || key_visible_n(prm, tcx, key0 + 8 * ((i >> 1) & 1), rn[q]))
                     ? s[i] * prm.scale_log2
                     : -INFINITY;
          cm[q] = fmaxf(cm[q], s[i]);
        }
        km::reduce_over_key_rows(cm, km::fmax_op);
        if (g == 0) {
#pragma unroll
          for (int q = 0; q < 4; ++q) sm.red[warp][col_of(c, q)] = cm[q];
        }
        bar_sync(kBarConsumer, kConsumerThreads);   // (the reads below end before this tile's P barrier, which
                                                    // every thread passes before it writes red again)
        float m_use[4], alpha[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int col = col_of(c, q);
          const float tmax = fmaxf(fmaxf(sm.red[0][col], sm.red[1][col]), fmaxf(sm.red[2][col], sm.red[3][col]));
          const float m_new = fmaxf(m_run[q], tmax);
          m_use[q] = m_new == -INFINITY ? 0.f : m_new;
          alpha[q] = fast_exp2(m_run[q] - m_use[q]);
          m_run[q] = m_new;
        }
        // P^T into shared memory (the previous tile's O^T product is complete: every thread waited for it before
        // the barrier above), the column sums advanced
        float ps[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int q = col_q(i);
          const float pv = fast_exp2(s[i] - m_use[q]);
          ps[q] += pv;
          *reinterpret_cast<__nv_bfloat16*>(&sm.p[km::pt_offset(col_of(c, q), warp * 16 + g + 8 * km::row_half(i))]) =
              __float2bfloat16(pv);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) l_part[q] = l_part[q] * alpha[q] + ps[q];
        fence_proxy_async();   // P^T is read next by wgmma (the async proxy)
        bar_sync(kBarConsumer, kConsumerThreads);
        if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f && alpha[2] == 1.f && alpha[3] == 1.f)) {
#pragma unroll
          for (int mb = 0; mb < kVBlocks; ++mb)
#pragma unroll
            for (int i = 0; i < 8; ++i) o[mb][i] *= alpha[col_q(i)];
        }
        km::values_t<kRows, kVBlocks, kSlabBytes, kPvSteps>(o, kv, pd);
        mbar_arrive(&sm.empty[b]);   // release: the producer refills the buffer
        ++seq;
      }

      // end of the item: the column sums over the warpgroup, O^T / l staged as the item's bf16 rows, then stored
      km::reduce_over_key_rows(l_part, km::add_op);
      if (g == 0) {
#pragma unroll
        for (int q = 0; q < 4; ++q) sm.lred[warp][col_of(c, q)] = l_part[q];
      }
      bar_sync(kBarConsumer, kConsumerThreads);
      float inv[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int col = col_of(c, q);
        const float l = (sm.lred[0][col] + sm.lred[1][col]) + (sm.lred[2][col] + sm.lred[3][col]);
        inv[q] = l > 0.f ? 1.f / l : 0.f;
        if (warp == 0 && g == 0) {
          sm.row_m[col] = m_run[q];
          sm.row_l[col] = l;
        }
      }
#pragma unroll
      for (int mb = 0; mb < kVBlocks; ++mb)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int dim = mb * kSlabDims + warp * 16 + g + 8 * ((i >> 1) & 1);
          sm.stage[col_of(c, col_q(i)) * kDimNope + dim] = __float2bfloat16(o[mb][i] * inv[col_q(i)]);
        }
      bar_sync(kBarConsumer, kConsumerThreads);
      for (int idx = tid; idx < cx.rows * (kDimNope / 8); idx += kConsumerThreads) {
        const int r = idx / (kDimNope / 8), ch = idx - r * (kDimNope / 8);
        *reinterpret_cast<uint4*>(result_row(prm, cx, r) + ch * 8) =
            *reinterpret_cast<const uint4*>(&sm.stage[r * kDimNope + ch * 8]);
      }
      if (cx.rp.nsplit > 1 && tid < cx.rows) write_partial_lse(prm, cx, H, tid, sm.row_m[tid], sm.row_l[tid]);
      KDTREE_SKSTART(k == 0 && tid == 0, 5);
      KDTREE_SKTRACE_ITEM(k == 0 && tid == 0, item, cx.ntiles);
      // (stage, lred and the row statistics are written again only after the next item's barriers)
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
