// verify_skinny_fp8.cuh: the skinny kernel (verify_skinny.cuh) over an FP8 (e4m3) pool, sm_90a: calls of at most 16
// rows per request (one verify token at H16, H8 N2, ...), whose time is the delivery of the keys: 576 bytes a key
// here against the bf16 kernel's 1,152.
//
// The products are the skinny kernel's, S^T = K q^T and O^T = V^T P^T with 64 keys (value dims) as the wgmma M and the
// item's 16 rows as N, in e4m3 (wgmma m64n16k32), with their A operand from registers: wgmma reads an e4m3 operand from
// shared memory only K-major, which the keys are for S^T but not for O^T, and registers take any layout. Per 64-key
// tile:
// - the producer lands each key's 576-byte row in the stage, one bulk copy a key (592-byte pitch: the 8 rows of an
//   ldmatrix fall in distinct bank groups);
// - S^T: one ldmatrix.x4 (b16) of the warp's 16 keys x 32 bytes is the A fragment of a k32 step as it stands; B = q's
//   two e4m3 terms, q = 2^e (hi + lo) (verify_q8.cuh, written once per call by the prep kernel): two wgmma a step,
//   scores within bf16's precision of q . k;
// - O^T: ldmatrix.trans (b16) of keys 0-7, 8-15, 16-23, 24-31 x the warp's 16 value bytes gives a thread keys 2c, 2c + 1
//   of each x dims 2g, 2g + 1; two byte permutes a matrix pair make 4 keys at one dim, so the A fragment's rows g / g + 8
//   are value dims 2g / 2g + 1 of the warp's 16 and its k positions 4c .. 4c + 3 are keys 2c, 2c + 1, 8 + 2c, 9 + 2c
//   (+ 16 for 16 + 4c ..), the order P^T is stored in (p8_offset); B = 448 P in two e4m3 terms, hi + lo (two wgmma a
//   step), and the column sums add exactly the values stored;
// - no value is converted: the tile's only ALU work besides the softmax is 4 byte permutes per k32 step of O^T;
// - scores scale by k_scale and q's 2^e, outputs by v_scale / 448 (SGLang's k_descale / v_descale).
// Draft items (the drafts stand apart: bf16 keys from k_new, unscaled) take the same structure in bf16 (wgmma
// m64n16k16): 32 keys a tile (1,168-byte pitch; warps 2 and 3 hold no keys and feed zeros), A fragments straight from
// ldmatrix, q from q_nope / q_pe, P^T in bf16. Plan, partials and combine are the skinny kernel's (16-row items, 64-key
// tiles).
//
// Two consumer warpgroups (Consumers = 2): calls of 17 to 32 rows per request (H8 N4, the multi-token-prediction verify
// of GLM-5.x at TP8; H16 N2) run 32-row items, each consumer warpgroup the work above on its own 16 rows of every
// tile the producer lands, so that a key crosses into the SM once for 32 rows. The dual kernel's FP8 form pays a 64-row
// item's chain for them and a 16-row kernel two items a key. The launch's 168 registers a thread (384 threads) move
// by setmaxnreg to 232 for the consumers and 40 for the producer.
#pragma once

#include "verify_skinny.cuh"

namespace kdtree {
namespace sk8 {

using sk::kBarConsumer;
using sk::kConsumerThreads;
using sk::kProducerThreads;
using sk::kQSlabBytes;
using sk::kRows;
using sk::kTileN;
using sk::kVBlocks;
using wg::SmemDesc;

constexpr int kStages = 4;
constexpr int kDraftKeys = 32;                // keys of a draft tile
constexpr int kPitch16 = kKeyBytes + 16;      // 1,168 B a staged bf16 draft key (73 units)
constexpr int kStageBytes = kTileN * kKeyPitch8;   // 37,888
static_assert(kDraftKeys * kPitch16 <= kStageBytes, "a draft tile fits a stage");
static_assert((kPitch16 / 16) % 2 == 1, "ldmatrix rows in distinct bank groups");
static_assert(kDraftKeys % 16 == 0 && kDraftKeys <= kTileN, "draft tiles: whole warps of keys");

// The block of a kernel with `Consumers` consumer warpgroups (each 16 rows of the item) and the producer warpgroup.
template <int Consumers>
constexpr int kThreads = (Consumers + 1) * 128;
template <int Consumers>
constexpr int kLaunchRegs = (65536 / kThreads<Consumers>) / 8 * 8;   // 168 with two consumers: one block per SM
constexpr int kConsumerRegs = 232;                                     // with two consumers (setmaxnreg)
constexpr int kProducerRegs = 40;
static_assert(2 * kConsumerThreads * kConsumerRegs + kProducerThreads * kProducerRegs <= 65536 &&
                  2 * (kConsumerRegs - kLaunchRegs<2>) <= kLaunchRegs<2> - kProducerRegs,
              "setmaxnreg within the block's registers: what the producer gives back covers what the consumers take");

template <int Consumers>
struct Smem {
  unsigned char kv[kStages][kStageBytes];         // 151,552: the staged key rows
  // 18,432 a consumer: q of its rows, bf16 or its e4m3 terms, [slab][row][128 B]; after the item's last product, its
  // result rows, staged as bf16 for 16-byte stores. (A buffer of their own, 16 KB more, measured slower on an H100,
  // e4m3 pool, two rounds each, alternating: H16 N1 P131072 56.9 against 56.0 us, P8192 24.0 against 22.5, P32768
  // 31.1 against 30.0, P185000 69.0 against 68.4; which resource the 16 KB cost was not isolated.)
  unsigned char q[Consumers][wg::kSlabs * kQSlabBytes];
  unsigned char p[Consumers][2][kRows * 128];     // P^T of the latest tile: bf16, or e4m3 hi and lo (128-byte swizzle)
  float red[Consumers][4][kRows];
  float lred[Consumers][4][kRows];
  float row_m[Consumers][kRows], row_l[Consumers][kRows];
  unsigned long long full[kStages];               // tile landed: 1 arrival (expect_tx) + the copies' bytes
  unsigned long long empty[kStages];              // tile consumed: 128 arrivals a consumer warpgroup
  unsigned long long item_full[2];
  unsigned long long item_empty[2];
  int item[2];
};
template <int Consumers>
constexpr size_t kSmemBytes = sizeof(Smem<Consumers>) + 1024;   // + room to align the base to 1 KB
static_assert(kSmemBytes<2> <= 232448, "sm_90 gives a block at most 227 KB of shared memory");
static_assert((kStages * kStageBytes) % 1024 == 0 && (wg::kSlabs * kQSlabBytes) % 1024 == 0 &&
                  (kRows * 128) % 1024 == 0,
              "q and P^T on 1 KB atoms");
static_assert(kQ8RowBytes == kKeyBytes, "a row of q's e4m3 terms takes the bytes of a bf16 row");

// D[64 x 16] += A[64 x 32] (registers) * B[32 x 16] (shared memory, K-major), e4m3, fp32 accumulate.
__device__ __forceinline__ void wgmma_m64n16k32_e4m3_rs(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
// D[64 x 16] += A[64 x 16] (registers) * B[16 x 16] (shared memory, K-major), bf16, fp32 accumulate.
__device__ __forceinline__ void wgmma_m64n16k16_bf16_rs(float (&d)[8], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// The descriptor of the 32 bytes of q's rows at byte `off` of a row (B of S^T): a k16 step of bf16 q, or a k32 step of
// an e4m3 term (hi at 0, lo at 576).
__device__ __forceinline__ uint64_t q_at(const SmemDesc& qd, int off) {
  return qd.at((off >> 7) * kQSlabBytes + (off & 127));
}

// A product whose A fragments come from registers, in NG groups of Steps fragments: load(grp, a) fills group grp's
// fragments (ldmatrix, byte permutes), mma(grp, a) issues its wgmmas. Two groups are in flight: a group's loads run
// while the wgmmas of the one before execute, and its registers are written again once their group has completed
// (wait_group 1). Measured on an H100 at H16 N1 P131072 with the keys widened to f16 in registers (a form this
// kernel replaced): a group a k-step, each waited for, 69.1 us; grouped so, 59.1. Three groups in flight, or twice the
// S^T fragments a group, are within 1.3% (and with three, ptxas serialises S^T's wgmma). (The dual kernel's FP8 form
// issues its O^T fragments in one group instead: in two, ptxas serialises that kernel's wgmma.)
template <int NG, int Steps, class Load, class Mma>
__device__ __forceinline__ void pipelined(Load load, Mma mma) {
  uint32_t a[2][Steps][4];
#pragma unroll
  for (int grp = 0; grp < NG; ++grp) {
    load(grp, a[grp & 1]);
    wg::wg_fence();
    mma(grp, a[grp & 1]);
    wg::wg_commit();
    wg::wg_wait<1>();
  }
  wg::wg_wait0();
}

constexpr int kSLoads = 3;   // k32 steps per group of S^T (one ldmatrix.x4 each; a bf16 group: 2 kSLoads k16 steps)
static_assert((kDimQK / 32) % kSLoads == 0, "whole groups");

// S^T of an e4m3 tile at shared address kv: the warp's keys 16 warp .. + 15, one ldmatrix.x4 a k32 step (matrices:
// keys 0-7 / 8-15 x bytes 32 j .. + 15, then keys 0-7 / 8-15 x bytes + 16 .. + 31: the A fragment's a0 / a1 / a2 / a3),
// times hi(q) and lo(q). (Spreading the 36 products over 2, 4 or 6 accumulators measured the same, within 0.6%.)
__device__ __forceinline__ void scores_e4m3(float (&s)[8], uint32_t kv, const SmemDesc& qd, int warp, int lane) {
  const int mi = lane >> 3, r = lane & 7;
  const uint32_t row = kv + (warp * 16 + r + 8 * (mi & 1)) * kKeyPitch8 + 16 * (mi >> 1);
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = 0.f;
  pipelined<kDimQK / 32 / kSLoads, kSLoads>(
      [&](int grp, uint32_t(&a)[kSLoads][4]) {
#pragma unroll
        for (int u = 0; u < kSLoads; ++u) ldmatrix_x4(a[u], row + 32 * (grp * kSLoads + u));
      },
      [&](int grp, const uint32_t(&a)[kSLoads][4]) {
#pragma unroll
        for (int u = 0; u < kSLoads; ++u) {
          if constexpr (kExpNoScoreMma) {   // profiling aid: one k-step instead of 18
            if (grp * kSLoads + u > 0) continue;
          }
          const int off = 32 * (grp * kSLoads + u);
          wgmma_m64n16k32_e4m3_rs(s, a[u], q_at(qd, off));
          wgmma_m64n16k32_e4m3_rs(s, a[u], q_at(qd, kDimQK + off));
        }
      });
}

// Where P^T of tile key `key` (0..63) and column (query row) `col` is stored: [col][64 bytes] in 128-byte swizzled rows
// (B of O^T, K-major), the keys of each k32 step in the order of values_e4m3's A fragments: k position 4c + i of a
// 16-key half holds key {2c, 2c + 1, 8 + 2c, 9 + 2c}[i].
__host__ __device__ __forceinline__ int p8_offset(int col, int key) {
  const int q = key & 15;
  const int pos = (key & ~15) + 4 * ((q & 7) >> 1) + (q & 1) + 2 * (q >> 3);
  return col * 128 + ((((pos >> 4) ^ (col & 7))) << 4) + (pos & 15);
}

// O^T += V^T P^T over an e4m3 tile, two value blocks a group: value block mb, k32 step ss by one ldmatrix.x4.trans
// (matrices: keys 0-7, 8-15, 16-23, 24-31 of the step x the warp's 16 value bytes) and the byte permutes of
// wg::e4m3_vt_fragment; times hi(P) and lo(P).
__device__ __forceinline__ void values_e4m3(float (&o)[kVBlocks][8], uint32_t kv, const SmemDesc& pd_hi,
                                            const SmemDesc& pd_lo, int warp, int lane) {
  const int mi = lane >> 3, r = lane & 7;
  const uint32_t col = kv + (8 * mi + r) * kKeyPitch8 + 16 * warp;
  constexpr int kPairs = kVBlocks / 2;
  pipelined<2 * kPairs, 2>(
      [&](int grp, uint32_t(&a)[2][4]) {
        const int ss = grp / kPairs;
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          uint32_t m[4];
          ldmatrix_x4_trans(m, col + 32 * ss * kKeyPitch8 + 64 * (2 * (grp % kPairs) + v));
          wg::e4m3_vt_fragment(m, a[v]);
        }
      },
      [&](int grp, const uint32_t(&a)[2][4]) {
        if constexpr (kExpNoPvMma) return;   // profiling aid: skip O^T += V^T P^T
        const int ss = grp / kPairs;
#pragma unroll
        for (int v = 0; v < 2; ++v) wgmma_m64n16k32_e4m3_rs(o[2 * (grp % kPairs) + v], a[v], pd_hi.at(ss * 32));
#pragma unroll
        for (int v = 0; v < 2; ++v) wgmma_m64n16k32_e4m3_rs(o[2 * (grp % kPairs) + v], a[v], pd_lo.at(ss * 32));
      });
}

// The column_softmax sink of an e4m3 tile: 448 P as hi + lo e4m3 terms into P^T's two buffers (p8_offset), pv rounded
// to (hi + lo) / 448, what O^T's product weighs the values by.
struct PtE4m3 {
  unsigned char* hi;
  unsigned char* lo;
  int warp, g, c;
  __device__ __forceinline__ void operator()(float (&pv)[8]) const {
#pragma unroll
    for (int i = 0; i < 8; i += 2) {   // values i, i + 1: one key, columns col_q(i), col_q(i + 1)
      uint32_t h, l;
      const float2 stored = split_e4m3x2(448.f * pv[i], 448.f * pv[i + 1], h, l);
      const int key = warp * 16 + g + 8 * km::row_half(i);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int off = p8_offset(sk::col_of(c, sk::col_q(i + u)), key);
        hi[off] = (unsigned char)(h >> (8 * u));
        lo[off] = (unsigned char)(l >> (8 * u));
      }
      pv[i] = stored.x * (1.f / 448.f);
      pv[i + 1] = stored.y * (1.f / 448.f);
    }
  }
};

// S^T of a bf16 draft tile (kDraftKeys keys): warps 0 and 1 read their keys' A fragments by ldmatrix.x4 (keys 0-7 /
// 8-15 x dims 16 ks .. + 7 / + 8 .. + 15), warps 2 and 3 (no keys) feed zeros.
__device__ __forceinline__ void scores_bf16(float (&s)[8], uint32_t kv, const SmemDesc& qd, int warp, int lane) {
  const int mi = lane >> 3, r = lane & 7;
  const bool live = warp < kDraftKeys / 16;
  const uint32_t row = kv + (warp * 16 + r + 8 * (mi & 1)) * kPitch16 + 16 * (mi >> 1);
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = 0.f;
  pipelined<kDimQK / 32 / kSLoads, 2 * kSLoads>(
      [&](int grp, uint32_t(&a)[2 * kSLoads][4]) {
#pragma unroll
        for (int u = 0; u < 2 * kSLoads; ++u) {
          if (live)
            ldmatrix_x4(a[u], row + 32 * (2 * kSLoads * grp + u));
          else
            a[u][0] = a[u][1] = a[u][2] = a[u][3] = 0u;
        }
      },
      [&](int grp, const uint32_t(&a)[2 * kSLoads][4]) {
#pragma unroll
        for (int u = 0; u < 2 * kSLoads; ++u) wgmma_m64n16k16_bf16_rs(s, a[u], q_at(qd, 32 * (2 * kSLoads * grp + u)));
      });
}

// O^T += V^T P^T over a bf16 draft tile, two value blocks a group: value block mb, k16 step kk by ldmatrix.x4.trans
// (matrices: keys 0-7 x dims 0-7, keys 0-7 x dims 8-15, keys 8-15 x dims 0-7, keys 8-15 x dims 8-15 of the warp's
// 16), the A fragment as loaded.
__device__ __forceinline__ void values_bf16(float (&o)[kVBlocks][8], uint32_t kv, const SmemDesc& pd, int warp,
                                            int lane) {
  const int mi = lane >> 3, r = lane & 7;
  const uint32_t col = kv + (r + 8 * (mi >> 1)) * kPitch16 + 32 * warp + 16 * (mi & 1);
  constexpr int kSteps = kDraftKeys / 16;
  pipelined<kVBlocks / 2, 2 * kSteps>(
      [&](int grp, uint32_t(&a)[2 * kSteps][4]) {
#pragma unroll
        for (int v = 0; v < 2; ++v)
#pragma unroll
          for (int kk = 0; kk < kSteps; ++kk)
            ldmatrix_x4_trans(a[kSteps * v + kk], col + 16 * kk * kPitch16 + 128 * (2 * grp + v));
      },
      [&](int grp, const uint32_t(&a)[2 * kSteps][4]) {
#pragma unroll
        for (int v = 0; v < 2; ++v)
#pragma unroll
          for (int kk = 0; kk < kSteps; ++kk) wgmma_m64n16k16_bf16_rs(o[2 * grp + v], a[kSteps * v + kk], pd.at(kk * 32));
      });
}

// Keys a tile of item cx holds: 64 prefix keys, or kDraftKeys drafts.
__device__ __forceinline__ int tile_keys(const ItemCtx& cx) { return drafts_split(cx) ? kDraftKeys : kTileN; }
__device__ __forceinline__ int tile_count(const ItemCtx& cx) {
  return (cx.k1 - cx.k0 + tile_keys(cx) - 1) / tile_keys(cx);
}

// The producer warpgroup: thread pt lands key pt of every tile of the block's items (one bulk copy; the zero row past
// the split end), after the stage's release on sm.empty; thread 0 arms sm.full with the tile's bytes. Runs on into the
// next item (fetch_item) while the consumers end the current one.
template <int Consumers, class Fetch>
__device__ __forceinline__ void key_producer(Smem<Consumers>& sm, const Params& prm, int pt, int total,
                                             Fetch fetch_item) {
  uint32_t seq = 0;   // tiles issued by this block: stage seq % kStages, phase seq / kStages
  for (int k = 0;; ++k) {
    const int item = fetch_item(k);
    if (item >= total) return;   // (bulk copies complete on the stages' mbarriers, which the consumers wait on)
    const ItemCtx cx = item_ctx<Consumers * kRows, kTileN, true>(prm, item);
    const bool prefix = !drafts_split(cx);
    const int keys = tile_keys(cx), nt = tile_count(cx);
    long long slot = prefix && pt < kTileN ? wg::tile_key_slot<kTileN>(prm, cx, 0, pt) : 0;
    for (int t = 0; t < nt; ++t, ++seq) {
      const int b = seq % kStages;
      const long long next = prefix && pt < kTileN ? wg::tile_key_slot<kTileN>(prm, cx, t + 1, pt) : 0;
      if (pt < keys) {
        mbar_wait(&sm.empty[b], ((seq / kStages) & 1) ^ 1u);   // the stage's previous tile consumed (none at first)
        if (pt == 0) mbar_arrive_expect_tx(&sm.full[b], prefix ? kTileN * kDimQK : kDraftKeys * kKeyBytes);
        fence_proxy_async();   // the consumers' reads of the stage ordered before the async writes
        const int key = cx.k0 + t * keys + pt;
        if (prefix)
          bulk_copy_g2s(&sm.kv[b][pt * kKeyPitch8], key_ptr8(prm, cx, key, slot), kDimQK, &sm.full[b]);
        else
          bulk_copy_g2s(&sm.kv[b][pt * kPitch16], key_ptr(prm, cx, key, 0), kKeyBytes, &sm.full[b]);
      }
      slot = next;
    }
  }
}

// The row tile of consumer warpgroup `me` in item cx: its 16 rows of the item's Consumers x 16 (none past the
// request's rows).
__device__ __forceinline__ ItemCtx consumer_rows(const ItemCtx& cx, int me) {
  ItemCtx mine = cx;
  mine.row0 = cx.row0 + me * kRows;
  mine.rows = max(0, min(kRows, cx.rows - me * kRows));
  return mine;
}

template <int Consumers>
__global__ void __launch_bounds__(kThreads<Consumers>, 1) kdtree_verify_split_skinny_fp8_kernel(Params prm) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(Consumers == 1 || Consumers == 2, "16- or 32-row items");
  constexpr int kClaimer = Consumers * kConsumerThreads;   // the producer's first thread claims the items
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem<Consumers>& sm = wg::smem_1k<Smem<Consumers>>(smem_raw);
  const int tid = threadIdx.x;
  KDTREE_TIMELINE(2, 0);
  grid_dependency_launch_dependents();
  grid_dependency_wait();   // the prep kernel's plan and q rows
  KDTREE_TIMELINE(2, 1);
  const int total = prm.counter[1];
  const int H = prm.heads;

  // (full: the producer's expect_tx arrival and the copies' bytes)
  if (tid == 0) sk::init_barriers(sm, 1, kClaimer, kThreads<Consumers>);
  __syncthreads();

  auto fetch_item = [&](int k) {
    return wg::fetch_item_ahead(prm, k, tid, kClaimer, sm.item, sm.item_full, sm.item_empty);
  };

  if (tid < kClaimer) {
    // =========================== consumer warpgroups ===========================
    if constexpr (Consumers > 1) wg::set_max_regs<kConsumerRegs, kLaunchRegs<Consumers>>();
    // this warpgroup's 16 rows of each item, and the thread's index in it: constants where there is one consumer, so
    // that the 16-row form keeps one named barrier id (ptxas reserves all 16 for a runtime id) and its registers
    const int me = Consumers == 1 ? 0 : tid / kConsumerThreads;
    const int t128 = Consumers == 1 ? tid : tid % kConsumerThreads;
    const int bar = sk::kBarConsumer + me;
    const int warp = t128 >> 5;
    const int lane = tid & 31;
    const int g = lane >> 2;
    const int c = lane & 3;
    const SmemDesc qd(smem_u32(&sm.q[me][0]), 16, 1024);
    const SmemDesc pd(smem_u32(&sm.p[me][0][0]), 16, 1024), pd_lo(smem_u32(&sm.p[me][1][0]), 16, 1024);
    uint32_t seq = 0;   // tiles consumed by this block: stage seq % kStages, phase seq / kStages
    for (int k = 0;; ++k) {
      const int item = fetch_item(k);
      if (item >= total) {
        KDTREE_TIMELINE(2, 2);   // (the consumers' last stores are issued)
        break;
      }
      const ItemCtx whole = item_ctx<Consumers * kRows, kTileN, true>(prm, item);
      const ItemCtx cx = Consumers == 1 ? whole : consumer_rows(whole, me);
      const bool prefix = !drafts_split(cx);
      if (k > 0) bar_sync(bar, kConsumerThreads);   // the previous item's result rows (in q) are stored
      wg::issue_q_copies<kRows>(prm, cx, H, sm.q[me], t128, kConsumerThreads, prefix);
      cp_async_wait_all();   // this thread's q copies (the consumers issue no other cp.async)
      fence_proxy_async();   // read next by wgmma (the async proxy)
      bar_sync(bar, kConsumerThreads);

      int rn[4];      // verify token of each of the thread's four columns (-1: a padding row)
      float scale[4]; // score factor of each column (log2 units): a prefix item's takes k_scale and q's 2^e
      float m_run[4], l_part[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int col = sk::col_of(c, q);
        rn[q] = row_token(cx, col, H);
        scale[q] = prm.scale_log2;
        if (prefix && col < cx.rows)
          scale[q] *= prm.k_scale * prm.q_scale[(long long)cx.rp.qo_begin * H + cx.row0 + col];
        m_run[q] = -INFINITY;
        l_part[q] = 0.f;
      }
      float o[kVBlocks][8];
#pragma unroll
      for (int mb = 0; mb < kVBlocks; ++mb)
#pragma unroll
        for (int i = 0; i < 8; ++i) o[mb][i] = 0.f;

      const int keys = tile_keys(cx), nt = tile_count(cx);
      for (int t = 0; t < nt; ++t, ++seq) {
        const int b = seq % kStages;
        mbar_wait(&sm.full[b], (seq / kStages) & 1);   // the tile's rows landed
        const uint32_t kv = smem_u32(&sm.kv[b][0]);
        float s[8], alpha[4];
        if (prefix) {
          scores_e4m3(s, kv, qd, warp, lane);
          sk::column_softmax(prm, cx, cx.k0 + t * keys, rn, scale, true, s, m_run, l_part, alpha, sm.red[me], warp, g,
                             c, PtE4m3{sm.p[me][0], sm.p[me][1], warp, g, c}, bar);
          sk::rescale_o_t(o, alpha);
          values_e4m3(o, kv, pd, pd_lo, warp, lane);
        } else {
          scores_bf16(s, kv, qd, warp, lane);
          sk::column_softmax(prm, cx, cx.k0 + t * keys, rn, scale, warp < kDraftKeys / 16, s, m_run, l_part, alpha,
                             sm.red[me], warp, g, c, sk::PtBf16{sm.p[me][0], warp, g, c}, bar);
          sk::rescale_o_t(o, alpha);
          values_bf16(o, kv, pd, warp, lane);
        }
        mbar_arrive(&sm.empty[b]);   // release: the producer refills the stage once every consumer thread has
      }
      // prefix items: accumulator row g / g + 8 of a warp is value dim 2g / 2g + 1 of its 16 (values_e4m3)
      sk::store_item(
          prm, cx, H, o, m_run, l_part, prefix ? prm.v_scale * (1.f / 448.f) : 1.f, sm.lred[me], sm.row_m[me],
          sm.row_l[me], sm.q[me], t128,
          [prefix](int mb, int w, int g, int h) {
            return mb * wg::kSlabDims + w * 16 + (prefix ? 2 * g + h : g + 8 * h);
          },
          bar);
    }
  } else {
    // =========================== producer warpgroup ===========================
    if constexpr (Consumers > 1) wg::set_max_regs<kProducerRegs, kLaunchRegs<Consumers>>();
    key_producer(sm, prm, tid - kClaimer, total, fetch_item);
  }
#else
  __trap();   // built without sm_90a: the launcher never selects this kernel
#endif
}

}  // namespace sk8
}  // namespace kdtree
