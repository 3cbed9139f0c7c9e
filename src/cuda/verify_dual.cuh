// verify_dual.cuh: the sm_90a split pass with two score warpgroups ("dual"): the same work items (64-row
// tiles, 32-key tiles), plan, partials and combine as the wgmma kernel in verify_wgmma.cuh.
//
// Why (docs/PERF_LOG.md, session 9): in the wgmma kernel one score warpgroup issues the 36 wgmma of every
// tile's S and runs every tile's softmax. Issuing a wgmma blocks while the tensor pipe is busy (with the
// value warpgroups' P V), so the softmax waits behind the issue: a tile takes ~2,650 clocks at P131072
// against ~1,500 of tensor and shared-memory work. Here two score warpgroups own alternate tiles, so one
// runs its softmax while the other's S is on the tensor cores:
// - 4 warpgroups, 512 threads. A 512-thread kernel caps ptxas at 128 registers for any one instruction,
//   so P V runs as two wgmma m64n128k16 per k-step (m64n256k16 needs 154); setmaxnreg then gives the
//   score warpgroups 96 registers and the value warpgroups 160 (88 / 168 before session 23).
// - Score warpgroup s (s = 0, 1) owns tiles t = s, s + 2, ...: S_t = Q K_t^T (36 wgmma m64n32k16, both
//   operands in shared memory), the tile's row maxima, then the running maxima: it waits for m_{t-1}
//   (published by the other score warpgroup on m_full as soon as that tile's maxima were known, before
//   its P), publishes m_t the same way, and computes P_t and alpha_t into its own P buffer (p[s],
//   64-byte swizzle) for the value warpgroups (p_full[s] release / acquire, named barrier kBarPFull + s
//   for the wake-up; p_empty[s] gives the buffer back). Each keeps the row sums of its own tiles,
//   relative to its own latest max; score warpgroup 1 hands its sums to warpgroup 0 at the end of the
//   item (l_full), which merges them.
// - Value warpgroups v = 0, 1 (columns [256 v, 256 v + 256) of all 64 rows, 128 fp32 per thread): for
//   every tile in order, O = alpha_t O + P_t V_t. With KDTREE_DUAL_PRODUCER=0 they gather the keys as in the
//   wgmma kernel (4 stages), but refill a buffer while the next tile's P V runs (after P V, the gather took
//   ~600 of their clocks per tile in the wgmma kernel's trace, session 9): tiles up to t + 3 are in the ring
//   during P V (t).
// - Since session 25 (the default, KDTREE_DUAL_PRODUCER) a fifth warpgroup, the producer, gathers every key tile
//   into the same 4-stage ring instead, as soon as both value warpgroups are done with a buffer (640 threads;
//   below).
// Measured (H200, history 73-79): 4-6% faster than the wgmma kernel on every shape of the benchmark; the
// score warpgroups now spend most of their time waiting for their tiles to land (463 MB into the SMs at 3.7
// TB/s at H16 N9 P131072, about half what the SMs take in when nothing waits on the buffers: session 11,
// history 85 and 90, so the chain through the four key buffers sets the period), and shared memory has no
// room for a fifth key stage.
#pragma once

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
using wg::kValueThreads;

constexpr int kStages = 4;                     // even: each score warpgroup waits only on its own buffers
constexpr int kThreads = 512;                  // 2 score + 2 value warpgroups (+ 128 with the producer: kThreadsOf)
// A producer warpgroup (KDTREE_DUAL_PRODUCER, session 25, the default; 0: session 23's four warpgroups): a fifth
// warpgroup gathers every key tile, so the value warpgroups only wait for P, rescale O and run P V (session 23's trace:
// the next tile's 9 cp.async per value thread took ~810 of their ~1,800 busy clocks per tile). A value thread arrives
// on empty[b] once its P V of buffer b is done; the producer refills the buffer when all 256 have. ptxas sizes a
// setmaxnreg kernel's launch for whole warpgroups (640 threads: 96 registers; a 17th warp alone would launch the block
// at 96 as well and leave nothing to give the value warpgroups), so the producer is a whole warpgroup, 2 keys per
// thread as with SRefill, and the registers go: producer KDTREE_DUAL_PRODUCER_REGS (48; 32 before session 28), score
// warpgroups KDTREE_DUAL_PRODUCER_SCORE_REGS (56; 64 before session 28: no k-steps of q in registers, KDTREE_DUAL_QREG
// 0), value warpgroups KDTREE_DUAL_PRODUCER_VALUE_REGS (160; 152 spills). With it the two score warpgroups' S overlap
// again (KDTREE_DUAL_S_SERIAL 0). Only the default instantiation takes it (Pair and SRefill never).
// Measured (H200, session 25, PERF_LOG history 154-155; A/B within one run, means of two, against session 23's
// default): the producer alone (S in turn, QREG 0) -0.5 to +2.9% (the value side's copies were not what set the
// period; QREG 0 alone +0.6 to +2.9%); with S overlapped -1.6% at H16 N9 P131072 (122.4 against 124.3 us), -2.1% at
// P185000, -1.2% H128 N9, -0.7% B8, +0.6% P8192.
#ifndef KDTREE_DUAL_PRODUCER
#define KDTREE_DUAL_PRODUCER 1
#endif
#ifndef KDTREE_DUAL_PRODUCER_REGS
#define KDTREE_DUAL_PRODUCER_REGS 48
#endif
#ifndef KDTREE_DUAL_PRODUCER_SCORE_REGS
#define KDTREE_DUAL_PRODUCER_SCORE_REGS 56
#endif
#ifndef KDTREE_DUAL_PRODUCER_VALUE_REGS
#define KDTREE_DUAL_PRODUCER_VALUE_REGS 160
#endif
static_assert(KDTREE_DUAL_PRODUCER == 0 || KDTREE_DUAL_PRODUCER == 1, "KDTREE_DUAL_PRODUCER: 0 or 1");
// Measured and removed (session 29, PERF_LOG history 175; commit 7ec5a9c holds it): KDTREE_DUAL_PAIR_PRODUCER, the pair
// instantiation (S over 64 keys, half of S's q reads) with the producer, the lazy reference and slot ids one tile
// ahead: +7.9 to +11.5% on every shape (H16 N9 P131072 126.1 against 115.2 us), sanitizer-clean. A pair's S waits for
// two tiles of the four-buffer ring.
template <bool Pair, bool SRefill>
constexpr bool kProducer = KDTREE_DUAL_PRODUCER && !SRefill && !Pair;
template <bool Pair, bool SRefill> constexpr int kThreadsOf = kProducer<Pair, SRefill> ? kThreads + 128 : kThreads;
// the launch's registers a thread, one block per SM: 128 at 512 threads, 96 at 640
template <bool Pair, bool SRefill> constexpr int kLaunchRegsOf = (65536 / kThreadsOf<Pair, SRefill>) / 8 * 8;
constexpr int kProducerKeys = 2;               // keys of a tile per producer thread (wg::copy_tile, 8 threads a key)
constexpr int kProducerRegs = KDTREE_DUAL_PRODUCER_REGS;
// setmaxnreg: 2 x 96 + 2 x 160 = 512 = 4 x 128 (the launch's): the score warpgroups hold 16 scores and 32 registers
// of q per thread (KDTREE_DUAL_QREG); 2 x 88 + 2 x 168 without q in registers. With Pair they hold 32 scores per
// thread, not 16, and with SRefill they gather the keys: 2 x 96 + 2 x 160.
// S's last KDTREE_DUAL_QREG k-steps take q from registers (session 23, default 8; 0: all 36 from shared memory).
// Each score thread holds 4 registers of q per such k-step for the whole item, loaded by ldmatrix once q has landed.
// Those k-steps read 1 KB of keys from shared memory instead of 3 KB: at 32 keys S is bound by its q reads, 192 B per
// clock of shared memory's 128. Measured (H200, history 147): 8 -1.3 to -2.2% on every benchmark shape, 4 -0.9 to
// -1.8%; 9 or more spill at 96 registers, and the value warpgroups spill below 160. With the producer warpgroup (its
// score warpgroups at 64 registers) 0: 1 already spills.
#ifndef KDTREE_DUAL_QREG
#define KDTREE_DUAL_QREG (KDTREE_DUAL_PRODUCER ? 0 : 8)
#endif
constexpr int kQReg = KDTREE_DUAL_QREG;
static_assert(kQReg >= 0 && kQReg <= 8, "KDTREE_DUAL_QREG: 0 .. 8 k-steps");
template <bool Pair, bool SRefill>
constexpr int kScoreRegs =
    kProducer<Pair, SRefill> ? KDTREE_DUAL_PRODUCER_SCORE_REGS : Pair || SRefill || kQReg > 0 ? 96 : 88;
template <bool Pair, bool SRefill>
constexpr int kValueRegs =
    kProducer<Pair, SRefill> ? KDTREE_DUAL_PRODUCER_VALUE_REGS : Pair || SRefill || kQReg > 0 ? 160 : 168;
// what the score (and producer) warpgroups give back must cover what the value warpgroups take (setmaxnreg.inc waits
// for it: the block's pool is what it got at launch)
template <bool Pair, bool SRefill>
constexpr bool kRegPoolFits =
    2 * (kValueRegs<Pair, SRefill> - kLaunchRegsOf<Pair, SRefill>) <=
    2 * (kLaunchRegsOf<Pair, SRefill> - kScoreRegs<Pair, SRefill>) +
        (kProducer<Pair, SRefill> ? kLaunchRegsOf<Pair, SRefill> - kProducerRegs : 0);
static_assert(kRegPoolFits<false, false> && kRegPoolFits<true, false> && kRegPoolFits<false, true>, "register pool");
constexpr int kPRowBytes = kTileN * 2;         // 64: P rows in the 64-byte swizzle (K-major A)
constexpr int kPBytes = kBlockM * kPRowBytes;  // 4,096
constexpr int kQFirst = wg::kQFirst;

// Named barriers (0 is __syncthreads).
constexpr int kBarBlock = 1;    // score warpgroup 0 and the value warpgroups: row sums of the item stored
constexpr int kBarPFull = 2;    // + s: score warpgroup s arrives, the value warpgroups wait (wake-up)
constexpr int kBarValues = 4;   // the two value warpgroups: the key tile consumed, may refill
constexpr int kBarScore = 5;    // the two score warpgroups: q of the item in shared memory

// The two score warpgroups' S in turn (session 22): S (u) is issued once the other warpgroup's step u - 1 has its S and
// row maxima (m_full), instead of both S overlapped (0, sessions 9-21; kept as the switch's other value for A/Bs).
// Measured (H200, session 22, A/B within one run, means of two; PERF_LOG history 139-141): -1.6 to -2.4% on the long
// shapes (H16 N9 P131072 127.2 against 129.9 us, P185000 168.7 / 172.7, H128 N9 P32768 186.4 / 190.8, B8 274.7 /
// 279.7), P8192 unchanged. Measured and removed (commits ee3fc9b, 22060ef): S after the other's S alone (an mbarrier
// arrived after its wgmma wait), every step or only an item's first two: -0.4 to -1.0% against 0; S after the other's
// P as well (p_full): 14-19% slower. With the producer warpgroup (session 25) 0 is the faster form again: -0.4 to -4.0%
// against S in turn (-2.5% at H16 N9 P131072; history 155), so it is that form's default.
#ifndef KDTREE_DUAL_S_SERIAL
#define KDTREE_DUAL_S_SERIAL (KDTREE_DUAL_PRODUCER ? 0 : 1)
#endif
constexpr bool kSSerial = KDTREE_DUAL_S_SERIAL;
static_assert(KDTREE_DUAL_S_SERIAL == 0 || KDTREE_DUAL_S_SERIAL == 1, "KDTREE_DUAL_S_SERIAL: 0 or 1");

// P's hand-off (session 26, the producer form's default; PERF_LOG history 159, 161): the trace had a tile's softmax end
// near the other score warpgroup's S end, as if P's stores waited behind S's shared-memory reads, and the proxy fence
// after them (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S) holds the score warpgroup until they have completed.
// - KDTREE_DUAL_P_WRITER_FENCE = 0: no proxy fence after P's stores. The value warpgroups' fence after they acquire P
//   and the tile orders P for their wgmma: a proxy fence anywhere on the release / acquire path from the store to the
//   wgmma does, as for the producer's cp.async tiles, which every reader fences after its wait.
// - KDTREE_DUAL_P_STMATRIX = 1: a score thread stores its P by two stmatrix.x4 instead of eight 4-byte stores (the same
//   bytes in a quarter of the instructions).
// Measured (H200, A/B within one run, means of two): no fence -0.6 to -1.1%, stmatrix alone -0.3 to +1.1%, both -0.6 to
// -1.4% (H16 N9 P131072 119.3 against 120.6 us); the trace's running max to P published ~1,000 against ~1,430 clocks.
// Both apply to the producer form's default instantiation only (not Pair or SRefill); KDTREE_DUAL_PRODUCER=0 keeps
// session 23's hand-off (fence, 4-byte stores).
#ifndef KDTREE_DUAL_P_STMATRIX
#define KDTREE_DUAL_P_STMATRIX KDTREE_DUAL_PRODUCER
#endif
#ifndef KDTREE_DUAL_P_WRITER_FENCE
#define KDTREE_DUAL_P_WRITER_FENCE (!KDTREE_DUAL_PRODUCER)
#endif

// Measured and removed in session 28 (history 160, 163-165; commit 2fffb7a holds both): the producer copying a tile's
// slabs 0-4 first and S starting on them (KDTREE_DUAL_SPLIT_FULL: +3.4 to +5.5% without spills, +17% with), and each
// value warpgroup releasing the slabs it reads on its own mbarrier so that half a tile's copies start a P V earlier
// (KDTREE_DUAL_HALF_RELEASE: +11.7 to +17.0% without spills, +28% with).
// Measured and removed in session 26 (history 160, 162): S issued as 4 commit groups (+0.4%, commit 88f0b90), an L2
// bulk prefetch of tile t + D's key rows by the producer (+59 to +74%: a uniform UBLKPF in a loop over the lanes, and
// spills; 88f0b90), an L2 prefetch of tile t + D's slot-id lines (+1.3 to +3.1%, 9634123).

// A lazy reference maximum (session 27, the producer form's default; PERF_LOG history 165-166), after FlashAttention-4's
// conditional rescale: KDTREE_DUAL_LAZY_RESCALE = tau > 0 moves a row's reference maximum (the m that P subtracts,
// chained between the score warpgroups) only when the row's maximum exceeds it by more than tau (log2 units), so P <=
// 2^tau (bf16 keeps its relative precision there) and alpha is exactly 1 in almost every tile: the value warpgroups'
// rescale of O is skipped (rescale_o, per warp), and the sums and O stay relative to one reference, so the result is
// the same up to rounding. Measured (H200, A/B within one run, means of two): tau 8 -1.9% at H16 N9 P131072 (118.3
// against 120.5 us), -3.1% P185000, -3.3% H128 N9 P32768, -4.5% B8, -2.4% P8192.
// Measured and removed (history 165; commit df8ba6a holds it): KDTREE_DUAL_PV_DEFER, P V (t) issued before P V (t - 1)
// completed (O rescaled behind a wait where a score warp flagged an alpha that is not 1): +4.0% with tau 8, +8.8%
// without.
#ifndef KDTREE_DUAL_LAZY_RESCALE
#define KDTREE_DUAL_LAZY_RESCALE (KDTREE_DUAL_PRODUCER ? 8 : 0)
#endif
// The producer form (the default instantiation) takes it.
template <bool Pair, bool SRefill>
constexpr bool kLazyOf = kProducer<Pair, SRefill> && KDTREE_DUAL_LAZY_RESCALE > 0;
static_assert(KDTREE_DUAL_LAZY_RESCALE >= 0, "KDTREE_DUAL_LAZY_RESCALE: 0 (off) or tau > 0");

// KDTREE_DUAL_SLOT_AHEAD = 2 (session 27; the default since session 28, PERF_LOG history 170-171): the producer loads
// tile t + 2's slot ids at the top of tile t instead of tile t + 1's. Session 27's trace had the producer's own loop
// as the period (~1,760 clocks: ~950 issuing a tile's 18 cp.async per thread, ~670 between tiles, ~160 waiting for the
// buffer); the SASS moves the slot ids loaded at the top of a tile into the copy registers at its end, and those moves
// waited ~340 clocks, as if a load queued behind the tile's cp.async. 1 loads one tile ahead. Measured (H200, A/B
// within one run, means of two, two calls), with the producer at 48 registers and the score warpgroups at 56 (the
// split alone is neutral, history 165): H16 N9 P131072 -1.3 / -1.8%, P185000 -0.7 / -1.1%, contiguous -1.3 / -1.6%,
// P8192 -0.2 / -0.6%, B8 +1.1 / -0.4%, H128 N9 +0.6 / +0.7%; at 32 producer registers alone -0.5%. The TRACE build of
// this default spills 12 B (compiler), so its traced times are an upper bound.
#ifndef KDTREE_DUAL_SLOT_AHEAD
#define KDTREE_DUAL_SLOT_AHEAD 2
#endif
static_assert(KDTREE_DUAL_SLOT_AHEAD == 1 || KDTREE_DUAL_SLOT_AHEAD == 2, "KDTREE_DUAL_SLOT_AHEAD: 1 or 2");
// KDTREE_DUAL_ALPHA_EARLY = 1 (session 29, the default; 0: after both, as before): the value warpgroups load the
// step's alpha right after they acquire p_full, before their wait for the tile's buffer and the proxy fence, so that
// the load's latency is not on the path from P to P V's issue (ncu, history 177: the alpha test after its LDS held
// 4.3% of the split kernel's stall samples, LDS 5.5%). Measured (H200, A/B within one run, means of two, history 178):
// H16 N9 P131072 -0.9% (115.2 against 116.3 us), contiguous -0.8%, H128 N9 -0.6%, B8 -1.1%, P185000 -0.1%, P8192
// +0.5% (0.1 us); sanitizer-clean.
#ifndef KDTREE_DUAL_ALPHA_EARLY
#define KDTREE_DUAL_ALPHA_EARLY 1
#endif
// Measured and removed in session 30 (PERF_LOG history 183; commit ebf7bcd holds it): KDTREE_DUAL_PV_RS, the value
// warpgroups' P V with P from registers (ldmatrix once per k-step, wgmma m64n128k16 RS; half of P V's shared-memory reads
// of P). It needs 168 value registers (at 160 ptxas serialises the wgmma), so the producer 32 and slot ids one tile
// ahead (SLOT_AHEAD 2 spills there): +5.7% at H16 N9 P131072, +3.7% against the same registers without it (the
// ldmatrix sits between P's acquire and P V's issue, on the chain). Correct (70 kernel tests).
// Measured and removed in session 30 (PERF_LOG history 180; commit ed8d503 holds it): KDTREE_MIXED=dual, a mixed
// call's 16-row remainder tile (H16 N9: 64 + 64 + 16) as items of this kernel itself, beside the full tiles' items in
// one work list: S^T = K q^T and O^T += V^T P^T over pairs of ring buffers (64 keys as the wgmma M, the skinny kernel's
// math), the ring in the pair layout. Correct (70 kernel tests) but slower at every remainder item count: a remainder
// item took ~32-35 ns per key, a full one ~36 (with both products knocked out ~25 and ~24), so it costs ~0.9-1.0 of a
// full item however little tensor work it has: H16 N9 P131072 +7.8% at 40 remainder items, +22% at 32, +51% at 26.
// Measured and removed in session 34 (PERF_LOG history 190-191; commit 0cb44f4 holds it): the combine fused into this
// kernel (KDTREE_FUSED_COMBINE_ROWS): after the block's last item its value warpgroups ran the combine's works, 128
// threads each playing the combine block's 256 (bit-identical output), waiting for tiles only once every block had
// started (else deferring to the last block out), and no combine kernel ran. Correct and sanitizer-clean, but slower
// on every shape in all four forms (best: H16 N9 P131072 +1.6%, P8192 +12.8%, B8 +4.3%). Inferred, not profiled: two
// warpgroups of 128 threads a block take the split pass's partials in slower than four combine blocks of 256 threads
// an SM do, by more than the ~1.1 us the combine's blocks wait for the split blocks' SMs.
// Measured and removed in session 28 (PERF_LOG history 171, 174):
// - the producer warpgroup as two halves on alternate tiles (KDTREE_DUAL_PRODUCER_HALVES, commit f8fb5f3): +0.4 to
//   +2.4% with 56 / 48 registers; each half then waits ~1,600 clocks for its buffer (the ring's release binds);
// - P of tile t in its own buffer's rope slab, with alpha and p_full per buffer, so that no score warpgroup waits on
//   p_empty (KDTREE_DUAL_P_IN_RING, commit 696aa2e): +3.4 to +4.0% at the long prefixes without spills, +8.5 to
//   +10.4% with the 20 B per item that it spills at 56 score registers.

struct Smem {
  unsigned char q[kSlabs * kQSlabBytes];   // 73,728: q of the item (the struct sits on a 1 KB boundary)
  unsigned char kv[kStages][kTileBytes];   // 147,456
  unsigned char p[2][kPBytes];             // P of score warpgroup s's latest tile
  float alpha[2][kBlockM];                 // its rescale factors
  float m[2][kBlockM];                     // the running row maxima after its latest tile
  float xl[kBlockM], xmu[kBlockM];         // score warpgroup 1's row sums at the end of an item, their max
  float row_l[kBlockM];                    // the item's row sums, for the value warpgroups
  unsigned long long full[kStages];   // tile landed: one arrival per copying thread (256 value, 128 producer or score)
  unsigned long long empty[kStages];  // producer / SRefill: the value warpgroups are done with the buffer (256 arrivals)
  unsigned long long p_full[2];       // P / alpha of score warpgroup s published: 128 arrivals (release)
  unsigned long long p_empty[2];      // consumed: 256 value-thread arrivals (release)
  unsigned long long m_full[2];       // m of score warpgroup s's latest tile published: 128 arrivals
  unsigned long long q_full;          // q of the item landed: 256 score-thread arrivals (KDTREE_WG_Q_FIRST)
  unsigned long long l_full;          // score warpgroup 1's row sums stored: 128 arrivals
  unsigned long long item_full;       // the block's next work item stored: 1 arrival (release)
  unsigned long long q_land;          // q of the item landed by TMA (Params::q_tma): 1 arrival + its 72 KB
  int item[2];   // the block's k-th work item in item[k % 2]
  unsigned long long ring_free;       // the producer: the item's rows have left the ring (256 value-thread arrivals)
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;   // + room to align the base to 1 KB
static_assert(kSmemBytes <= 232448, "sm_90 gives a block at most 227 KB of shared memory");
static_assert(kPBytes % 512 == 0, "64-byte swizzle atoms (8 rows x 64 B) stay 512 B aligned");
static_assert(kStages % 2 == 0, "a buffer's tiles all belong to one score warpgroup");

#ifdef KDTREE_EXP_TRACE   // profiling aid: per-tile clock stamps of block 0 (shared memory has no room for them),
// in trace::g_tile, printed after the call (wg::trace)
#define KDTREE_DTRACE(e)                                                                    \
  do {                                                                                      \
    if (blockIdx.x == 0 && lane == 0 && k < wg::trace::kItems && t < wg::trace::kTiles)     \
      wg::trace::g_tile[0][k][t][e] = (unsigned)(clock64() - t_item);                       \
  } while (0)
// the start of block 0's first item, in SM clocks (session 20): score thread 0's item start, q copies issued, its q
// landed, both score warpgroups' q landed; value thread 0's item start, tile 0 issued (after its slot ids), tiles
// 0 .. kQFirst-1 issued, the whole ring issued (after q landed)
__device__ long long g_start[8];
__device__ int g_start_qfirst;   // kQFirst once g_start holds a call's stamps (the dump kernel clears it)
#define KDTREE_DSTART(cond, e) do { if (blockIdx.x == 0 && k == 0 && (cond)) g_start[e] = clock64(); } while (0)
#else
#define KDTREE_DTRACE(e) do { } while (0)
#define KDTREE_DSTART(cond, e) do { } while (0)
#endif

// Pair (KDTREE_SPLIT_KERNEL=pair, session 16): score warpgroup s owns the pair of 32-key buffers 2s, 2s + 1 and runs
// S over both at once as m64n64k16 (the same FLOPs with half of m64n32k16's q reads from shared memory, the busiest
// pipe: 864 of the ~1,436 wavefronts per tile, history 90; beside P V 37.4 against 63.7 clocks per m64n32k16's FLOPs,
// history 91), one softmax and one running-max hand-off per 64 keys. For one descriptor to span both, a pair's slabs
// interleave: slab j of pair p holds its 64 keys at p * 2 kTileBytes + j * 2 kSlabBytes, buffer 2p + h's 32 keys at
// + h kSlabBytes. P of buffer h's keys goes where that buffer's rope columns were (slab 8, read only by S): 4 KB, the
// size of the P buffer it replaces, freed with the buffer when the value warpgroups are done with it. A pair whose
// second tile is past the item's last runs its S over that buffer's stale keys, all of them masked (key >= k1).
// Measured (H200, session 16, history 110): correct and sanitizer-clean, but 13-14% slower than the default on every
// shape of 64-row items (H16 N9 P131072 153.2 against 135.3 us): a pair's S waits for both of its tiles, so the ring
// runs 2 tiles ahead of the one in P V, not 3. Never chosen.

template <bool Pair>
struct Ring {
  static constexpr int kSlabStride = Pair ? 2 * kSlabBytes : kSlabBytes;
  static constexpr int kStepTiles = Pair ? 2 : 1;   // 32-key tiles per score step (one S, one softmax)
  // byte offset of buffer b's first slab in the ring
  static __device__ __forceinline__ uint32_t buffer(int b) {
    return Pair ? (b >> 1) * 2 * kTileBytes + (b & 1) * kSlabBytes : b * kTileBytes;
  }
  // score steps of an item of nt tiles
  static __device__ __forceinline__ int steps(int nt) { return (nt + kStepTiles - 1) / kStepTiles; }
};

// Where the P of tile buffer b lives, written by score warpgroup s: p[s], or with Pair the buffer's rope slab.
template <bool Pair>
__device__ __forceinline__ unsigned char* p_buffer(Smem& sm, int s, int b) {
  return Pair ? &sm.kv[0][0] + Ring<Pair>::buffer(b) + (kSlabs - 1) * Ring<Pair>::kSlabStride : &sm.p[s][0];
}

// Copier thread i's part of tile t (Keys keys: wg::copy_tile) into ring buffer b, then its arrival on the buffer's
// mbarrier once it has landed; nothing past the item's last tile.
template <bool Pair, int Keys>
__device__ __forceinline__ void gather_tile(Smem& sm, const Params& prm, const ItemCtx& cx, int t, int b, int i,
                                            const long long (&slot)[Keys]) {
  wg::copy_tile<Keys, Ring<Pair>::kSlabStride>(smem_u32(&sm.kv[0][0]) + Ring<Pair>::buffer(b), &sm.full[b], prm, cx, t,
                                               i, slot);
}

// SRefill (KDTREE_SPLIT_KERNEL=srefill, session 16): the score warpgroups gather the keys, each into its own buffers
// (score warpgroup s: tiles t = s mod 2, the first two with q), and refill the buffer of tile t - 2 with tile t + 2 once
// both value warpgroups are done with it (empty[b]): before waiting for tile t, or (KDTREE_DUAL_SREFILL_AFTER_S=1)
// while S (t) runs. The value warpgroups copy nothing: in the default they refill buffer (t - 1) % 4 after the wait
// for P (t) and the issue of P V (t), ~2,600 clocks after P V (t - 1) freed it (trace, session 16), and issuing the
// copies earlier there delays P V (t) (history 77, 80). Measured (H200, session 16, history 111): correct and
// sanitizer-clean, but slower: 18% before the wait (H16 N9 P131072 159.8 against 135.3 us; a tile's S then ends
// ~10,800 clocks after its copies were issued, against ~5,200 in the default: earlier copies land later), 3% while S
// runs (139.3 against 135.5). Never chosen.
#ifndef KDTREE_DUAL_SREFILL_AFTER_S
#define KDTREE_DUAL_SREFILL_AFTER_S 0
#endif
constexpr bool kSRefillAfterS = KDTREE_DUAL_SREFILL_AFTER_S;
// The item's O rows out through shared memory, 16 B per lane (wg::store_o_rows_staged; session 18); 0: session 17's
// 4-byte stores from the accumulators.
#ifndef KDTREE_DUAL_STAGED_STORE
#define KDTREE_DUAL_STAGED_STORE 1
#endif
static_assert(kStages * kTileBytes >= kBlockM * 1024, "the ring holds an item's 64 rows of 512 bf16");

template <bool Pair, bool SRefill>
__global__ void __launch_bounds__(kThreadsOf<Pair, SRefill>, 1)
    kdtree_verify_split_dual_kernel(const __grid_constant__ Params prm) {
  static_assert(!SRefill || !Pair, "SRefill: one tile per score step");
  [[maybe_unused]] constexpr bool kProd = kProducer<Pair, SRefill>;   // (unused where the body is not built: sm_120)
  [[maybe_unused]] constexpr int kRegs0 = kLaunchRegsOf<Pair, SRefill>;
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem& sm = wg::smem_1k<Smem>(smem_raw);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int c = lane & 3;
  const int wrow = (warp & 3) * 16;   // rows of this warp within the tile
  KDTREE_TIMELINE(2, 0);
  grid_dependency_wait();   // the plan kernel's counter and plan
  // after the wait: in a mixed call the next kernel is the skinny one, which reads the plan as soon as it starts
  // (verify_skinny.cuh, Rem)
  grid_dependency_launch_dependents();
  KDTREE_TIMELINE(2, 1);
  const int total = prm.counter[1];
  const int H = prm.heads;

  if (tid == 0) {
    for (int b = 0; b < kStages; ++b) {
      mbar_init(&sm.full[b], SRefill || kProd ? 128 : kValueThreads);
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
    if (kProd) mbar_init(&sm.ring_free, kValueThreads);
    fence_proxy_async();
  }
  __syncthreads();

  if (warp < 8) {
    // =========================== score warpgroups ===========================
    wg::set_max_regs<kScoreRegs<Pair, SRefill>, kRegs0>();
    const int s = warp >> 2;   // owns tiles t % 2 == s
    uint32_t full_bits = 0u, mf_parity = 0u, pe_parity = 0u;   // l_full completes once per item: parity k & 1
    uint32_t empty_bits = 0u;   // SRefill
    const int st = tid & 127;   // SRefill: this thread copies chunk st % 8 of keys st / 8 and st / 8 + 16 of a tile
    const SmemDesc qd(smem_u32(&sm.q[0]), 16, 1024);
    for (int k = 0;; ++k) {
      // (the item index goes out on an mbarrier: as for the pingpong kernel's row sums, history 53)
      const int item = wg::fetch_item(prm, k, tid, sm.item, &sm.item_full);
      if (item >= total) return;
      const ItemCtx cx = item_ctx<kBlockM, kTileN>(prm, item);
      const int nt = cx.ntiles;
#ifdef KDTREE_EXP_TRACE
      const long long t_item = clock64();   // just after the item fetch, as the value side's
#endif
      KDTREE_DSTART(tid == 0, 0);

      long long refill_slots[2] = {0, 0};   // SRefill: this thread's two keys of the warpgroup's next refill

      // q of the item: nine TMA boxes (64 rows x one 64-column slab each) from one thread (session 20: the 256 score
      // threads' 4,608 16-byte copies took ~7,900 clocks to issue beside the value side's first tiles, history 134),
      // or over the 256 score threads, all copies in flight at once
      const bool q_tma = !SRefill && !Pair && prm.q_tma;   // (the opt-in Pair kernel spilled 120 B with it)
      if (q_tma) {
        if (tid == 0) wg::issue_q_tma(prm, cx, H, sm.q, &sm.q_land);
      } else {
        // (with the producer the score warpgroups hold 64 registers: the thread index read again per item, so that
        // ptxas does not keep this path's per-thread addresses live across the item loop, which spilled them)
        wg::issue_q_copies(prm, cx, H, sm.q, kProd ? thread_index_now() : tid, 256);
      }
      KDTREE_DSTART(tid == 0, 1);
      if (q_tma) {
        mbar_wait(&sm.q_land, k & 1);   // (rows past the tensor's last are zeros; rows of the next request are
                                        // padding rows here, computed and dropped like zero rows)
      } else if constexpr (SRefill) {   // then this warpgroup's first two tiles, s and s + 2
        cp_async_commit();
        long long s0[2], s1[2];
        wg::tile_slots<2>(prm, cx, s, st, s0);
        wg::tile_slots<2>(prm, cx, s + 2, st, s1);
        wg::tile_slots<2>(prm, cx, s + 4, st, refill_slots);
        gather_tile<Pair, 2>(sm, prm, cx, s, s, st, s0);
        gather_tile<Pair, 2>(sm, prm, cx, s + 2, s + 2, st, s1);
        cp_async_commit();
        cp_async_wait_group<1>();   // this thread's q copies
      } else {
        cp_async_wait_all();   // this thread's q copies (the score warpgroups issue no other cp.async)
      }
      KDTREE_DSTART(tid == 0, 2);
      fence_proxy_async();   // read next by wgmma (the async proxy)
      if constexpr (!SRefill) mbar_arrive(&sm.q_full);   // the value warpgroups may ask for the rest of the ring
      bar_sync(kBarScore, 256);
      KDTREE_DSTART(tid == 0, 3);
      // q of S's last kQReg k-steps into registers
      constexpr bool kQRegs = kQReg > 0 && !Pair && !SRefill;
      uint32_t qa[kQRegs ? kQReg : 1][4];
      if constexpr (kQRegs) wg::load_q_regs(qa, sm.q, wrow, lane);

      float mu[2] = {-INFINITY, -INFINITY};   // m_use of this warpgroup's latest tile (its sums' reference)
      float l_own[2] = {0.f, 0.f};
      constexpr int kGroups = Ring<Pair>::kStepTiles * kTileN / 8;
      float sc[4 * kGroups];
      const int nu = Ring<Pair>::steps(nt);   // score steps of the item; this warpgroup's: u = s, s + 2, ...
      for (int u = s; u < nu; u += 2) {
        const int t = u * Ring<Pair>::kStepTiles;   // the step's first tile
        // SRefill: tile t + 2 into the buffer of tile t - 2, once P V (t - 2) is done (tiles s and s + 2 came with q);
        // before the wait for tile t, or (KDTREE_DUAL_SREFILL_AFTER_S, an experiment) while S (t) runs
        auto refill_own = [&]() {
          if (t >= s + 2 && t + 2 < nt) {
            mbar_wait_buffer(sm.empty, empty_bits, (t + 2) % kStages);
            gather_tile<Pair, 2>(sm, prm, cx, t + 2, (t + 2) % kStages, st, refill_slots);
            wg::tile_slots<2>(prm, cx, t + 4, st, refill_slots);   // the next refill's, loaded a step ahead
          }
        };
        if constexpr (SRefill && !kSRefillAfterS) refill_own();
        if ((warp & 3) == 0) KDTREE_DTRACE(0);
        if constexpr (Pair) {   // buffers 2s (tile t) and 2s + 1 (tile t + 1, if the item has it)
          mbar_wait_buffer(sm.full, full_bits, 2 * s);
          if (t + 1 < nt) mbar_wait_buffer(sm.full, full_bits, 2 * s + 1);
        } else {
          mbar_wait_buffer(sm.full, full_bits, t % kStages);   // every value thread's copies landed
        }
        fence_proxy_async();   // cp.async wrote the tile (generic proxy); wgmma reads it (async proxy)
        float m_prev[2] = {-INFINITY, -INFINITY};   // m of step u - 1, from the other score warpgroup
        if constexpr (kSSerial) {   // S after the step before's S and maxima
          if (u > 0) {
            mbar_wait(&sm.m_full[1 - s], mf_parity);
            mf_parity ^= 1u;
            m_prev[0] = sm.m[1 - s][wrow + g];
            m_prev[1] = sm.m[1 - s][wrow + g + 8];
          }
        }
        {
          const SmemDesc kd(smem_u32(&sm.kv[0][0]) + Ring<Pair>::buffer(Pair ? 2 * s : t % kStages), 16, 1024);
          if ((warp & 3) == 0) KDTREE_DTRACE(8);   // S issued (past the waits for the tile and the other's maxima)
          wg::wg_fence();
#pragma unroll
          for (int ks = 0; ks < kKSteps; ++ks) {
#ifdef KDTREE_EXP_NO_SCORE_MMA   // profiling aid: one k-step instead of 36
            if (ks > 0) continue;
#endif
            const uint64_t da = qd.at((ks >> 2) * kQSlabBytes + (ks & 3) * 32);
            const uint64_t db = kd.at((ks >> 2) * Ring<Pair>::kSlabStride + (ks & 3) * 32);
            if constexpr (Pair)
              wg::wgmma_m64n64k16_ss(sc, da, db, ks > 0);
            else if (kQRegs && ks >= kKSteps - kQReg)
              wg::wgmma_m64n32k16_rs(sc, qa[kQRegs ? ks - (kKSteps - kQReg) : 0], db, ks > 0);
            else
              wg::wgmma_m64n32k16_ss(sc, da, db, ks > 0);
          }
          wg::wg_commit();
          if constexpr (SRefill && kSRefillAfterS) refill_own();
          wg::wg_wait0();
        }
        if ((warp & 3) == 0) KDTREE_DTRACE(1);
        float tmax[2];
        scale_mask_max<kGroups>(prm, cx, H, cx.k0 + t * kTileN, wrow + g, c, sc, tmax);
        if ((warp & 3) == 0) KDTREE_DTRACE(9);   // the tile's own row maxima
        // the running maxima: m of the step before from the other score warpgroup, this step's published at once
        // (before P)
        float m_run[2] = {m_prev[0], m_prev[1]};
        if (!kSSerial && u > 0) {
          mbar_wait(&sm.m_full[1 - s], mf_parity);
          mf_parity ^= 1u;
          m_run[0] = sm.m[1 - s][wrow + g];
          m_run[1] = sm.m[1 - s][wrow + g + 8];
        }
        if ((warp & 3) == 0) KDTREE_DTRACE(2);
        float m_use[2], alpha[2];
        // m_run: this step's reference (its m without the lazy reference); alpha rescales O (relative to the last)
        softmax_advance_tau<kLazyOf<Pair, SRefill> ? KDTREE_DUAL_LAZY_RESCALE : 0>(tmax, m_run, m_use, alpha);
        if (u + 1 < nu) {   // the other warpgroup's next step reads it (which orders this store after its read of the last)
          if (c == 0) {
            sm.m[s][wrow + g] = m_run[0];
            sm.m[s][wrow + g + 8] = m_run[1];
          }
          mbar_arrive(&sm.m_full[s]);
        }
        // this warpgroup's sums move from its previous step's reference to this one's
        float lfac[2];
        move_sums_reference(mu, m_use, lfac);
        if (u >= 2) {   // the value warpgroups are done with this warpgroup's previous P and alpha
          mbar_wait(&sm.p_empty[s], pe_parity);
          pe_parity ^= 1u;
        }
        // key group j of the step: group j & 3 of tile t + (j >> 2), whose P is in that tile's buffer (Pair: buffer
        // 2 s + (j >> 2)) or p[s]
        if constexpr (KDTREE_DUAL_P_STMATRIX && kProd) {
          // matrix j of half h: rows wrow + 8 h .. + 7, key group j; lane l gives row l % 8 of matrix l / 8
          uint32_t pr[2][4];
          softmax_p_pairs<kGroups>(sc, m_use, lfac, l_own, [&](int j, int half, uint32_t pair) { pr[half][j] = pair; });
          const uint32_t p0 = smem_u32(&sm.p[s][0]);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = wrow + half * 8 + (lane & 7);
            stmatrix_x4(p0 + row * kPRowBytes + ((((lane >> 3) & 3) ^ ((row >> 1) & 3)) << 4), pr[half]);
          }
        } else {
          softmax_p_pairs<kGroups>(sc, m_use, lfac, l_own, [&](int j, int half, uint32_t pair) {
            const int row = wrow + g + half * 8;
            unsigned char* const p = p_buffer<Pair>(sm, s, 2 * s + (j >> 2));
            *reinterpret_cast<uint32_t*>(&p[row * kPRowBytes + (((j & 3) ^ ((row >> 1) & 3)) << 4) + 4 * c]) = pair;
          });
        }
        if (c == 0) {
          sm.alpha[s][wrow + g] = alpha[0];
          sm.alpha[s][wrow + g + 8] = alpha[1];
        }
        // P is read next by wgmma (the async proxy): fenced here, or (the producer form) by the value side after its
        // waits
        if (KDTREE_DUAL_P_WRITER_FENCE || !kProd) fence_proxy_async();
        mbar_arrive(&sm.p_full[s]);
        bar_arrive(kBarPFull + s, 128 + kValueThreads);
        if ((warp & 3) == 0) KDTREE_DTRACE(3);
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
#ifdef KDTREE_EXP_TRACE
      if (tid == 0 && blockIdx.x == 0 && k < wg::trace::kItems) {   // (printed after the call: wg::trace)
        wg::trace::g_item[0][k] = {item, nt, clock64() - t_item};
        wg::trace::g_items[0] = k + 1;
        if (k == 0) g_start_qfirst = kQFirst;
      }
#endif
    }
  } else if (!kProd || warp < 16) {
    // =========================== value warpgroups ===========================
    wg::set_max_regs<kValueRegs<Pair, SRefill>, kRegs0>();
    const int vt = tid - 256;   // 0..255
    const int v = vt >> 7;      // value warpgroup: columns [256 v, 256 v + 256)
    uint32_t full_bits = 0u, pf_bits = 0u, q_parity = 0u;
    for (int k = 0;; ++k) {
      const int item = wg::wait_item(k, sm.item, &sm.item_full);   // the score side's item fetch (acquire)
      if (item >= total) {
        KDTREE_TIMELINE_BY(vt == 0, 2, 2);   // (after the block's last stores)
        return;
      }
      const ItemCtx cx = item_ctx<kBlockM, kTileN>(prm, item);
#ifdef KDTREE_EXP_TRACE
      const long long t_item = clock64();
#endif
      KDTREE_DSTART(vt == 0, 4);

      // prologue: tiles 0 .. kStages-1 on their way, the slot ids of tiles 0 .. kStages loaded together
      long long slot[1] = {0};
      if constexpr (!SRefill && !kProd) {
        long long slots[kStages + 1][1];
#pragma unroll
        for (int t = 0; t <= kStages; ++t) wg::tile_slots<1>(prm, cx, t, vt, slots[t]);
#pragma unroll
        for (int t = 0; t < kStages; ++t) {
          if (t == kQFirst) {   // the rest of the ring once q has landed
            KDTREE_DSTART(vt == 0, 6);
            mbar_wait(&sm.q_full, q_parity);
            q_parity ^= 1u;
          }
          gather_tile<Pair, 1>(sm, prm, cx, t, t, vt, slots[t]);
          if (t == 0) KDTREE_DSTART(vt == 0, 5);
        }
        KDTREE_DSTART(vt == 0, 7);
        slot[0] = slots[kStages][0];
      }

      float o[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] = 0.f;
      // the buffer of the previous tile (both value warpgroups were done with it at the barrier that ended
      // that tile) takes tile t - 1 + kStages
      auto refill = [&](int t) {
        long long next[1];
        wg::tile_slots<1>(prm, cx, t + kStages, vt, next);
        gather_tile<Pair, 1>(sm, prm, cx, t - 1 + kStages, (t - 1) % kStages, vt, slot);
        slot[0] = next[0];
      };

      const int nt = cx.ntiles;
      const int nu = Ring<Pair>::steps(nt);
      for (int t = 0; t < nt; ++t) {
        const int b = t % kStages;
        const int u = t / Ring<Pair>::kStepTiles;   // the score step of tile t, by score warpgroup s
        const int s = u & 1;
        const bool first = !Pair || (t & 1) == 0;   // the step's first tile: its P / alpha to wait for, O to rescale
        if (warp == 8) KDTREE_DTRACE(4);
        float a0 = 1.f, a1 = 1.f;   // (KDTREE_DUAL_ALPHA_EARLY) the step's alpha, loaded after the acquire
        if (first) {
          bar_sync(kBarPFull + s, 128 + kValueThreads);   // P / alpha of the step: wake up ...
          mbar_wait(&sm.p_full[s], (pf_bits >> s) & 1u);  // ... and acquire (complete by now)
          pf_bits ^= 1u << s;
          if constexpr (KDTREE_DUAL_ALPHA_EARLY) {
            a0 = sm.alpha[s][wrow + g];
            a1 = sm.alpha[s][wrow + g + 8];
          }
        }
        mbar_wait_buffer(sm.full, full_bits, b);   // landed (its score warpgroup saw it already)
        if (warp == 8) KDTREE_DTRACE(5);
        // the tile's V is read by wgmma (the async proxy); in the producer form this fence also orders P, whose
        // writer fences nothing (KDTREE_DUAL_P_WRITER_FENCE): it follows the acquire of p_full, so it must stay after
        // both waits
        fence_proxy_async();
        if (first) {
          if constexpr (KDTREE_DUAL_ALPHA_EARLY) wg::rescale_o(o, a0, a1);
          else wg::rescale_o(o, sm.alpha[s][wrow + g], sm.alpha[s][wrow + g + 8]);
        }
        {
          const uint64_t pd = desc_sw64(smem_u32(p_buffer<Pair>(sm, s, b)));
          constexpr int kStride = Ring<Pair>::kSlabStride;
          const SmemDesc vd(smem_u32(&sm.kv[0][0]) + Ring<Pair>::buffer(b) + (4 * v) * kStride, kStride, 1024);
          wg::wg_fence();
#pragma unroll
          for (int kk = 0; kk < kPvSteps; ++kk) {
#ifdef KDTREE_EXP_NO_PV_MMA   // profiling aid: skip P V
            continue;
#endif
            const uint64_t da = pd + ((kk * 32) >> 4);
            wg::wgmma_m64n128k16_ss_bt(&o[0], da, vd.at(kk * 16 * 128));
            wg::wgmma_m64n128k16_ss_bt(&o[64], da, vd.at(2 * kStride + kk * 16 * 128));
          }
          wg::wg_commit();
          if (warp == 8) KDTREE_DTRACE(10);   // P V issued
          // while P V runs (earlier, before P V or before the wait for P, is slower: branch
          // next/dual-refill-placement, history 77 and 80; before P V again in session 23, +5 to +13.5%, history 147)
          if (!SRefill && !kProd && t > 0) refill(t);
          if (!kProd && warp == 8) KDTREE_DTRACE(6);
          if (!kProd && warp == 15) KDTREE_DTRACE(12);   // the last value warp's refill issued
          wg::wg_wait0();
          if (warp == 8) KDTREE_DTRACE(11);   // P V done
          if (kProd && warp == 12) KDTREE_DTRACE(14);   // (producer form) value warpgroup 1's P V done
        }
        // release: its score warpgroup writes P / alpha again (after the step's last tile)
        if ((!Pair || (t & 1) == 1) && u + 2 < nu) mbar_arrive(&sm.p_empty[s]);
        if constexpr (SRefill || kProd) {
          if (t + kStages < nt)   // its score warpgroup / the producer refills it: tile t + 4
            mbar_arrive(&sm.empty[b]);
        } else {
          bar_sync(kBarValues, kValueThreads);   // both value warpgroups are done with buffer b
        }
        if (warp == 8) KDTREE_DTRACE(7);
      }
      bar_sync(kBarBlock, 128 + kValueThreads);   // row_l written by score warpgroup 0 (which only arrives)
      KDTREE_ITEM_STORE_BEGIN(vt == 255);
      // the ring's first 64 KB hold the rows on their way out: every tile's S and P V is done (the score side's last S
      // before its P, which the value side consumed), no copy is in flight (none past the item's last tile), and the
      // next item's copies start after the closing barrier
#if KDTREE_DUAL_STAGED_STORE
      wg::store_o_rows_staged(prm, cx, wrow, lane, v, o, sm.row_l, smem_u32(&sm.kv[0][0]), kBarValues, kValueThreads);
#else
      wg::store_o_rows(prm, cx, wrow, g, c, v, o, sm.row_l);
#endif
      if constexpr (kProd) mbar_arrive(&sm.ring_free);   // (release: this thread's reads of the ring are done)
      sync_block_roles();
      KDTREE_ITEM_STORE_END(vt == 255);
      // every partial of the item is stored (score warpgroup 0's log-sum-exps before the barrier, both value
      // warpgroups' O): the release, on the value side (on the score side, where registers are tightest, ptxas
      // spilled)
      if (vt == 255) signal_item_done(prm, cx);
    }
  } else if constexpr (kProd) {
    // =========================== producer warpgroup (KDTREE_DUAL_PRODUCER) ===========================
    // every tile of the item in order: 0 .. kQFirst - 1 at once, the rest of the first ring once q has landed, then
    // tile t into buffer t % kStages once both value warpgroups are done with tile t - kStages there; producer thread
    // pt copies chunk pt % 8 of every slab of keys pt / 8 and pt / 8 + 16, and loads the slot ids of the tile
    // kSlotAhead tiles ahead
    constexpr int kSlotAhead = KDTREE_DUAL_SLOT_AHEAD;
    wg::set_max_regs<kProducerRegs, kRegs0>();
    const int pt = tid - 512;   // 0..127
    uint32_t empty_bits = 0u, q_parity = 0u;
    for (int k = 0;; ++k) {
      const int item = wg::wait_item(k, sm.item, &sm.item_full);   // the score side's item fetch (acquire)
      if (item >= total) return;
      const ItemCtx cx = item_ctx<kBlockM, kTileN>(prm, item);
      const int nt = cx.ntiles;
#ifdef KDTREE_EXP_TRACE
      const long long t_item = clock64();
#endif
      long long slot[kProducerKeys], next[kProducerKeys], ahead[kProducerKeys];
      wg::tile_slots<kProducerKeys>(prm, cx, 0, pt, slot);
      if constexpr (kSlotAhead == 2) wg::tile_slots<kProducerKeys>(prm, cx, 1, pt, next);
      // the previous item's rows have left the ring (ordered by the barrier below as well, but compute-sanitizer's
      // racecheck does not take a barrier between roles for a hand-off, history 53 / 156: an mbarrier it does)
      if (k > 0) mbar_wait(&sm.ring_free, (k - 1) & 1);
      // (q_full completes once per item: waited once per item, also when the item has no more than kQFirst tiles)
      const int n_issue = kQFirst < kStages && nt <= kQFirst ? kQFirst + 1 : nt;
      for (int t = 0; t < n_issue; ++t) {
        if (warp == 16) KDTREE_DTRACE(15);   // (TRACE) the producer's loop top: the last tile's slot ids moved in
        if constexpr (kSlotAhead == 2)
          wg::tile_slots<kProducerKeys>(prm, cx, t + 2, pt, ahead);
        else
          wg::tile_slots<kProducerKeys>(prm, cx, t + 1, pt, next);
        if (kQFirst < kStages && t == kQFirst) {
          KDTREE_DSTART(pt == 0, 6);
          mbar_wait(&sm.q_full, q_parity);
          q_parity ^= 1u;
        }
        const int b = t % kStages;
        if (warp == 16) KDTREE_DTRACE(13);   // (TRACE) the producer's wait for the buffer starts
        if (t >= kStages) mbar_wait_buffer(sm.empty, empty_bits, b);
        if (warp == 16) KDTREE_DTRACE(6);   // (TRACE, producer form: tile t's copies start)
        gather_tile<Pair, kProducerKeys>(sm, prm, cx, t, b, pt, slot);   // (nothing at t >= nt)
        if (warp == 16) KDTREE_DTRACE(12);   // (and issued)
        // (TRACE: the start stamps that the value side takes without the producer)
        if (t == 0) KDTREE_DSTART(pt == 0, 5);
        if (t == kStages - 1) KDTREE_DSTART(pt == 0, 7);
#pragma unroll
        for (int h = 0; h < kProducerKeys; ++h) {
          slot[h] = next[h];
          if constexpr (kSlotAhead == 2) next[h] = ahead[h];
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
