// verify_profiling.cuh: the call-timeline stamps of profiling builds (-DKDTREE_EXP_TIMELINE; driven by
// tools/timeline_case.py). In a normal build every macro here expands to nothing and no global exists.
#pragma once

#if defined(KDTREE_EXP_TRACE) || defined(KDTREE_EXP_TIMELINE)
#include <cstdio>
#endif

#include "verify_ptx.cuh"

namespace kdtree {

#ifdef KDTREE_EXP_TIMELINE
// [4]: inside the combine, the latest block's (plan read, partials summed, row stored) of its first work
__device__ unsigned long long g_timeline[5][3] = {{~0ull, ~0ull, 0}, {~0ull, ~0ull, 0}, {~0ull, ~0ull, 0}, {~0ull, ~0ull, 0},
                                                  {0, 0, 0}};
__device__ unsigned g_timeline_done = 0;
// per combine work (session 18; the first kStampWorks works): iteration start, tile wait done, partials summed, row
// stored, and (session 35) its addresses ready and its first load batch landed (thread 0, ns), its tile's counter
// index; per tile (counter index mod kStampTiles) the latest item release
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
#define KDTREE_ITEM_STORE_BEGIN(cond) const unsigned long long t_store0_ = (cond) ? global_ns() : 0ull
#define KDTREE_ITEM_STORE_END(cond) \
  do { if (cond) { const unsigned long long d_ = global_ns() - t_store0_; atomicMax(&g_item_store[0], d_); \
                   atomicAdd(&g_item_store[1], d_); atomicAdd(&g_item_store[2], 1ull); } } while (0)
#define KDTREE_WORK_STAMP(w, e) \
  do { if (threadIdx.x == 0 && (w) < kStampWorks) g_work[w][e] = global_ns(); } while (0)
#define KDTREE_WORK_STAMP_AFTER(w, e, dep) \
  do { if (threadIdx.x == 0 && (w) < kStampWorks) g_work[w][e] = global_ns_after(dep); } while (0)
#define KDTREE_TIMELINE_BY(cond, k, e) \
  do { if (cond) { if (e == 2) atomicMax(&g_timeline[k][2], global_ns()); else atomicMin(&g_timeline[k][e], global_ns()); } } while (0)
#define KDTREE_TIMELINE(k, e) KDTREE_TIMELINE_BY(threadIdx.x == 0, k, e)
#define KDTREE_TIMELINE_LATEST(e) \
  do { if (threadIdx.x == 0) atomicMax(&g_timeline[4][e], global_ns()); } while (0)
#else
#define KDTREE_ITEM_STORE_BEGIN(cond) do { } while (0)
#define KDTREE_ITEM_STORE_END(cond) do { } while (0)
#define KDTREE_WORK_STAMP(w, e) do { } while (0)
#define KDTREE_WORK_STAMP_AFTER(w, e, dep) do { } while (0)
#define KDTREE_TIMELINE_LATEST(e) do { } while (0)
#define KDTREE_TIMELINE_BY(cond, k, e) do { } while (0)
#define KDTREE_TIMELINE(k, e) do { } while (0)
#endif

}  // namespace kdtree
