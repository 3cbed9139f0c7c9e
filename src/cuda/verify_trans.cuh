// verify_trans.cuh: an sm_90a split pass with both products transposed ("trans"), 48-row work items. Opt-in
// (KDTREE_SPLIT_KERNEL=trans), never chosen by default: measured slower than the default kernels on every shape
// (H200, session 14, PERF_LOG history 102-105: H16 N9 P131072 155 us against the dual kernel's 135).
//
// Why (docs/PERF_LOG.md, next step 5): the dual kernel's items are one wgmma M of 64 rows, so H16 N9's 144 rows take
// three items of 64 + 64 + 16, and the third reads every key of its split for 16 rows (192 row slots for 144 rows).
// With the keys as the wgmma M, as in the skinny kernel, the rows are the wgmma N, which may be any multiple of 8:
// 48-row items cut 144 rows into 3 x 48 with no padding row (H8 N9: 48 + 24, H32 N9: 6 x 48). Session 8's 72-row
// "rows" kernel (history 67) was 80% slower than the wgmma kernel because q for 72 rows left room for only two key
// stages, which puts the gather's latency on every tile (history 57: 2 stages +58%, 3 as fast as 4). 48 rows of q
// (54 KB) leave room for three.
// Per 48-key tile:
// - S^T = K q^T: 36 wgmma m64n48k16 by the score warpgroup, A = the key tile (K-major; the wgmma M is 64 keys, so
//   rows 48-63, warp 3's, read the next 2 KB of shared memory and are masked), B = q (48 rows = N, K-major);
// - the online softmax down the columns (a query row is a column): the column maxima meet over the 4 warps in shared
//   memory; P^T (bf16) goes to shared memory, [row][keys] in the 128-byte swizzle, with the columns' rescale factors;
// - O^T += V^T P^T by two value warpgroups, each owning 256 of the 512 value dims (4 blocks x 3 k-steps of wgmma
//   m64n48k16, A = the same key tile read MN-major, B = P^T): 96 fp32 per thread;
// - a producer warpgroup gathers the keys (cp.async into the swizzled layout, eight threads per key as the other
//   kernels) into 3 stages of 54 KB, and runs on into the next item while the others end the current one.
// Shared memory: q 55,296 + keys 165,888 + P^T 6,144 + statistics and mbarriers = 230,696 B, 231,720 with the 1 KB
// alignment slack, of the 232,448 a block may take. One P^T buffer: a second does not fit, so the score warpgroup
// writes P^T(t + 1) only after both value warpgroups are done with P^T(t) (p_empty); it has S^T(t + 1) to compute in
// between.
// Predicted in session 13: a 48-key tile every ~2,500 clocks, H16 N9 P131072 ~100 us. Measured (session 14): a tile
// every ~4,200 clocks, 155 us. What sets the period (ncu source counters, knock-outs, history 103-105): the one score
// warpgroup issues ~890 instructions per tile per warp at ~4.7 clocks each (one warp per scheduler: little to hide
// latency with), and the single P^T buffer puts O^T on its chain (P^T(t + 1) waits for O^T(t)): knocking out S^T or
// O^T saves ~23 us each, both ~44. The value warpgroups wait for P^T 62% of the time. Two score warpgroups (one
// value warpgroup of 192 fp32 for all 512 dims) or a second P^T buffer would be the next form; neither fits as laid
// out here (registers; ~700 B of shared memory left).
// Plan, partials and combine are every split kernel's, with 48-row items and 48-key tiles (prm.block_m / tile_n).
#pragma once

#include "verify_wgmma.cuh"

namespace kdtree {
namespace tr {

using wg::SmemDesc;
using wg::kSlabs;      // 9 slabs of 64 dims
using wg::kSlabDims;   // 64

constexpr int kRows = 48;                          // rows per item: the wgmma N
constexpr int kTileN = 48;                         // keys per tile (the wgmma M is 64: rows 48-63 are masked)
constexpr int kStages = 3;
constexpr int kThreads = 512;                      // score, value 0, value 1, producer
constexpr int kValueThreads = 256;
constexpr int kProducerThreads = 128;
constexpr int kSlabBytes = kTileN * 128;           // 6,144: one 64-dim slab of a tile
constexpr int kTileBytes = kSlabs * kSlabBytes;    // 55,296
constexpr int kQSlabBytes = kRows * 128;           // 6,144
constexpr int kPvSteps = kTileN / 16;              // 3
constexpr int kVBlocks = kDimNope / kSlabDims / 2; // 4 blocks of 64 value dims per value warpgroup
constexpr int kAcc = kRows / 2;                    // 24 fp32 per thread in an m64n48 accumulator
constexpr int kCols = kRows / 4;                   // 12: the query rows (accumulator columns) a thread holds
constexpr int kValidWarps = kTileN / 16;           // 3: warps 0-2 hold the tile's keys in S^T, warp 3 the masked rows
// setmaxnreg: the launch's 4 x 128 per thread redistributed (every warpgroup changes its count): the value warpgroups
// spill at 128 (96 of O^T) and are given 160; the score warpgroup holds two S^T accumulators (S^T(t + 1) runs beside
// tile t's softmax) and is given 144; the producer 48 (ptxas, CUDA 13.0: 152 / 160 / 40 and 136 / 168 / 40 spill 8
// bytes, 144 / 168 / 32 36)
constexpr int kLaunchRegs = 65536 / kThreads;   // 128: one block of 512 threads per SM
constexpr int kScoreRegs = 144;
constexpr int kValueRegs = 160;
constexpr int kProducerRegs = 48;
static_assert(kScoreRegs + 2 * kValueRegs + kProducerRegs <= 4 * kLaunchRegs, "register pool");
constexpr int kBarPFull = 2;    // score warpgroup arrives, value warpgroups wait: the wake-up for P^T (p_full orders)
constexpr int kBarScore = 3;    // the score warpgroup: q landed; a tile's column maxima; the item's column sums

static_assert(kTileN % 16 == 0 && kTileN <= 64 && kRows % 8 == 0 && kRows <= 256, "wgmma m64nNk16 shapes");
static_assert((kTileN * 128) % 1024 == 0 && (kRows * 128) % 1024 == 0, "swizzle atoms stay 1 KB aligned");

struct Smem {
  unsigned char q[kSlabs * kQSlabBytes];   // 55,296: q of the item, [slab][row][128 B] (the struct sits on 1 KB)
  unsigned char kv[kStages][kTileBytes];   // 165,888: [stage][slab][key][128 B]
  unsigned char p[kRows * 128];            // 6,144: P^T of the latest tile, [row][64 keys (48 used)], 128-byte
                                           //   swizzle; also the 2 KB that S^T's masked rows read past the last stage
  float red[2][4][kRows];                  // per-warp column maxima, by tile parity
  float lred[4][kRows];                    // per-warp column sums at the end of an item
  float alpha[kRows];                      // the latest tile's rescale factors
  float row_m[2][kRows], row_l[2][kRows];  // the row statistics of the block's item k in [k % 2]: the score
                                           //   warpgroup may end item k + 1 before the value warpgroups read k's
  unsigned long long full[kStages];        // tile landed: 128 producer arrivals (cp.async.mbarrier.arrive)
  unsigned long long empty[kStages];       // tile consumed: 256 value-thread arrivals
  unsigned long long p_full;               // P^T / alpha published: 128 score-thread arrivals (release)
  unsigned long long p_empty;              // P^T / alpha read: 256 value-thread arrivals (release)
  unsigned long long stats_full[2];        // item k's row_m / row_l [k % 2] stored: 128 score-thread arrivals
  unsigned long long stats_empty[2];       // ... and read: 256 value-thread arrivals
  unsigned long long item_full[2];         // the block's item k stored in item[k % 2] (wg::fetch_item_ahead)
  unsigned long long item_empty[2];
  int item[2];
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;   // + room to align the base to 1 KB
static_assert(kSmemBytes <= 232448, "sm_90 gives a block at most 227 KB of shared memory");
static_assert(offsetof(Smem, p) == offsetof(Smem, kv) + sizeof(Smem::kv) && sizeof(Smem::p) >= (64 - kTileN) * 128,
              "S^T's masked rows of the last stage's last slab read P^T's bytes (finite or masked), inside the struct");

using km::acc_index;   // the accumulator mapping of kernels with the keys as the wgmma M (verify_wgmma.cuh)
using km::col_of;
using km::col_q;
using km::row_half;

__global__ void __launch_bounds__(kThreads, 1) kdtree_verify_split_trans_kernel(Params prm) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem& sm = wg::smem_1k<Smem>(smem_raw);
  const int tid = threadIdx.x;
  const int warp = (tid >> 5) & 3;   // warp within its warpgroup
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int c = lane & 3;
  grid_dependency_launch_dependents();
  grid_dependency_wait();   // the plan kernel's counter and plan
  const int total = prm.counter[1];
  const int H = prm.heads;

  if (tid == 0) {
    for (int b = 0; b < kStages; ++b) {
      mbar_init(&sm.full[b], kProducerThreads);
      mbar_init(&sm.empty[b], kValueThreads);
    }
    mbar_init(&sm.p_full, 128);
    mbar_init(&sm.p_empty, kValueThreads);
    for (int i = 0; i < 2; ++i) {
      mbar_init(&sm.stats_full[i], 128);
      mbar_init(&sm.stats_empty[i], kValueThreads);
      mbar_init(&sm.item_full[i], 1);
      mbar_init(&sm.item_empty[i], kThreads);
    }
    fence_proxy_async();
  }
  __syncthreads();

  constexpr int kProducer = 128 + kValueThreads;   // the producer warpgroup's first thread claims the items
  auto fetch_item = [&](int k) {
    return wg::fetch_item_ahead(prm, k, tid, kProducer, sm.item, sm.item_full, sm.item_empty);
  };

  if (tid < 128) {
    // =========================== score warpgroup ===========================
    wg::set_max_regs<kScoreRegs, kLaunchRegs>();
    const SmemDesc qd(smem_u32(&sm.q[0]), 16, 1024);
    uint32_t seq = 0;   // tiles of this block: buffer seq % 3, phase seq / 3; P^T round seq
    for (int k = 0;; ++k) {
      const int item = fetch_item(k);
      if (item >= total) return;
      const ItemCtx cx = item_ctx<kRows, kTileN>(prm, item);
      wg::issue_q_copies<kRows>(prm, cx, H, sm.q, tid, 128);
      cp_async_wait_all();   // this thread's q copies (the score warpgroup issues no other cp.async)
      fence_proxy_async();   // read next by wgmma (the async proxy)
      bar_sync(kBarScore, 128);

      float m_run[kCols], l_part[kCols];
#pragma unroll
      for (int q = 0; q < kCols; ++q) {
        m_run[q] = -INFINITY;
        l_part[q] = 0.f;
      }
      // S^T runs one tile ahead of the softmax, as in the dual kernel: S^T(t + 1) is issued in three pieces between
      // the parts of tile t's softmax, so that the tensor cores compute it while this warpgroup does the softmax (a
      // warpgroup that waited for each S^T left the value warpgroups waiting for P^T two thirds of the time, ncu,
      // PERF_LOG history 103; issuing all 36 at once blocks once a few are queued). No branch between the pieces of
      // one wgmma group (ptxas would serialise them, C7518 / C7520): the loop runs every tile but the last.
      float s[kAcc], sn[kAcc];
      float alpha[kCols], m_use[kCols];
      auto s_begin = [&](uint32_t tile_seq) {   // the tile landed, fenced into the async proxy
        const int bt = tile_seq % kStages;
        mbar_wait(&sm.full[bt], (tile_seq / kStages) & 1);   // every producer thread's copies landed
        fence_proxy_async();   // cp.async wrote the tile (generic proxy); wgmma reads it (async proxy)
        return smem_u32(&sm.kv[bt][0]);
      };
      // softmax of tile t, part 1: scale to log2 units, mask (a tile of prefix keys inside the split needs none; warp
      // 3's rows are past the tile), column maxima over the warpgroup, the running maxima and the rescale factors.
      // The masked loop apart, so that the plain one is a short straight run of code (one loop with a mask test per
      // value laid the 24 masked paths between the plain ones: instruction-fetch stalls, history 103).
      auto softmax_max = [&](int t) {
        const int key_base = cx.k0 + t * kTileN;
        const bool plain = key_base + kTileN <= cx.k1 && key_base + kTileN <= cx.rp.p;
        const int key0 = key_base + warp * 16 + g;
        float cm[kCols];
#pragma unroll
        for (int q = 0; q < kCols; ++q) cm[q] = -INFINITY;
        if (warp < kValidWarps) {   // warp-uniform
          if (plain) {
#pragma unroll
            for (int i = 0; i < kAcc; ++i) {
              s[i] *= prm.scale_log2;
              cm[col_q(i)] = fmaxf(cm[col_q(i)], s[i]);
            }
          } else {
#pragma unroll
            for (int i = 0; i < kAcc; ++i) {
              const int q = col_q(i);
              s[i] = key_visible_n(prm, cx, key0 + 8 * row_half(i), row_token(cx, col_of(c, q), H))
                         ? s[i] * prm.scale_log2
                         : -INFINITY;
              cm[q] = fmaxf(cm[q], s[i]);
            }
          }
        }
        km::reduce_over_key_rows(cm, km::fmax_op);
        float (&red)[4][kRows] = sm.red[seq & 1];   // (a warp writes this parity again two tiles on, after every
                                                    //  warp has passed the next tile's barrier, so after its reads)
        if (g == 0) {
#pragma unroll
          for (int q = 0; q < kCols; ++q) red[warp][col_of(c, q)] = cm[q];
        }
        bar_sync(kBarScore, 128);
#pragma unroll
        for (int q = 0; q < kCols; ++q) {
          const int col = col_of(c, q);
          const float tmax = fmaxf(fmaxf(red[0][col], red[1][col]), fmaxf(red[2][col], red[3][col]));
          const float m_new = fmaxf(m_run[q], tmax);
          m_use[q] = m_new == -INFINITY ? 0.f : m_new;
          alpha[q] = fast_exp2(m_run[q] - m_use[q]);
          m_run[q] = m_new;
        }
      };
      // part 2: once the value warpgroups are done with the previous tile's P^T and alpha (the block's first tile has
      // no predecessor), P^T of tile t into shared memory and the column sums advanced
      auto softmax_p = [&]() {
        if (seq > 0) mbar_wait(&sm.p_empty, (seq - 1) & 1);
        float ps[kCols];
#pragma unroll
        for (int q = 0; q < kCols; ++q) ps[q] = 0.f;
        if (warp < kValidWarps) {
#pragma unroll
          for (int i = 0; i < kAcc; ++i) {
            const int q = col_q(i);
            const float pv = fast_exp2(s[i] - m_use[q]);
            ps[q] += pv;
            *reinterpret_cast<__nv_bfloat16*>(&sm.p[km::pt_offset(col_of(c, q), warp * 16 + g + 8 * row_half(i))]) =
                __float2bfloat16(pv);
          }
        }
#pragma unroll
        for (int q = 0; q < kCols; ++q) l_part[q] = l_part[q] * alpha[q] + ps[q];
      };
      // part 3: P^T and alpha published: the mbarrier carries the release, the named barrier the wake-up
      auto publish = [&]() {
        if (warp == 0 && g == 0) {
#pragma unroll
          for (int q = 0; q < kCols; ++q) sm.alpha[col_of(c, q)] = alpha[q];
        }
        fence_proxy_async();   // P^T is read next by wgmma (the async proxy); alpha by plain loads
        mbar_arrive(&sm.p_full);
        bar_arrive(kBarPFull, 128 + kValueThreads);
      };
      using K0 = std::integral_constant<int, 0>;
      using K1 = std::integral_constant<int, kDimQK / 16 / 3>;
      using K2 = std::integral_constant<int, 2 * kDimQK / 16 / 3>;
      using K3 = std::integral_constant<int, kDimQK / 16>;
      if (cx.ntiles > 0) {
        const uint32_t kv = s_begin(seq);
        wg::wg_fence();
        km::scores_t_steps<kRows, kSlabBytes, kQSlabBytes>(s, kv, qd, K0{}, K3{});
        wg::wg_commit();
        wg::wg_wait0();
      }
      int t = 0;
      for (; t + 1 < cx.ntiles; ++t, ++seq) {
        const uint32_t kv = s_begin(seq + 1);
        wg::wg_fence();
        km::scores_t_steps<kRows, kSlabBytes, kQSlabBytes>(sn, kv, qd, K0{}, K1{});
        softmax_max(t);
        wg::wg_fence();
        km::scores_t_steps<kRows, kSlabBytes, kQSlabBytes>(sn, kv, qd, K1{}, K2{});
        softmax_p();
        wg::wg_fence();
        km::scores_t_steps<kRows, kSlabBytes, kQSlabBytes>(sn, kv, qd, K2{}, K3{});
        wg::wg_commit();
        publish();
        wg::wg_wait0();
#pragma unroll
        for (int i = 0; i < kAcc; ++i) s[i] = sn[i];
      }
      if (t < cx.ntiles) {   // the last tile
        softmax_max(t);
        softmax_p();
        publish();
        ++seq;
      }

      // end of the item: the column sums over the warpgroup, the row statistics for the value warpgroups, and for a
      // split request each row's partial log2-sum-exp
      km::reduce_over_key_rows(l_part, km::add_op);
      if (g == 0) {
#pragma unroll
        for (int q = 0; q < kCols; ++q) sm.lred[warp][col_of(c, q)] = l_part[q];
      }
      bar_sync(kBarScore, 128);
      // row_m / row_l [k % 2] held item k - 2's statistics until the value warpgroups read them (stats_empty); they
      // are published on stats_full (an mbarrier, as racecheck reported a hazard on them across the 384-thread named
      // barrier that published them in the first version, history 102). lred is written again only after the next
      // item's barriers.
      if (k >= 2) mbar_wait(&sm.stats_empty[k & 1], ((k >> 1) - 1) & 1);
      if (warp == 0 && g == 0) {
#pragma unroll
        for (int q = 0; q < kCols; ++q) {
          const int col = col_of(c, q);
          sm.row_m[k & 1][col] = m_run[q];
          sm.row_l[k & 1][col] = (sm.lred[0][col] + sm.lred[1][col]) + (sm.lred[2][col] + sm.lred[3][col]);
        }
      }
      mbar_arrive(&sm.stats_full[k & 1]);
      mbar_wait(&sm.stats_full[k & 1], (k >> 1) & 1);
      if (cx.rp.nsplit > 1 && tid < cx.rows)
        write_partial_lse(prm, cx, H, tid, sm.row_m[k & 1][tid], sm.row_l[k & 1][tid]);
    }
  } else if (tid < kProducer) {
    // =========================== value warpgroups ===========================
    wg::set_max_regs<kValueRegs, kLaunchRegs>();
    const int v = (tid - 128) >> 7;   // value dims [256 v, 256 v + 256)
    const SmemDesc pd(smem_u32(&sm.p[0]), 16, 1024);
    uint32_t seq = 0;
    for (int k = 0;; ++k) {
      const int item = fetch_item(k);
      if (item >= total) return;
      const ItemCtx cx = item_ctx<kRows, kTileN>(prm, item);
      float o[kVBlocks][kAcc];
#pragma unroll
      for (int mb = 0; mb < kVBlocks; ++mb)
#pragma unroll
        for (int i = 0; i < kAcc; ++i) o[mb][i] = 0.f;

      for (int t = 0; t < cx.ntiles; ++t, ++seq) {
        const int b = seq % kStages;
        bar_sync(kBarPFull, 128 + kValueThreads);   // P^T / alpha of this tile: wake up ...
        mbar_wait(&sm.p_full, seq & 1);              // ... and acquire (complete by now)
        mbar_wait(&sm.full[b], (seq / kStages) & 1);  // landed (the score warpgroup saw it already)
        fence_proxy_async();   // the tile's V is read by wgmma (the async proxy)
        bool ones = true;
#pragma unroll
        for (int q = 0; q < kCols; ++q) ones = ones && sm.alpha[col_of(c, q)] == 1.f;
        if (!__all_sync(0xffffffffu, ones)) {
#pragma unroll
          for (int q = 0; q < kCols; ++q) {
            const float a = sm.alpha[col_of(c, q)];
#pragma unroll
            for (int mb = 0; mb < kVBlocks; ++mb) {
              o[mb][acc_index(q, 0)] *= a;
              o[mb][acc_index(q, 1)] *= a;
            }
          }
        }
        const uint32_t kv = smem_u32(&sm.kv[b][0]) + (kVBlocks * v) * kSlabBytes;
        km::values_t<kRows, kVBlocks, kSlabBytes, kPvSteps>(o, kv, pd);
        mbar_arrive(&sm.p_empty);    // release: the score warpgroup writes P^T / alpha again
        mbar_arrive(&sm.empty[b]);   // release: the producer refills the buffer
      }

      // end of the item: O^T / l as the item's bf16 rows (each thread's 12 rows x 8 dims per value block)
      mbar_wait(&sm.stats_full[k & 1], (k >> 1) & 1);   // row_l stored by the score warpgroup
#pragma unroll
      for (int q = 0; q < kCols; ++q) {
        const int col = col_of(c, q);
        if (col < cx.rows) {
          const float l = sm.row_l[k & 1][col];
          const float inv = l > 0.f ? 1.f / l : 0.f;
          __nv_bfloat16* dst = result_row(prm, cx, col) + 256 * v + warp * 16 + g;
#pragma unroll
          for (int mb = 0; mb < kVBlocks; ++mb) {
            dst[mb * kSlabDims] = __float2bfloat16(o[mb][acc_index(q, 0)] * inv);
            dst[mb * kSlabDims + 8] = __float2bfloat16(o[mb][acc_index(q, 1)] * inv);
          }
        }
      }
      mbar_arrive(&sm.stats_empty[k & 1]);   // row_l [k % 2] read: item k + 2's may be stored
    }
  } else {
    // =========================== producer warpgroup ===========================
    wg::set_max_regs<kProducerRegs, kLaunchRegs>();
    km::key_producer<kRows, kTileN, kStages, kProducerThreads>(sm, prm, tid - kProducer, total, fetch_item);
  }
#else
  __trap();   // built without sm_90a: the launcher never selects this kernel
#endif
}

}  // namespace tr
}  // namespace kdtree
