// verify_combine.cuh: the combine kernel, which merges the split partials of every split row in a fixed order
// (deterministic) and writes the output. It starts while the split pass runs and merges each row tile as soon as
// that tile's split items have stored their partials.
#pragma once

#include "verify_common.cuh"
#include "verify_item.cuh"
#include "verify_plan.cuh"
#include "verify_profiling.cuh"
#include "verify_ptx.cuh"

namespace kdtree {

// ---------------------------------------------------------------------------------------------
// Combine: per (verify token, head) row of a request that was split and per column slice (blocks
// stride over rows x the largest slice count of any row), fixed split order. A row with many splits
// is cut into up to kCombineMaxSlices slices of value columns, so a short request's few rows do not
// leave the GPU idle (H16 N1 P131072: 16 rows x 264 splits in 16 blocks took 16 us); a row with few
// splits takes one block (its unused slices are skipped iterations of the stride). The block's
// 4 x slices groups of threads each take every (4 x slices)-th split (16 bytes of partial O per thread
// and its log-sum-exp): up to kCombineBatch splits per thread are loaded together (one memory round trip
// for up to 32 x kCombineBatch splits: ~5 us in a graph, where dependent load phases took ~7), summed against
// the thread's own running maximum, then rescaled to the block maximum and summed over the groups in a fixed
// order. The slice count comes from the row's own split count: batch-invariant, deterministic.
// ---------------------------------------------------------------------------------------------
constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kCombineAcc = 4 * kDimNope;   // floats of group sums: (4 x slices) groups x (512 / slices) columns
// Blocks per SM the combine asks for (registers: <= 64 / 80 / 128): 4 with batch 8 on sm_90 (as
// measured), 3 on sm_120 (the work takes 72 registers there and would fit 64, but 4 blocks an SM have not been
// measured on an sm_120 GPU), 2 with batch 16.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kCombineMinBlocks = kCombineBatch == 8 ? 3 : 2;
#else
constexpr int kCombineMinBlocks = kCombineBatch == 8 ? 4 : 2;
#endif

// Block-wide max in a fixed tree order (deterministic); every thread gets the result.
__device__ __forceinline__ float combine_block_max(float v, float* s_red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();   // s_red of an earlier reduction has been read
  if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = s_red[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) v = fmaxf(v, s_red[w]);
  return v;
}

// A combine work of request-local row r (nsplit splits) waits, in one thread, until every split item of the row's tile
// has stored its partials (acquire: the block barrier after it orders the block's loads of them). A wait that outlasts
// kDoneWaitNs can only be a broken count: it traps (a launch error) rather than hang the GPU.
constexpr unsigned long long kDoneWaitNs = 30ull * 1000 * 1000 * 1000;
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int n;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(n) : "l"(p) : "memory");
  return n;
}
// Spins (acquire) until counter *done reaches target.
__device__ __forceinline__ void spin_until_done(const int* done, int target) {
  const unsigned long long t0 = global_ns();
  int n;
  do {
    __nanosleep(128);
    n = ld_acquire_gpu(done);
    if (n < target && global_ns() - t0 > kDoneWaitNs) __trap();
  } while (n < target);
}
// The works of row r's tile: its rows times the slices of each (every one passes its tile wait once per call).
__device__ __forceinline__ int tile_works(const Params& prm, const ReqPlan& rp, int r, int slices) {
  const int row0 = tile_row0(prm.block_m, r);
  const int rows = min(prm.block_m, rp.n * prm.heads - row0);
  return rows * slices;
}

// One work of the combine: value-column slice `slice` of 2^S of request-local row r (global row gr = t * H + h), its
// nsplit partials merged in a fixed order. Every shape of the work (columns, thread groups, the group sums) is a
// compile-time constant, a thread's loads are one base and immediate offsets (a row's splits adjacent), and the tile
// counter's acquire is in flight while the addresses are computed: with run-time shapes a work took ~4 us at the
// call's tail, most of it the latency of ~1,000 dependent instructions (64-bit index divisions, divisions by the
// run-time slice shape, a 64-bit address product per split), for the same sums in the same order.
template <int S>
__device__ __forceinline__ void combine_work(const Params& prm, const ReqPlan& rp, int r, int nsplit, int t, int h,
                                             int slice, bool early, int w, float* s_acc, float* s_wsum, float* s_red,
                                             long long* s_tile) {
  constexpr int kCols = kDimNope >> S;                 // value columns of this work
  constexpr int kLanes = kCols / 8;                    // threads per split row (8 columns each)
  constexpr int kGroups = kCombineThreads / kLanes;    // thread groups, each taking every kGroups-th split
  const int tid = threadIdx.x;
  const int grp = tid / kLanes;
  const int lcol = (tid % kLanes) * 8;                 // within the slice
  // the tile's counter: its acquire in flight while the addresses are computed
  long long tile = 0;
  int target = 0, seen = 0;
  if (early && tid == 0) {
    tile = tile_done_index(rp, tile_row0(prm.block_m, r));
    target = nsplit * prm.done_arrivals;
    seen = ld_acquire_gpu(prm.tile_done + tile);
  }
  const long long prow = partial_index(rp, r, grp);   // the group's first split (the next: kGroups on)
  const float* lse = prm.partial_lse + prow;
  const __nv_bfloat16* src = prm.partial_o + prow * kDimNope + slice * kCols + lcol;
  const int left = nsplit - grp;                       // this group's splits: k * kGroups < left
  // the thread's output pair (the threads 2 * tid < kCols store one each), so that t, h and slice are not kept
  __nv_bfloat16* const dst = prm.out + (long long)t * prm.out_st + (long long)h * prm.out_sh + slice * kCols + 2 * tid;
  if (early) {   // the row tile's split items have all stored their partials
    if (tid == 0) {
      if (seen < target) spin_until_done(prm.tile_done + tile, target);
      s_tile[0] = tile;
      s_tile[1] = tile_works(prm, rp, r, 1 << S);   // (for the end of the work, kept out of registers)
    }
    __syncthreads();
  }
  if (w == blockIdx.x) KDTREE_TIMELINE_LATEST(0);
  KDTREE_WORK_STAMP(w, 1);
  KDTREE_WORK_TILE(w, early ? s_tile[0] : -1);
  float m_run = -INFINITY, wsum = 0.f;
  float acc[8] = {};
  KDTREE_WORK_STAMP_AFTER(w, 4, (unsigned)(uintptr_t)src ^ (unsigned)prow);
  // once for <= 32 << S splits: always, but with 2^3 slices (a row of more than 256 splits)
  constexpr int kBatchSplits = S < 3 ? 1 << 30 : kGroups * kCombineBatch;
  static_assert(S == 3 || kGroups * kCombineBatch >= (4 * kCombineBatch) << S, "one batch takes every split");
  for (int base = 0; base < left; base += kBatchSplits) {
    float l[kCombineBatch];
    uint4 v[kCombineBatch];
#pragma unroll
    for (int k = 0; k < kCombineBatch; ++k) {
      const bool in = base + k * kGroups < left;
      // (from L2: written by other SMs during this kernel when it started early; immediate offsets from one base)
      l[k] = in ? __ldcg(lse + k * kGroups) : -INFINITY;
      v[k] = in ? __ldcg(reinterpret_cast<const uint4*>(src + k * kGroups * kDimNope)) : make_uint4(0, 0, 0, 0);
    }
    lse += kCombineBatch * kGroups;
    src += kCombineBatch * kGroups * kDimNope;
    if constexpr (kExpTimeline) {
      if (base == 0) {   // the first batch's loads have landed
        unsigned dep = 0;
#pragma unroll
        for (int k = 0; k < kCombineBatch; ++k) dep ^= __float_as_uint(l[k]) ^ v[k].w;
        KDTREE_WORK_STAMP_AFTER(w, 5, dep);
      }
    }
    float m_new = m_run;
#pragma unroll
    for (int k = 0; k < kCombineBatch; ++k) m_new = fmaxf(m_new, l[k]);
    if (m_new == -INFINITY) continue;   // nothing visible yet (group-uniform)
    const float sc = exp2f(m_run - m_new);   // 0 on the first visible batch (acc and wsum are 0 then)
    wsum *= sc;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= sc;
#pragma unroll
    for (int k = 0; k < kCombineBatch; ++k) {
      const float wk = exp2f(l[k] - m_new);
      wsum += wk;
      const __nv_bfloat162* pv = reinterpret_cast<const __nv_bfloat162*>(&v[k]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(pv[q]);
        acc[2 * q] += wk * f.x;
        acc[2 * q + 1] += wk * f.y;
      }
    }
    m_run = m_new;
  }
  if (w == blockIdx.x) KDTREE_TIMELINE_LATEST(1);
  KDTREE_WORK_STAMP(w, 2);
  // to the block maximum, then the groups' sums in a fixed order
  const float m_blk = combine_block_max(m_run, s_red);
  const float sc = m_run == -INFINITY ? 0.f : exp2f(m_run - m_blk);
#pragma unroll
  for (int i = 0; i < 8; ++i) s_acc[grp * kCols + lcol + i] = acc[i] * sc;
  if (lcol == 0) s_wsum[grp] = wsum * sc;
  __syncthreads();
  if (2 * tid < kCols) {   // one bf16 pair a thread, groups in fixed order
    float wtot = 0.f;
#pragma unroll
    for (int q = 0; q < kGroups; ++q) wtot += s_wsum[q];
    const float inv = wtot > 0.f ? 1.f / wtot : 0.f;
    const int c = 2 * tid;
    float v0 = 0.f, v1 = 0.f;
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      v0 += s_acc[q * kCols + c];
      v1 += s_acc[q * kCols + c + 1];
    }
    *reinterpret_cast<uint32_t*>(dst) = pack_bf16(v0 * inv, v1 * inv);
  }
  if (w == blockIdx.x) KDTREE_TIMELINE_LATEST(2);
  KDTREE_WORK_STAMP(w, 3);
  // the work counts itself among its tile's, and the tile's last work zeroes both counters for the next call
  if (early && tid == 0) {
    const long long tl = s_tile[0];
    if (atomicAdd(prm.tile_seen + tl, 1) == s_tile[1] - 1) {
      prm.tile_done[tl] = 0;
      prm.tile_seen[tl] = 0;
    }
  }
}

__global__ void __launch_bounds__(kCombineThreads, kCombineMinBlocks) kdtree_verify_combine_kernel(Params prm) {
  __shared__ float s_acc[kCombineAcc];
  __shared__ float s_wsum[kCombineThreads];   // per thread group: its weight sum at the block maximum
  __shared__ float s_red[kCombineWarps];
  __shared__ long long s_tile[2];   // the work's tile: its counter index and its work count
  KDTREE_TIMELINE(3, 0);
  // With done_arrivals, the combine starts while the split pass still runs: its blocks are scheduled once every split
  // block has passed its own wait for the plan kernel (the split kernels let their dependents launch only then), so
  // the plan is complete, and each work waits only for its own row tile's items (tile_done); the wait for the whole
  // split pass comes at the end, so that this kernel's completion still implies the split pass's. Without them
  // (a split kernel that signals nothing), the whole split pass first.
  const bool early = prm.done_arrivals > 0;
  if (!early) grid_dependency_wait();      // the split pass's partials (programmatic launch)
  KDTREE_TIMELINE(3, 1);
  const int tid = threadIdx.x;
  // the split pass is over: reset its work counter, so that the next call on this workspace may run on
  // the same plan without the plan kernel (kdtree_verify_params.reuse_plan)
  auto reset_work_counters = [&] {
    if (blockIdx.x == 0 && tid == 0) {
      prm.counter[0] = 0;
    }
  };
  if (!early) reset_work_counters();
  // work w = (column slice, global row), slice-major: a grid of about one wave strides over them, the
  // works in use (slice < the row's slice count) come first, and the slices a row does not use cost
  // a skipped iteration, not a launched block
  // 32-bit: the host bounds rows * kCombineMaxSlices (and so every w of the loop) below 2^30
  const unsigned rows = (unsigned)prm.num_tokens * (unsigned)prm.heads;
  for (unsigned w = blockIdx.x;; w += gridDim.x) {   // block-uniform
    const unsigned slice = w / rows;
    const unsigned gr = w - slice * rows;   // global row = t * H + h
    const int t = (int)(gr / (unsigned)prm.heads), h = (int)gr - t * prm.heads;
    // the loop bound (counter[2]: the largest slice count of any row) and the work's plan, loaded side by side
    const unsigned max_slices = (unsigned)prm.counter[2];
    const ReqPlan rp = prm.plan[owning_request(prm.batch, t, [&](int b) { return prm.plan[b].qo_begin; })];
    if (slice >= max_slices) break;                                                 // block-uniform
    if (t < rp.qo_begin || t >= rp.qo_begin + rp.n) continue;                      // block-uniform
    const int r = (t - rp.qo_begin) * prm.heads + h;
    const int nsplit = rp.nsplit;
    if (nsplit <= 1) continue;                                                      // block-uniform
    const int sl = combine_slices_log2(nsplit);
    if (slice >= (1u << sl)) continue;                                              // block-uniform
    KDTREE_WORK_STAMP(w, 0);
    switch (sl) {
      case 0: combine_work<0>(prm, rp, r, nsplit, t, h, (int)slice, early, (int)w, s_acc, s_wsum, s_red, s_tile); break;
      case 1: combine_work<1>(prm, rp, r, nsplit, t, h, (int)slice, early, (int)w, s_acc, s_wsum, s_red, s_tile); break;
      case 2: combine_work<2>(prm, rp, r, nsplit, t, h, (int)slice, early, (int)w, s_acc, s_wsum, s_red, s_tile); break;
      default: combine_work<3>(prm, rp, r, nsplit, t, h, (int)slice, early, (int)w, s_acc, s_wsum, s_red, s_tile); break;
    }
  }
  if (early) {
    grid_dependency_wait();   // the split pass's completion (this kernel's then implies it)
    reset_work_counters();
  }
  KDTREE_TIMELINE(3, 2);
  KDTREE_TIMELINE_REPORT(prm);   // (printed by the last block to end)
}

}  // namespace kdtree
