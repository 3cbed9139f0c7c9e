// verify_profiling.cuh: every profiling aid of the kernels, each behind a compile-time switch -DKDTREE_EXP_*. In a
// normal build (none defined) every macro here expands to no code, every kExp* flag is false (the code it guards is
// discarded), and none of the records below exists: the kernels' machine code is the same as without this header
// (tools/sass_digest.sh shows it). Build one as tools/README.md says; knock-out builds compute wrong results by design.
//
// The switches:
//   KDTREE_EXP_TRACE               per-tile SM-clock stamps of the split kernels' first items (blocks 0 and 1),
//                                  printed after the call by kdtree_trace_dump_kernel (tools/trace_case.py); the
//                                  mma.sync kernels (bf16, FP8) stamp every item in shared memory and print it
//   KDTREE_EXP_TIMELINE            %globaltimer of each kernel's start, wait and end, of every combine work's steps and
//                                  of every row tile's release, printed by the combine's last block
//                                  (tools/timeline_case.py)
//   KDTREE_EXP_NO_SCORE_MMA        knock-out: S = Q K^T with one k-step (wgmma kernels: of 36, of 18 on the skinny
//                                  FP8 form's e4m3 tiles), none (mma.sync kernels)
//   KDTREE_EXP_NO_PV_MMA           knock-out: no P V (O stays zero; the skinny FP8 form's draft tiles keep theirs)
//   KDTREE_EXP_NO_GATHER           knock-out: every key copies the zero row instead of its pool row (bf16 and e4m3)
//   KDTREE_EXP_COMBINE_BLOCKS_DIV  =n: the combine launched with 1/n of its blocks, so that a block runs several works
#pragma once

#if defined(KDTREE_EXP_TRACE) || defined(KDTREE_EXP_TIMELINE)
#include <cstdio>
#endif

#include "verify_common.cuh"
#include "verify_ptx.cuh"

namespace kdtree {

// ---------------------------------------------------------------------------------------------
// Knock-outs and parameters, as flags for `if constexpr`.
// ---------------------------------------------------------------------------------------------
// KDTREE_EXP_DEFINED(NAME): whether the build defines macro NAME (-DNAME, -DNAME=value), as #ifdef NAME, in an
// expression: a defined NAME expands to something other than its own spelling.
constexpr bool exp_same_spelling(const char* a, const char* b) {
  return *a == *b && (*a == 0 || exp_same_spelling(a + 1, b + 1));
}
#define KDTREE_EXP_SPELLING_(x) #x
#define KDTREE_EXP_DEFINED(name) (!::kdtree::exp_same_spelling(KDTREE_EXP_SPELLING_(name), #name))

constexpr bool kExpNoScoreMma = KDTREE_EXP_DEFINED(KDTREE_EXP_NO_SCORE_MMA);
constexpr bool kExpNoPvMma = KDTREE_EXP_DEFINED(KDTREE_EXP_NO_PV_MMA);
// (Not a measure of delivery without DRAM at full scale: 132 SMs reading one 1,152-byte row meet on the same L2 lines;
// the default's H16 N9 P131072 took 329 us so on the H200, not 115.)
constexpr bool kExpNoGather = KDTREE_EXP_DEFINED(KDTREE_EXP_NO_GATHER);
constexpr bool kExpTimeline = KDTREE_EXP_DEFINED(KDTREE_EXP_TIMELINE);
constexpr bool kExpTrace = KDTREE_EXP_DEFINED(KDTREE_EXP_TRACE);
#ifdef KDTREE_EXP_COMBINE_BLOCKS_DIV
constexpr int kExpCombineBlocksDiv = KDTREE_EXP_COMBINE_BLOCKS_DIV;
#else
constexpr int kExpCombineBlocksDiv = 1;
#endif
static_assert(kExpCombineBlocksDiv >= 1, "KDTREE_EXP_COMBINE_BLOCKS_DIV: a divisor of the combine's blocks, >= 1");

// ---------------------------------------------------------------------------------------------
// TRACE (the wgmma kernels). Their stamps stay in global memory and a one-thread kernel launched after the call prints
// them: a printf in the kernel would be a function call, across which ptxas serialises every wgmma of the kernel
// ("C7510: wgmma pipeline crossing function boundary"; such a trace timed S at ~3,000 clocks, where S alone takes
// ~1,100). tests/test_ptxas.py checks the TRACE build for that.
// The macros read names of the kernel's scope: k (the block's item count), t (the tile) and lane. A stamp is the low 32
// bits of clock64, which the dump kernel takes from the item's start (g_item_start): no register holds the start
// across the kernel's loops (with the start in registers, ptxas serialises every wgmma of the dual kernel's FP8 form
// in this build: C7511, registers).
// ---------------------------------------------------------------------------------------------
#ifdef KDTREE_EXP_TRACE
namespace trace {
constexpr int kItems = 4;    // items recorded per block: the block's first four
constexpr int kTiles = 32;   // tiles recorded per item: the first 32
constexpr int kStamps = 16;  // per tile: 0-3 score side, 4-7 value side, 8-15 the dual kernel's other stamps
struct ItemRec { int item, tiles; long long total; };
__device__ unsigned g_tile[kTiles][kStamps];   // the dual kernel's block 0, its first item; 0: not stamped
__device__ unsigned g_item_start[kItems];   // the dual kernel's block 0: score thread 0's start of item k
__device__ ItemRec g_item[2][kItems];
__device__ int g_items[2];   // items block b recorded in the latest call (the dump kernel prints and clears them)
// The start of the dual kernel's block 0's first item, in SM clocks: score thread 0's item start, q copies issued, its
// q landed, both score warpgroups' q landed; value thread 0's item start; the producer's tile 0 issued, (6) its wait
// for q, the whole ring issued.
__device__ long long g_dual_start[8];
__device__ int g_dual_qfirst;   // the dual kernel's kQFirst once g_dual_start holds a call's stamps (then cleared)
// The start of the skinny kernel's block 0's first item, SM clocks: the consumer's item fetched, q issued, q landed,
// tile 0 landed, tile 0's S^T done, the item's end; the producer's item fetched, tile 0 issued, tile 1 issued.
__device__ volatile long long g_sk_start[9];
__device__ int g_sk_item[3];   // its item, its tiles, 1 once recorded (the dump kernel clears it)

// The dual kernel's item k of block 0 ends (thread 0, after the item's last barrier).
__device__ __forceinline__ void record_dual_item(int k, int item, int tiles, int q_first) {
  if (blockIdx.x == 0 && k < kItems) {
    g_item[0][k] = {item, tiles, (long long)((unsigned)clock64() - g_item_start[k])};
    g_items[0] = k + 1;
    if (k == 0) g_dual_qfirst = q_first;
  }
}
// The skinny kernel's first item of block 0 ends.
__device__ __forceinline__ void record_skinny_item(int item, int tiles) {
  if (blockIdx.x == 0) {
    g_sk_item[0] = item;
    g_sk_item[1] = tiles;
    g_sk_item[2] = 1;
  }
}
}  // namespace trace

// The item's start, which the tile stamps count from.
#define KDTREE_TRACE_ITEM_START const long long t_item = clock64()
// The dual kernel's item start, from the thread for which cond holds (score thread 0).
#define KDTREE_DTRACE_ITEM_START(cond)                                                              \
  do {                                                                                              \
    if (blockIdx.x == 0 && (cond) && k < ::kdtree::trace::kItems)                                   \
      ::kdtree::trace::g_item_start[k] = (unsigned)clock64();                                       \
  } while (0)
// The dual kernel: stamp e of tile t of block 0's first item (the caller picks the warp). Its later items are not
// stamped: the stamps' addresses for four items, as this build had them, made ptxas serialise the FP8 form's wgmma.
#define KDTREE_DTRACE(e)                                                                            \
  do {                                                                                              \
    if (blockIdx.x == 0 && lane == 0 && k == 0 && t < ::kdtree::trace::kTiles)                      \
      ::kdtree::trace::g_tile[t][e] = (unsigned)clock64();                                          \
  } while (0)
#define KDTREE_DSTART(cond, e) \
  do { if (blockIdx.x == 0 && k == 0 && (cond)) ::kdtree::trace::g_dual_start[e] = clock64(); } while (0)
#define KDTREE_DTRACE_ITEM(cond, item, tiles, q_first) \
  do { if (cond) ::kdtree::trace::record_dual_item(k, item, tiles, q_first); } while (0)
// The skinny kernel (and km::key_producer).
#define KDTREE_SKSTART(cond, e) \
  do { if (blockIdx.x == 0 && (cond)) ::kdtree::trace::g_sk_start[e] = clock64(); } while (0)
#define KDTREE_SKTRACE_ITEM(cond, item, tiles) \
  do { if (cond) ::kdtree::trace::record_skinny_item(item, tiles); } while (0)

// Prints what the wgmma kernels recorded in the call just launched (one thread, launched plainly after the combine on
// the same stream by kdtree_verify_launch) in the lines tools/trace_case.py documents, then clears the record.
__global__ void kdtree_trace_dump_kernel() {
  for (int b = 0; b < 2; ++b) {
    for (int k = 0; k < trace::g_items[b]; ++k) {
      const trace::ItemRec r = trace::g_item[b][k];
      printf("TRACE block %d item %d tiles %d total %lld\n", b, r.item, r.tiles, r.total);
      if (b == 0 && k == 0 && trace::g_dual_qfirst) {   // the dual kernel's item start
        const long long* g = trace::g_dual_start;
        printf("TRACE block 0 item %d start | q issued %lld, q landed (thread 0) %lld, (all) %lld | value side: "
               "start %lld", r.item, g[1] - g[0], g[2] - g[0], g[3] - g[0], g[4] - g[0]);
        if (g[5])   // (the FP8 form has no producer: its score warpgroups issue the tiles before q's stamp 1)
          printf(", tile 0 issued %lld, tiles < %d issued %lld, ring issued %lld", g[5] - g[0], trace::g_dual_qfirst,
                 g[6] - g[0], g[7] - g[0]);
        printf("\n");
        for (int i = 5; i < 8; ++i) trace::g_dual_start[i] = 0;
      }
      for (int t = 0; b == 0 && k == 0 && t < min(r.tiles, trace::kTiles); ++t) {
        unsigned* const raw = trace::g_tile[t];
        int e[trace::kStamps];   // from the item's start; 0 where nothing was stamped
        for (int i = 0; i < trace::kStamps; ++i) {
          e[i] = raw[i] ? (int)(raw[i] - trace::g_item_start[k]) : 0;
          raw[i] = 0;
        }
        printf("TRACE block %d item %d it %2d | %6d %6d %6d %6d | %6d %6d %6d %6d | %6d %6d | %6d %6d %6d"
               " | %6d %6d %6d\n", b, r.item, t, e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7], e[8], e[9], e[10],
               e[11], e[12], e[13], e[14], e[15]);
      }
    }
    trace::g_items[b] = 0;
  }
  trace::g_dual_qfirst = 0;
  if (trace::g_sk_item[2]) {   // the skinny kernel's first item start
    volatile long long* const st = trace::g_sk_start;
    const long long t0 = min(st[0], st[6]);
    printf("TRACE block 0 skinny item %d tiles %d | consumer: fetched %lld, q issued %lld, q landed %lld, tile 0 "
           "landed %lld, its S^T done %lld, item end %lld | producer: fetched %lld, tile 0 issued %lld, tile 1 "
           "issued %lld\n", trace::g_sk_item[0], trace::g_sk_item[1], st[0] - t0, st[1] - t0, st[2] - t0, st[3] - t0,
           st[4] - t0, st[5] - t0, st[6] - t0, st[7] - t0, st[8] - t0);
    trace::g_sk_item[2] = 0;
  }
}
#else
#define KDTREE_TRACE_ITEM_START
#define KDTREE_DTRACE_ITEM_START(cond) do { } while (0)
#define KDTREE_DTRACE(e) do { } while (0)
#define KDTREE_DSTART(cond, e) do { } while (0)
#define KDTREE_DTRACE_ITEM(cond, item, tiles, q_first) do { } while (0)
#define KDTREE_SKSTART(cond, e) do { } while (0)
#define KDTREE_SKTRACE_ITEM(cond, item, tiles) do { } while (0)
#endif

// ---------------------------------------------------------------------------------------------
// TRACE (the mma.sync kernels: mma_item, the body of kdtree_verify_split_kernel and of the FP8 kernel's draft items).
// Per tile of an item, SM clocks from the item's start: score warp 0's tile landed (0), P buffer free (1), S landed (2),
// P published (3); value warp 0's P ready (4), P V landed (5), key buffer consumed (6), refill issued (7). They stay in
// shared memory (KDTREE_MMA_TRACE_STORAGE, a member of SharedStorage and SharedStorageFp8: 4 KB, so a TRACE build's
// 2-stage storage exceeds sm_120's 99 KB) and thread 0 of blocks 0 and 1 prints each item's after the item (these
// kernels have no wgmma for a printf to serialise).
// The macros read names of mma_item's scope: sm, tid, lane, it (the tile) and t_item (KDTREE_TRACE_ITEM_START).
// ---------------------------------------------------------------------------------------------
#ifdef KDTREE_EXP_TRACE
namespace trace {
constexpr int kMmaTiles = 64;   // tiles stamped per item: the first 64
}  // namespace trace

#define KDTREE_MMA_TRACE_STORAGE long long trace[::kdtree::trace::kMmaTiles][8];
// Stamp e of tile `it` (lane 0 of the calling warp).
#define KDTREE_MMA_TRACE(e) \
  do { if (lane == 0 && it < ::kdtree::trace::kMmaTiles) sm.trace[it][e] = clock64() - t_item; } while (0)
// Stamp e once the accumulators x and y have landed: the store that a test of them guards (never taken on real data)
// keeps the stamp after the mma that produce them.
#define KDTREE_MMA_TRACE_LANDED(e, x, y, sink) \
  do { if ((x) == 12345.f && (y) == 12345.f) (sink) = 0.f; KDTREE_MMA_TRACE(e); } while (0)
// The item's stamps, printed by thread 0 of blocks 0 and 1 in the lines tools/trace_case.py documents: its prologue
// (clocks from the claim, t_fetch, to the item's start), its total and its tiles. Every thread of the block calls it:
// it ends on a barrier, so that the next item's stamps wait for the printing. (A macro: the same printing from an
// inlined function changes the register allocation of the kernel it times.)
#define KDTREE_MMA_TRACE_DUMP(item, tiles, t_fetch)                                                              \
  do {                                                                                                           \
    if (tid == 0 && blockIdx.x < 2) {                                                                            \
      printf("TRACE block %d item %d tiles %d prologue %lld total %lld\n", blockIdx.x, item, tiles,              \
             t_item - (t_fetch), clock64() - t_item);                                                            \
      for (int t_ = 0; t_ < min(tiles, ::kdtree::trace::kMmaTiles); ++t_)                                        \
        printf("TRACE block %d item %d it %2d | %6lld %6lld %6lld %6lld | %6lld %6lld %6lld %6lld\n", blockIdx.x, \
               item, t_, sm.trace[t_][0], sm.trace[t_][1], sm.trace[t_][2], sm.trace[t_][3], sm.trace[t_][4],     \
               sm.trace[t_][5], sm.trace[t_][6], sm.trace[t_][7]);                                               \
    }                                                                                                            \
    __syncthreads();                                                                                             \
  } while (0)
#else
#define KDTREE_MMA_TRACE_STORAGE
#define KDTREE_MMA_TRACE(e) do { } while (0)
#define KDTREE_MMA_TRACE_LANDED(e, x, y, sink) do { } while (0)
#define KDTREE_MMA_TRACE_DUMP(item, tiles, t_fetch) do { } while (0)
#endif

// ---------------------------------------------------------------------------------------------
// TIMELINE: per kernel of a call (0 mask pack, 1 plan, 2 split, 3 combine) the %globaltimer of its first block's
// start, of its first block past griddepcontrol.wait and of its last block's end; per combine work its steps; per row
// tile its latest item release. The combine's last block prints them (us from the first start) and resets them for the
// next call (KDTREE_TIMELINE_REPORT). tools/timeline_case.py replays a call in a CUDA graph.
// ---------------------------------------------------------------------------------------------
#ifdef KDTREE_EXP_TIMELINE
// [4]: inside the combine, the latest block's (plan read, partials summed, row stored) of its first work
__device__ unsigned long long g_timeline[5][3] = {{~0ull, ~0ull, 0}, {~0ull, ~0ull, 0}, {~0ull, ~0ull, 0}, {~0ull, ~0ull, 0},
                                                  {0, 0, 0}};
__device__ unsigned g_timeline_done = 0;
// per combine work (the first kStampWorks works): iteration start, tile wait done, partials summed, row stored, its
// addresses ready and its first load batch landed (thread 0, ns), its tile's counter index; per tile (counter index
// mod kStampTiles) the latest item release
constexpr int kStampWorks = 2048, kStampTiles = 256;
__device__ unsigned long long g_work[kStampWorks][6];
// %globaltimer read only once dep is known: the read is predicated on it, so it cannot issue before the loads or the
// arithmetic that dep comes from (0 in the one case in 2^32 where dep equals the test value; such a work is skipped)
__device__ __forceinline__ unsigned long long global_ns_after(unsigned dep) {
  unsigned long long t;
  asm volatile("{\n .reg .pred p;\n setp.ne.u32 p, %1, 0x7fc00001;\n @p mov.u64 %0, %%globaltimer;\n"
               " @!p mov.u64 %0, 0;\n}\n" : "=l"(t) : "r"(dep));
  return t;
}
__device__ long long g_work_tile[kStampWorks];
__device__ unsigned long long g_tile_rel[kStampTiles];
// per split item (the dual kernel): ns from its value side's store of O to the barrier after it (max, sum, count)
__device__ unsigned long long g_item_store[3];

// The combine's last block: prints the call's timeline and its works' steps, then resets every record.
__device__ __forceinline__ void timeline_report(const Params& prm) {
  __threadfence();
  if (threadIdx.x == 0 && atomicAdd(&g_timeline_done, 1u) == gridDim.x - 1) {
    unsigned long long t0 = ~0ull;
    for (int k = 0; k < 4; ++k) t0 = min(t0, g_timeline[k][0]);
    // -1: a kernel that did not run (the mask pack when the call packs its own mask)
    auto us = [&](unsigned long long t) { return t == ~0ull || t == 0 ? -1.0 : (double)(t - t0) * 1e-3; };
    printf("TIMELINE us from the first start: mask %.2f %.2f %.2f | plan %.2f %.2f %.2f | split %.2f %.2f %.2f | combine %.2f %.2f %.2f"
           " (latest plan read %.2f, summed %.2f, stored %.2f)\n",
           us(g_timeline[0][0]), us(g_timeline[0][1]), us(g_timeline[0][2]),
           us(g_timeline[1][0]), us(g_timeline[1][1]), us(g_timeline[1][2]),
           us(g_timeline[2][0]), us(g_timeline[2][1]), us(g_timeline[2][2]),
           us(g_timeline[3][0]), us(g_timeline[3][1]), us(g_timeline[3][2]),
           us(g_timeline[4][0]), us(g_timeline[4][1]), us(g_timeline[4][2]));
    // the works: how long each waited past its tile's release, loaded and summed, stored; the latest six in full
    {
      const long long rows = (long long)prm.num_tokens * prm.heads, nw = min(rows * prm.counter[2], (long long)kStampWorks);
      double s_wait = 0, s_sum = 0, s_store = 0, m_wait = 0, m_sum = 0, m_store = 0, s_sum2 = 0, m_sum2 = 0;
      double s_addr = 0, s_land = 0, s_math = 0, m_addr = 0, m_land = 0, m_math = 0;   // summing's three parts
      int n = 0, n2 = 0, n3 = 0;
      long long last[6] = {-1, -1, -1, -1, -1, -1};
      for (long long w = 0; w < nw; ++w) {
        if (g_work[w][3] == 0 || g_work[w][1] < g_work[w][0]) continue;   // skipped (an unsplit row, an unused slice)
        const long long tile = g_work_tile[w];
        const unsigned long long rel = tile >= 0 ? g_tile_rel[tile % kStampTiles] : g_work[w][0];
        const unsigned long long from = max(rel, g_work[w][0]);
        const double dw = g_work[w][1] > from ? (g_work[w][1] - from) * 1e-3 : 0.0;
        const double ds = (g_work[w][2] - g_work[w][1]) * 1e-3, dt = (g_work[w][3] - g_work[w][2]) * 1e-3;
        s_wait += dw; s_sum += ds; s_store += dt; ++n;
        if (g_work[w][4] >= g_work[w][1] && g_work[w][5] >= g_work[w][4] && g_work[w][2] >= g_work[w][5]) {
          const double da = (g_work[w][4] - g_work[w][1]) * 1e-3, dl = (g_work[w][5] - g_work[w][4]) * 1e-3,
                       dm = (g_work[w][2] - g_work[w][5]) * 1e-3;
          s_addr += da; s_land += dl; s_math += dm; ++n3;
          m_addr = fmax(m_addr, da); m_land = fmax(m_land, dl); m_math = fmax(m_math, dm);
        }
        if (w >= gridDim.x) { s_sum2 += ds; m_sum2 = fmax(m_sum2, ds); ++n2; }   // a block's second or later work
        m_wait = fmax(m_wait, dw); m_sum = fmax(m_sum, ds); m_store = fmax(m_store, dt);
        for (int j = 0; j < 6; ++j)   // insertion into the six latest stored
          if (last[j] < 0 || g_work[w][3] > g_work[last[j]][3]) {
            for (int k = 5; k > j; --k) last[k] = last[k - 1];
            last[j] = w;
            break;
          }
      }
      if (n > 0)
        printf("TIMELINE works %d: us past the tile's release to the wait's end mean %.2f max %.2f | summing mean %.2f max "
               "%.2f | storing mean %.2f max %.2f | summing in a block's later works (%d) mean %.2f max %.2f\n", n, s_wait / n,
               m_wait, s_sum / n, m_sum, s_store / n, m_store, n2, n2 ? s_sum2 / n2 : 0.0, m_sum2);
      if (n3 > 0)
        printf("TIMELINE summing in parts (%d works): wait's end to addresses mean %.2f max %.2f | to the first batch "
               "landed mean %.2f max %.2f | to summed mean %.2f max %.2f\n", n3, s_addr / n3, m_addr, s_land / n3, m_land,
               s_math / n3, m_math);
      for (int j = 0; j < 6 && last[j] >= 0; ++j) {
        const long long w = last[j], tile = g_work_tile[w];
        printf("TIMELINE work %lld (tile %lld): released %.2f | start %.2f waited %.2f addresses %.2f landed %.2f summed %.2f"
               " stored %.2f\n", w, tile,
               tile >= 0 ? (double)(g_tile_rel[tile % kStampTiles] - t0) * 1e-3 : -1.0, (double)(g_work[w][0] - t0) * 1e-3,
               (double)(g_work[w][1] - t0) * 1e-3, (double)(g_work[w][4] - t0) * 1e-3, (double)(g_work[w][5] - t0) * 1e-3,
               (double)(g_work[w][2] - t0) * 1e-3, (double)(g_work[w][3] - t0) * 1e-3);
      }
      if (g_item_store[2])
        printf("TIMELINE split items %llu: storing O to the barrier after it mean %.2f max %.2f us\n", g_item_store[2],
               g_item_store[1] * 1e-3 / g_item_store[2], g_item_store[0] * 1e-3);
      g_item_store[0] = g_item_store[1] = g_item_store[2] = 0;
      for (long long w = 0; w < kStampWorks; ++w)
        for (int e = 0; e < 6; ++e) g_work[w][e] = 0;
      for (int i = 0; i < kStampTiles; ++i) g_tile_rel[i] = 0;
    }
    for (int k = 0; k < 4; ++k) { g_timeline[k][0] = g_timeline[k][1] = ~0ull; g_timeline[k][2] = 0; }
    g_timeline[4][0] = g_timeline[4][1] = g_timeline[4][2] = 0;
    g_timeline_done = 0;
  }
}

#define KDTREE_ITEM_STORE_BEGIN(cond) const unsigned long long t_store0_ = (cond) ? global_ns() : 0ull
#define KDTREE_ITEM_STORE_END(cond) \
  do { if (cond) { const unsigned long long d_ = global_ns() - t_store0_; atomicMax(&g_item_store[0], d_); \
                   atomicAdd(&g_item_store[1], d_); atomicAdd(&g_item_store[2], 1ull); } } while (0)
#define KDTREE_WORK_STAMP(w, e) \
  do { if (threadIdx.x == 0 && (w) < kStampWorks) g_work[w][e] = global_ns(); } while (0)
#define KDTREE_WORK_STAMP_AFTER(w, e, dep) \
  do { if (threadIdx.x == 0 && (w) < kStampWorks) g_work[w][e] = global_ns_after(dep); } while (0)
// combine work w's row tile (its counter index; -1: the work waited for the whole pass)
#define KDTREE_WORK_TILE(w, tile) \
  do { if (threadIdx.x == 0 && (w) < kStampWorks) g_work_tile[w] = (tile); } while (0)
// a split item's release of row tile counter i (signal_item_done)
#define KDTREE_TILE_RELEASE(i) do { atomicMax(&g_tile_rel[(i) % kStampTiles], global_ns()); } while (0)
#define KDTREE_TIMELINE_BY(cond, k, e) \
  do { if (cond) { if (e == 2) atomicMax(&g_timeline[k][2], global_ns()); else atomicMin(&g_timeline[k][e], global_ns()); } } while (0)
#define KDTREE_TIMELINE(k, e) KDTREE_TIMELINE_BY(threadIdx.x == 0, k, e)
#define KDTREE_TIMELINE_LATEST(e) \
  do { if (threadIdx.x == 0) atomicMax(&g_timeline[4][e], global_ns()); } while (0)
#define KDTREE_TIMELINE_REPORT(prm) timeline_report(prm)
#else
#define KDTREE_ITEM_STORE_BEGIN(cond) do { } while (0)
#define KDTREE_ITEM_STORE_END(cond) do { } while (0)
#define KDTREE_WORK_STAMP(w, e) do { } while (0)
#define KDTREE_WORK_STAMP_AFTER(w, e, dep) do { } while (0)
#define KDTREE_WORK_TILE(w, tile) do { } while (0)
#define KDTREE_TILE_RELEASE(i) do { } while (0)
#define KDTREE_TIMELINE_LATEST(e) do { } while (0)
#define KDTREE_TIMELINE_BY(cond, k, e) do { } while (0)
#define KDTREE_TIMELINE(k, e) do { } while (0)
#define KDTREE_TIMELINE_REPORT(prm) do { } while (0)
#endif

}  // namespace kdtree
