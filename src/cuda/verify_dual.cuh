// verify_dual.cuh: the sm_90a split pass ("dual"), the default on H100/H200: the same work items (64-row tiles, 32-key
// tiles), plan, partials and combine as the mma.sync kernel (verify_mma.cuh); shared pieces in verify_wgmma.cuh.
//
// Five warpgroups, 640 threads, one block per SM (the measurements behind each choice: docs/design.md):
// - Score warpgroups s = 0, 1 own alternate tiles t = s, s + 2, ...: S_t = Q K_t^T (36 wgmma m64n32k16, both operands
//   in shared memory), the tile's row maxima, then the running maxima: each waits for m_{t-1}, published by the other
//   score warpgroup on m_full as soon as that tile's maxima were known (before its P), publishes m_t the same way, and
//   computes P_t and alpha_t into its own P buffer (p[s], 64-byte swizzle) for the value warpgroups (p_full[s] release
//   / acquire, named barrier kBarPFull + s for the wake-up; p_empty[s] gives the buffer back). Two score warpgroups so
//   that one runs its softmax while the other's S is on the tensor cores (one score warpgroup's softmax waits behind
//   its own wgmma issue: 4-6% slower on every shape, H200). Each keeps the row sums of its own tiles relative to its
//   own latest reference; score warpgroup 1 hands its sums to warpgroup 0 at the end of the item (l_full), which
//   merges them.
// - Value warpgroups v = 0, 1 (columns [256 v, 256 v + 256) of all 64 rows, 128 fp32 per thread): for every tile in
//   order, O = alpha_t O + P_t V_t, as two wgmma m64n128k16 per k-step (a kernel of 512 or more threads caps ptxas at
//   128 registers for one instruction, and m64n256k16 needs 154).
// - The producer warpgroup gathers every key tile into a ring of 4 buffers as soon as both value
//   warpgroups are done with a buffer (empty[b]); each tile announces itself on full[b] once its copies have landed.
// - setmaxnreg: the launch gives 96 registers a thread (640 threads, whole warpgroups); then score 56 (16 scores, q
//   from shared memory), value 160 (152 spills), producer 48.
// - A lazy reference maximum (after FlashAttention-4's conditional rescale): a row's reference moves only
//   when its maximum exceeds it by more than tau = KDTREE_DUAL_LAZY_RESCALE (log2 units), so P <= 2^tau and alpha is
//   exactly 1 in almost every tile; the value warpgroups then skip O's rescale. The result is the same up to rounding.
// The choices below were each measured against their alternatives on the H200; the alternatives measured slower are
// in docs/performance.md, "What was tried and measured slower". In short: the ring's chain (land, S, softmax, P V,
// release, refill through four buffers) sets the period, and shared memory, which q (72 KB) and the four buffers
// (144 KB) fill, is the busiest unit (~75% of its peak).
//
// The FP8 form (Fp8, a call over an e4m3 pool; its drafts stand apart as items of their own, which run as above on
// bf16 tiles) computes a prefix item's products in e4m3 wgmma, the keys never widened:
// - S = q K^T: 36 wgmma m64n32k32 from shared memory, q's two e4m3 terms (hi + lo, verify_q8.cuh: 1,152 bytes a row, in
//   the bf16 q's bytes and layout) against the e4m3 tile (32 keys x 576 bytes, 64-byte swizzle: 18 KB, so the ring's
//   bytes hold 8 tiles);
// - O^T = V^T P^T: each value warpgroup's 256 dims as 4 blocks of wgmma m64n64k32 with V^T from registers
//   (ldmatrix.trans and byte permutes of the tile, wg::e4m3_vt_fragment) and P^T = e4m3(448 P), one term, from
//   shared memory, written by the score warpgroup in the fragments' k order (p8_pair_pos); no lazy reference (P <= 1);
// - four warpgroups, 512 threads: the score warpgroups gather their own tiles half a ring ahead (no producer), which
//   leaves 128 registers a thread at launch for the value warpgroups' 176 (kThreads below).
// Measured on an H100 (H16 N9 P131072, one run): 135.2 us against 116.9 for the bf16 kernel. In earlier runs against
// the same form: 145 with P in two e4m3 terms, 198 for the form it replaced (keys widened to bf16 in shared memory,
// beside two bf16 buffers).
#pragma once

#include "verify_dual_fp8.cuh"
#include "verify_wgmma.cuh"

namespace kdtree {
namespace dual {

using wg::SmemDesc;
using wg::desc_sw64;
using wg::kBlockM;
using wg::kTileN;
using wg::kSlabs;
using wg::kSlabBytes;
using wg::kTileBytes;
using wg::kQSlabBytes;
using wg::kKSteps;
using wg::kPvSteps;

// Key buffers of the ring (even: each score warpgroup waits only on its own buffers): 4 bf16 tiles of 32 keys. The FP8
// form's prefix items (e4m3 tiles, 18 KB) take the same bytes as 8 buffers, their own mbarriers beside the first 4.
constexpr int kRing = 4;
constexpr int kRing8 = 8;
static_assert(kRing8 * kTileBytes8 == kRing * kTileBytes && kTileBytes8 % 1024 == 0, "e4m3 buffers fill the ring's bytes");
template <bool Fp8>
constexpr int kBars = Fp8 ? kRing8 : kRing;   // mbarriers a buffer: full / empty
constexpr int kValueThreads = 256;             // the two value warpgroups
// The FP8 form has no producer warpgroup: its score warpgroups gather the key tiles (each its own tiles, half a ring
// ahead), so that four warpgroups share the register file: 128 registers a thread at launch, 80 for a score
// warpgroup and 176 for a value warpgroup, whose e4m3 product takes V^T from registers (128 accumulators and 16
// fragment registers a thread in one wgmma group; with fewer registers, or the fragments in two groups, ptxas
// serialises every wgmma of the kernel). With a producer warpgroup (or warp) beside them the launch gives 96.
template <bool Fp8>
constexpr int kThreads = Fp8 ? 512 : 640;   // 2 score + 2 value warpgroups (+ the producer warpgroup)
template <bool Fp8>
constexpr int kLaunchRegs = (65536 / kThreads<Fp8>) / 8 * 8;   // 96 (bf16), 128 (FP8): one block per SM
template <bool Fp8>
constexpr int kScoreRegs = Fp8 ? 80 : 56;
template <bool Fp8>
constexpr int kValueRegs = Fp8 ? 176 : 160;
constexpr int kProducerRegs = 48;   // the bf16 kernel's producer warpgroup
// what the score and producer warpgroups give back must cover what the value warpgroups take (setmaxnreg.inc waits for
// it: the block's pool is what it got at launch)
template <bool Fp8>
constexpr bool kRegisterPoolFits = 2 * (kValueRegs<Fp8> - kLaunchRegs<Fp8>) <=
                                   2 * (kLaunchRegs<Fp8> - kScoreRegs<Fp8>) + (Fp8 ? 0 : kLaunchRegs<Fp8> - kProducerRegs);
static_assert(kRegisterPoolFits<false> && kRegisterPoolFits<true>, "register pool");
constexpr int kProducerKeys = 8 * kTileN / kCopierThreads;    // 2: keys of a bf16 tile a thread (wg::copy_tile)
// The producer gathers tiles 0 .. kQFirst - 1 of an item, then waits until the item's q has landed before it asks for
// the rest of the ring, so that q and the first tiles are not queued behind the whole ring (H200: -0.3 to -3.7 us on
// six shapes against asking for the whole ring at once; with q by TMA, 4 and 2 measure the same).
constexpr int kQFirst = 2;
static_assert(kQFirst >= 1 && kQFirst <= kRing, "tiles asked for before q has landed: 1 .. the ring");
constexpr int kPRowBytes = kTileN * 2;         // 64: P rows in the 64-byte swizzle (K-major A; FP8: P^T, half used)
static_assert(kPRowBytes == kPtRowBytes, "the FP8 form's P^T rows take the bf16 P's bytes");
constexpr int kPBytes = kBlockM * kPRowBytes;  // 4,096

// Named barriers (0 is __syncthreads).
constexpr int kBarBlock = 1;    // score warpgroup 0 and the value warpgroups: row sums of the item stored
constexpr int kBarPFull = 2;    // + s: score warpgroup s arrives, the value warpgroups wait (wake-up)
constexpr int kBarValues = 4;   // the two value warpgroups: the item's O rows staged in the ring
constexpr int kBarScore = 5;    // the two score warpgroups: q of the item in shared memory

// tau of the lazy reference maximum (0: the reference is every tile's running maximum, O rescaled whenever it moves).
// Measured (H200, A/B within one run): tau 8 -1.9% at H16 N9 P131072, -3.1% P185000, -3.3% H128 N9 P32768, -4.5% B8,
// -2.4% P8192.
#ifndef KDTREE_DUAL_LAZY_RESCALE
#define KDTREE_DUAL_LAZY_RESCALE 8
#endif
static_assert(KDTREE_DUAL_LAZY_RESCALE >= 0, "KDTREE_DUAL_LAZY_RESCALE: 0 (off) or tau > 0");

template <int Bars>
struct SmemRing {
  unsigned char q[kSlabs * kQSlabBytes];   // 73,728: q of the item, bf16 or its e4m3 terms (the struct sits on 1 KB)
  unsigned char kv[kRing][kTileBytes];     // 147,456: the key ring
  unsigned char p[2][kPBytes];             // P of score warpgroup s's latest tile
  float alpha[2][kBlockM];                 // its rescale factors
  float m[2][kBlockM];                     // the running row maxima after its latest tile
  float xl[kBlockM], xmu[kBlockM];         // score warpgroup 1's row sums at the end of an item, their max
  float row_l[kBlockM];                    // the item's row sums, for the value warpgroups
  unsigned long long full[Bars];      // tile landed: one arrival per copier thread (128)
  unsigned long long empty[Bars];     // the value warpgroups are done with the buffer (256 arrivals)
  unsigned long long p_full[2];       // P / alpha of score warpgroup s published: 128 arrivals (release)
  unsigned long long p_empty[2];      // consumed: 256 value-thread arrivals (release)
  unsigned long long m_full[2];       // m of score warpgroup s's latest tile published: 128 arrivals
  unsigned long long q_full;          // q of the item landed: 256 score-thread arrivals (the producer's kQFirst)
  unsigned long long l_full;          // score warpgroup 1's row sums stored: 128 arrivals
  unsigned long long item_full;       // the block's next work item stored: 1 arrival (release)
  unsigned long long q_land;          // q of the item landed by TMA (Params::q_tma): 1 arrival + its 72 KB
  int item[2];   // the block's k-th work item in item[k % 2]
  unsigned long long ring_free;       // the producer: the item's rows have left the ring (256 value-thread arrivals)
};
template <bool Fp8>
using Smem = SmemRing<kBars<Fp8>>;
template <bool Fp8>
constexpr size_t kSmemBytesOf = sizeof(Smem<Fp8>) + 1024;   // + room to align the base to 1 KB
constexpr size_t kSmemBytes = kSmemBytesOf<false>;
constexpr size_t kSmemBytesFp8 = kSmemBytesOf<true>;
static_assert(kSmemBytes <= 232448 && kSmemBytesFp8 <= 232448, "sm_90 gives a block at most 227 KB of shared memory");
static_assert(kPBytes % 512 == 0, "64-byte swizzle atoms (8 rows x 64 B) stay 512 B aligned");
static_assert(kRing % 2 == 0 && kRing8 % 2 == 0, "a buffer's tiles all belong to one score warpgroup");
static_assert(kRing * kTileBytes >= kBlockM * 1024, "the ring holds an item's 64 rows of 512 bf16");

// Copier thread i's part of bf16 tile t (kProducerKeys keys: wg::copy_tile) into ring buffer b, then its arrival on
// the buffer's mbarrier once it has landed; nothing past the item's last tile.
template <typename SmemT>
__device__ __forceinline__ void gather_tile(SmemT& sm, const Params& prm, const ItemCtx& cx, int t, int b, int i,
                                            const long long (&slot)[kProducerKeys]) {
  wg::copy_tile<kProducerKeys>(smem_u32(&sm.kv[0][0]) + b * kTileBytes, &sm.full[b], prm, cx, t, i, slot);
}

// The ring buffer of an item's tile t: t % ring (ring: kRing, or kRing8 for the FP8 form's e4m3 tiles).
template <bool Fp8>
__device__ __forceinline__ int ring_buffer(int t, int ring) {
  return Fp8 ? t & (ring - 1) : t % kRing;
}

// The dual kernel; Fp8: the form for e4m3 pools, whose calls have their drafts apart: a prefix item runs on e4m3 tiles
// (the functions above; its scores scaled by k_scale and q's 2^e, its output by v_scale / 448: SGLang's k_descale /
// v_descale), a draft item as the bf16 kernel's (scaled by neither).
template <bool Fp8>
__global__ void __launch_bounds__(kThreads<Fp8>, 1) kdtree_verify_split_dual_kernel(const __grid_constant__ Params prm) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem<Fp8>& sm = wg::smem_1k<Smem<Fp8>>(smem_raw);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int c = lane & 3;
  const int wrow = (warp & 3) * 16;   // rows of this warp within the tile
  KDTREE_TIMELINE(2, 0);
  grid_dependency_wait();   // the plan kernel's counter and plan
  // after the wait: the combine reads the plan as soon as it starts
  grid_dependency_launch_dependents();
  KDTREE_TIMELINE(2, 1);
  const int total = prm.counter[1];
  const int H = prm.heads;

  if (tid == 0) {
    for (int b = 0; b < kBars<Fp8>; ++b) {
      mbar_init(&sm.full[b], kCopierThreads);
      mbar_init(&sm.empty[b], kValueThreads);
    }
    for (int i = 0; i < 2; ++i) {
      mbar_init(&sm.p_full[i], 128);
      mbar_init(&sm.p_empty[i], kValueThreads);
      mbar_init(&sm.m_full[i], 128);
    }
    mbar_init(&sm.q_full, 256);
    mbar_init(&sm.l_full, 128);
    mbar_init(&sm.item_full, 1);
    mbar_init(&sm.q_land, 1);
    mbar_init(&sm.ring_free, kValueThreads);
    fence_proxy_async();
  }
  __syncthreads();

  if (warp < 8) {
    // =========================== score warpgroups ===========================
    wg::set_max_regs<kScoreRegs<Fp8>, kLaunchRegs<Fp8>>();
    const int s = warp >> 2;   // owns tiles t % 2 == s
    uint32_t full_bits = 0u, mf_parity = 0u, pe_parity = 0u;   // l_full completes once per item: parity k & 1
    uint32_t empty_bits = 0u;   // FP8: the buffers this warpgroup refills
    const SmemDesc qd(smem_u32(&sm.q[0]), 16, 1024);
    for (int k = 0;; ++k) {
      // (the item index goes out on an mbarrier: with __syncthreads between the store and the loads, racecheck
      // reports the pair as a race)
      const int item = wg::fetch_item(prm, k, tid, sm.item, &sm.item_full);
      if (item >= total) return;
      const ItemCtx cx = item_ctx<kBlockM, kTileN, Fp8>(prm, item);
      const int nt = cx.ntiles;
      const bool e4 = Fp8 && !drafts_split(cx);   // e4m3 tiles, q's e4m3 terms
      const int ring = e4 ? kRing8 : kRing;
      KDTREE_DTRACE_ITEM_START(tid == 0);   // (TRACE) just after the item fetch
      KDTREE_DSTART(tid == 0, 0);
      // FP8: this warpgroup gathers its own tiles (t % 2 == s), half a ring ahead: tile u into buffer u % ring once the
      // value warpgroups are done with tile u - ring there (empty); copier thread st: copy_tile8 (e4m3 tiles) or
      // wg::copy_tile (bf16 drafts); slot ids one own tile ahead
      const int ahead = ring / 2;
      const int st = tid & 127;
      long long slot[kProducerKeys];
      const auto load_slots = [&](int u) {
        if (e4)
          slot[0] = wg::tile_key_slot(prm, cx, u, st >> 2);
        else
          wg::tile_slots<kProducerKeys>(prm, cx, u, st, slot);
      };
      const auto gather = [&](int u) {   // (nothing past the item's last tile)
        const int b = ring_buffer<Fp8>(u, ring);
        if (u >= ring) mbar_wait_buffer(sm.empty, empty_bits, b);
        if (e4)
          copy_tile8(smem_u32(&sm.kv[0][0]) + b * kTileBytes8, &sm.full[b], prm, cx, u, st, slot[0]);
        else
          gather_tile(sm, prm, cx, u, b, st, slot);
      };
      if constexpr (Fp8) {
        // the previous item's rows have left the ring (its value side's staged store; as the producer of the bf16
        // kernel waits)
        if (k > 0) mbar_wait(&sm.ring_free, (k - 1) & 1);
      }

      // q of the item (an e4m3 item's: its e4m3 terms, written by the prep kernel): nine TMA boxes (64 rows x one
      // 64-column slab each) from one thread (the 256 score threads' 4,608 16-byte copies take ~7,900 clocks to issue
      // beside the first tiles; by TMA q lands at ~3,300-3,800: -7.5% at H16 N9 P8192, ~-1% at P131072, H200), or
      // over the 256 score threads, all copies in flight at once
      const bool q_tma = prm.q_tma;
      if (q_tma) {
        if (tid == 0) wg::issue_q_tma(prm, cx, H, sm.q, &sm.q_land, e4);
      } else {
        // (the thread index read again per item, so that ptxas does not keep this path's per-thread addresses live
        // across the item loop at 56 registers, which spilled them)
        wg::issue_q_copies(prm, cx, H, sm.q, thread_index_now(), 256, e4);
      }
      if constexpr (Fp8) {
        // q's copies (without TMA) committed as a group (waited for below; the group also takes the previous item's
        // last tile copies, landed by now), then the first tiles, whose mbarrier arrivals wait for q's copies as well
        // (an arrive.noinc counts every earlier cp.async of the thread; S waits for q anyway)
        cp_async_commit();
        for (int u = s; u < ahead; u += 2) {
          load_slots(u);
          gather(u);
        }
        load_slots(s + ahead);
      }
      KDTREE_DSTART(tid == 0, 1);
      if (q_tma) {
        mbar_wait(&sm.q_land, k & 1);   // (rows past the tensor's last are zeros; rows of the next request are
                                        // padding rows here, computed and dropped like zero rows)
      } else if constexpr (Fp8) {
        cp_async_wait_group<0>();   // this thread's q copies (its tile copies are in no committed group)
      } else {
        cp_async_wait_all();   // this thread's q copies (the score warpgroups issue no other cp.async)
      }
      KDTREE_DSTART(tid == 0, 2);
      fence_proxy_async();   // read next by wgmma (the async proxy)
      if constexpr (!Fp8) mbar_arrive(&sm.q_full);   // the producer may ask for the rest of the ring
      bar_sync(kBarScore, 256);
      KDTREE_DSTART(tid == 0, 3);

      // the scores' factor (log2 units) of the thread's rows: an e4m3 item's takes k_scale and q's 2^e
      float rscale[2] = {prm.scale_log2, prm.scale_log2};
      if (e4) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = wrow + g + 8 * half;
          if (r < cx.rows) rscale[half] *= prm.k_scale * prm.q_scale[(long long)cx.rp.qo_begin * H + cx.row0 + r];
        }
      }
      float mu[2] = {-INFINITY, -INFINITY};   // m_use of this warpgroup's latest tile (its sums' reference)
      float l_own[2] = {0.f, 0.f};
      constexpr int kGroups = kTileN / 8;
      float sc[4 * kGroups];
      for (int t = s; t < nt; t += 2) {
        // (TRACE: the FP8 form's loop top goes unstamped; with that stamp too, ptxas serialises its wgmma, C7511)
        if (!Fp8 && (warp & 3) == 0) KDTREE_DTRACE(0);
        mbar_wait_buffer(sm.full, full_bits, ring_buffer<Fp8>(t, ring));   // every copier thread's copies landed
        fence_proxy_async();   // cp.async wrote the tile (generic proxy); wgmma reads it (async proxy)
        if (e4) {
          if ((warp & 3) == 0) KDTREE_DTRACE(8);
          scores8(sc, smem_u32(&sm.kv[0][0]) + ring_buffer<Fp8>(t, ring) * kTileBytes8, qd);
        } else {
          const SmemDesc kd(smem_u32(&sm.kv[0][0]) + ring_buffer<Fp8>(t, ring) * kTileBytes, 16, 1024);
          if ((warp & 3) == 0) KDTREE_DTRACE(8);   // S issued (past the wait for the tile)
          wg::wg_fence();
#pragma unroll
          for (int ks = 0; ks < kKSteps; ++ks) {
            if constexpr (kExpNoScoreMma) {   // profiling aid: one k-step instead of 36
              if (ks > 0) continue;
            }
            const uint64_t da = qd.at((ks >> 2) * kQSlabBytes + (ks & 3) * 32);
            const uint64_t db = kd.at((ks >> 2) * kSlabBytes + (ks & 3) * 32);
            wg::wgmma_m64n32k16_ss(sc, da, db, ks > 0);
          }
          wg::wg_commit();
          wg::wg_wait0();
        }
        if ((warp & 3) == 0) KDTREE_DTRACE(1);
        float tmax[2];
        if constexpr (Fp8)
          scale_mask_max<kGroups>(prm, cx, H, cx.k0 + t * kTileN, wrow + g, c, rscale, sc, tmax);
        else
          scale_mask_max<kGroups>(prm, cx, H, cx.k0 + t * kTileN, wrow + g, c, prm.scale_log2, sc, tmax);
        if ((warp & 3) == 0) KDTREE_DTRACE(9);   // the tile's own row maxima
        // the running maxima: m of the tile before from the other score warpgroup, this tile's published at once
        // (before P)
        float m_run[2] = {-INFINITY, -INFINITY};
        if (t > 0) {
          mbar_wait(&sm.m_full[1 - s], mf_parity);
          mf_parity ^= 1u;
          m_run[0] = sm.m[1 - s][wrow + g];
          m_run[1] = sm.m[1 - s][wrow + g + 8];
        }
        if ((warp & 3) == 0) KDTREE_DTRACE(2);
        float m_use[2], alpha[2];
        // m_run: this tile's reference (its m without the lazy reference); alpha rescales O (relative to the last)
        if (e4)   // (P <= 1: softmax_p8)
          softmax_advance_tau<0>(tmax, m_run, m_use, alpha);
        else
          softmax_advance_tau<KDTREE_DUAL_LAZY_RESCALE>(tmax, m_run, m_use, alpha);
        if (t + 1 < nt) {   // the other warpgroup's next tile reads it (which orders this store after its read of the last)
          if (c == 0) {
            sm.m[s][wrow + g] = m_run[0];
            sm.m[s][wrow + g + 8] = m_run[1];
          }
          mbar_arrive(&sm.m_full[s]);
        }
        // this warpgroup's sums move from its previous tile's reference to this one's
        float lfac[2];
        move_sums_reference(mu, m_use, lfac);
        if (t >= 2) {   // the value warpgroups are done with this warpgroup's previous P and alpha
          mbar_wait(&sm.p_empty[s], pe_parity);
          pe_parity ^= 1u;
        }
        // P by two stmatrix.x4 per thread (a quarter of the 4-byte stores' instructions): matrix j of half
        // h is rows wrow + 8 h .. + 7, key group j; lane l gives row l % 8 of matrix l / 8
        if (e4) {
          softmax_p8(sc, m_use, lfac, l_own, smem_u32(&sm.p[s][0]), wrow, g, c);
        } else {
          uint32_t pr[2][4];
          softmax_p_pairs<kGroups>(sc, m_use, lfac, l_own, [&](int j, int half, uint32_t pair) { pr[half][j] = pair; });
          const uint32_t p0 = smem_u32(&sm.p[s][0]);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = wrow + half * 8 + (lane & 7);
            stmatrix_x4(p0 + row * kPRowBytes + ((((lane >> 3) & 3) ^ ((row >> 1) & 3)) << 4), pr[half]);
          }
        }
        if (c == 0) {
          sm.alpha[s][wrow + g] = alpha[0];
          sm.alpha[s][wrow + g + 8] = alpha[1];
        }
        // P is read next by wgmma (the async proxy): no proxy fence here (it would hold the score warpgroup until the
        // stores complete: with it, and 4-byte stores, 0.6-1.4% slower on every shape, H200); the value side's fence
        // after its acquire of p_full orders P for its wgmma
        mbar_arrive(&sm.p_full[s]);
        bar_arrive(kBarPFull + s, 128 + kValueThreads);
        if ((warp & 3) == 0) KDTREE_DTRACE(3);
        // FP8: this warpgroup's tile t + ahead, once P is published, so that the copies' issue is off the paths from
        // S to P and from S to the other warpgroup's next tile (issued between the maxima and P, they held an item's
        // first P back ~6,000 SM clocks, TRACE, against ~1,750 a tile later). H100, one tools/ab_variants.sh run,
        // H16 N9 P131072 / P8192 / B8 / H128 N9 P32768: 134.5 / 32.5 / 300.6 / 201.8 us here against 137.4 / 32.7 /
        // 303.7 / 207.3 between the maxima and P (here for each warpgroup's first tile only: 138.6 / 33.8 / 306.9 /
        // 208.7); between the maxima and P, 145.4 us at P131072 against 149.5 right after S and 150.3 before the wait
        // for the tile (P in two terms, another run)
        if constexpr (Fp8) {
          if (t + ahead < nt) {
            gather(t + ahead);
            load_slots(t + ahead + 2);
          }
        }
      }

      // end of the item: warpgroup 1's sums (relative to its latest m_use) go to warpgroup 0, which adds
      // them to its own at the larger reference and stores the rows' sums for the value warpgroups
      quad_sum_rows(l_own);
      if (s == 1) {
        wg::put_row_sums(sm.xl, sm.xmu, wrow, g, c, l_own, mu);
        mbar_arrive(&sm.l_full);
      } else {
        mbar_wait(&sm.l_full, k & 1);
        float m_fin[2], l_fin[2];
        wg::merge_row_sums(sm.xl, sm.xmu, wrow, g, c, l_own, mu, m_fin, l_fin, sm.row_l);
        bar_arrive(kBarBlock, 128 + kValueThreads);   // row_l stored (the value side waits, this side need not)
        write_partial_lse_rows(prm, cx, H, wrow + g, c, m_fin, l_fin);
      }
      sync_block_roles();   // the item's shared memory is consumed before the next item starts
      KDTREE_DTRACE_ITEM(tid == 0, item, nt, kQFirst);
    }
  } else if (warp < 16) {
    // =========================== value warpgroups ===========================
    wg::set_max_regs<kValueRegs<Fp8>, kLaunchRegs<Fp8>>();
    const int vt = tid - 256;   // 0..255
    const int v = vt >> 7;      // value warpgroup: columns [256 v, 256 v + 256)
    uint32_t full_bits = 0u, pf_bits = 0u;
    for (int k = 0;; ++k) {
      const int item = wg::wait_item(k, sm.item, &sm.item_full);   // the score side's item fetch (acquire)
      if (item >= total) {
        KDTREE_TIMELINE_BY(vt == 0, 2, 2);   // (after the block's last stores)
        return;
      }
      const ItemCtx cx0 = item_ctx<kBlockM, kTileN, Fp8>(prm, item);
      const int nt = cx0.ntiles;
      const bool e4 = Fp8 && !drafts_split(cx0);   // O^T = V^T P^T on e4m3 tiles (values8)
      const int ring = e4 ? kRing8 : kRing;
      KDTREE_DSTART(vt == 0, 4);

      float o[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] = 0.f;

      for (int t = 0; t < nt; ++t) {
        const int b = ring_buffer<Fp8>(t, ring);
        const int s = t & 1;   // the tile's score warpgroup
        if (warp == 8) KDTREE_DTRACE(4);
        bar_sync(kBarPFull + s, 128 + kValueThreads);   // P / alpha of the tile: wake up ...
        mbar_wait(&sm.p_full[s], (pf_bits >> s) & 1u);  // ... and acquire (complete by now)
        pf_bits ^= 1u << s;
        // alpha loaded right after the acquire, before the wait for the tile's buffer and the proxy fence, so that the
        // load's latency is off the path from P to P V's issue (H200: -0.9% at H16 N9 P131072, -1.1% B8)
        if (e4) {
          float2 a[8];   // O^T: the factors of the thread's 16 columns
          load_row_pairs(a, sm.alpha[s], c);
          mbar_wait_buffer(sm.full, full_bits, b);
          fence_proxy_async();   // (as below)
          rescale_o_t(o, a);
          values8(o, smem_u32(&sm.kv[0][0]) + b * kTileBytes8, desc_sw64(smem_u32(&sm.p[s][0])), v, warp & 3, lane);
        } else {
          const float a0 = sm.alpha[s][wrow + g];
          const float a1 = sm.alpha[s][wrow + g + 8];
          mbar_wait_buffer(sm.full, full_bits, b);   // landed (its score warpgroup saw it already)
          if (warp == 8) KDTREE_DTRACE(5);
          // the tile's V is read by wgmma (the async proxy), and so is P, whose writer fences nothing: this fence follows
          // the acquire of p_full, so it must stay after both waits
          fence_proxy_async();
          wg::rescale_o(o, a0, a1);
          {
            const uint64_t pd = desc_sw64(smem_u32(&sm.p[s][0]));
            const SmemDesc vd(smem_u32(&sm.kv[0][0]) + b * kTileBytes + (4 * v) * kSlabBytes, kSlabBytes, 1024);
            wg::wg_fence();
#pragma unroll
            for (int kk = 0; kk < kPvSteps; ++kk) {
              if constexpr (kExpNoPvMma) continue;   // profiling aid: skip P V
              const uint64_t da = pd + ((kk * 32) >> 4);
              wg::wgmma_m64n128k16_ss_bt(&o[0], da, vd.at(kk * 16 * 128));
              wg::wgmma_m64n128k16_ss_bt(&o[64], da, vd.at(2 * kSlabBytes + kk * 16 * 128));
            }
            wg::wg_commit();
            if (warp == 8) KDTREE_DTRACE(10);   // P V issued
            wg::wg_wait0();
            if (warp == 8) KDTREE_DTRACE(11);   // P V done
            if (warp == 12) KDTREE_DTRACE(14);   // value warpgroup 1's P V done
          }
        }
        // release: its score warpgroup writes P / alpha again (its tile after next)
        if (t + 2 < nt) mbar_arrive(&sm.p_empty[s]);
        if (t + ring < nt)   // the producer (FP8: the tile's score warpgroup) refills the buffer: tile t + ring
          mbar_arrive(&sm.empty[b]);
        if (warp == 8) KDTREE_DTRACE(7);
      }
      bar_sync(kBarBlock, 128 + kValueThreads);   // row_l written by score warpgroup 0 (which only arrives)
      // the FP8 form reads the item's context again for its stores: kept across the tile loop, its registers make
      // ptxas serialise every wgmma of the kernel in the profiling build (KDTREE_EXP_TRACE; tools/wgmma_check.sh)
      const ItemCtx cx = Fp8 ? item_ctx<kBlockM, kTileN, Fp8>(prm, item) : cx0;
      KDTREE_ITEM_STORE_BEGIN(vt == 255);
      // the ring's first 64 KB hold the rows on their way out (wg::store_o_rows_staged): every tile's S and
      // P V is done (the score side's last S before its P, which the value side consumed), no copy is in flight (none
      // past the item's last tile), and the next item's copies start after the closing barrier
      if (e4)   // (P^T held 448 P; the values count v_scale times their e4m3)
        store_o_t_rows_staged(prm, cx, warp & 3, lane, v, o, sm.row_l, prm.v_scale * (1.f / 448.f),
                              smem_u32(&sm.kv[0][0]), kBarValues, kValueThreads);
      else
        wg::store_o_rows_staged(prm, cx, wrow, lane, v, o, sm.row_l, smem_u32(&sm.kv[0][0]), kBarValues,
                                kValueThreads);
      mbar_arrive(&sm.ring_free);   // (release: this thread's reads of the ring are done)
      sync_block_roles();
      KDTREE_ITEM_STORE_END(vt == 255);
      // every partial of the item is stored (score warpgroup 0's log-sum-exps before the barrier, both value
      // warpgroups' O): the release, on the value side (on the score side, where registers are tightest, ptxas
      // spilled)
      if (vt == 255) signal_item_done(prm, cx);
    }
  } else if constexpr (!Fp8) {
    // =========================== producer warpgroup ===========================
    // every tile of the item in order: 0 .. kQFirst - 1 at once, the rest of the first ring once q has landed, then
    // tile t into buffer t % kRing once both value warpgroups are done with tile t - kRing there; producer thread
    // pt copies chunk pt % 8 of every slab of keys pt / 8 and pt / 8 + 16, and loads the slot ids two tiles ahead
    // (ids loaded one tile ahead wait behind that tile's cp.async: two ahead is 1.3-1.8% faster at P131072, H200)
    wg::set_max_regs<kProducerRegs, kLaunchRegs<Fp8>>();
    const int pt = tid - 512;   // 0..127
    uint32_t empty_bits = 0u;
    for (int k = 0;; ++k) {
      const int item = wg::wait_item(k, sm.item, &sm.item_full);   // the score side's item fetch (acquire)
      if (item >= total) return;
      const ItemCtx cx = item_ctx<kBlockM, kTileN, Fp8>(prm, item);
      const int nt = cx.ntiles;
      long long slot[kProducerKeys], next[kProducerKeys], ahead[kProducerKeys];
      wg::tile_slots<kProducerKeys>(prm, cx, 0, pt, slot);
      wg::tile_slots<kProducerKeys>(prm, cx, 1, pt, next);
      // the previous item's rows have left the ring (ordered by the barrier below as well, but compute-sanitizer's
      // racecheck does not take a barrier between roles for a hand-off: an mbarrier it does)
      if (k > 0) mbar_wait(&sm.ring_free, (k - 1) & 1);
      // (q_full completes once per item: parity k & 1; the producer waits for it in every item, also when the item
      // has no more than kQFirst tiles)
      const int n_issue = kQFirst < kRing && nt <= kQFirst ? kQFirst + 1 : nt;
      for (int t = 0; t < n_issue; ++t) {
        if (warp == 16) KDTREE_DTRACE(15);   // (TRACE) the producer's loop top: the last tile's slot ids moved in
        wg::tile_slots<kProducerKeys>(prm, cx, t + 2, pt, ahead);
        if (kQFirst < kRing && t == kQFirst) {
          KDTREE_DSTART(pt == 0, 6);
          mbar_wait(&sm.q_full, k & 1);
        }
        const int b = t % kRing;
        if (warp == 16) KDTREE_DTRACE(13);   // (TRACE) the producer's wait for the buffer starts
        if (t >= kRing) mbar_wait_buffer(sm.empty, empty_bits, b);
        if (warp == 16) KDTREE_DTRACE(6);   // (TRACE) tile t's copies start
        gather_tile(sm, prm, cx, t, b, pt, slot);   // (nothing at t >= nt)
        if (warp == 16) KDTREE_DTRACE(12);   // (and issued)
        if (t == 0) KDTREE_DSTART(pt == 0, 5);
        if (t == kRing - 1) KDTREE_DSTART(pt == 0, 7);
#pragma unroll
        for (int h = 0; h < kProducerKeys; ++h) {
          slot[h] = next[h];
          next[h] = ahead[h];
        }
      }
      sync_block_roles();   // the value side's staged store has left the ring before the next item's copies
    }
  }
#else
  __trap();   // built without sm_90a: the launcher never selects this kernel
#endif
}

}  // namespace dual
}  // namespace kdtree
