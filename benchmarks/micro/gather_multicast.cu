// gather_multicast.cu: how fast can C SMs that all need the same gathered key rows get them?
//
// The split kernels' work items that share a split (3 of them at H16 N9: 144 rows in 64-row items) each
// gather the same 1152-byte KV rows through the slot indices, so every key crosses L2 -> SM three times
// (463 MB at 131,072 keys; session 6 ncu). This microbenchmark times only that gather, in a 4-stage ring of
// 32-key tiles laid out as the wgmma operand ([slab][key][128 B], 16-byte chunk c of key k at c ^ (k % 8)),
// with a consumer warpgroup that reads every tile once (a checksum) and releases it. C CTAs form a cluster
// and all need the same tiles:
//   mode 0 "cp.async":     every CTA gathers every tile, 16-byte cp.async (what the kernels do now)
//   mode 1 "tma":          every CTA gathers every tile, one TMA tensor copy per (key, 64-column slab), 128B
//                          swizzle: the hardware writes the layout above if its swizzle follows the
//                          shared-memory address (checked: mode 1/2 dumps are compared with the pool)
//   mode 2 "tma-mcast":    CTA r of the cluster copies keys k % C == r of every tile, multicast to all C
//   mode 3 "bulk":         one 1152-byte cp.async.bulk per key, every CTA (rate only: unswizzled rows)
//   mode 4 "bulk-mcast":   mode 3 with multicast, keys split as in mode 2 (rate only)
// A cluster's C CTAs cover the same tiles; the clusters split the keys (132 / C clusters).
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/gm benchmarks/micro/gather_multicast.cu
// Run:   /tmp/gm [keys=131072] [pool_slots=1048576]
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#define CK(x)                                                                                \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

constexpr int kDim = 576, kRowBytes = kDim * 2, kTileN = 32, kSlabs = 9, kSlabBytes = kTileN * 128;
constexpr int kTileBytes = kSlabs * kSlabBytes, kStages = 4, kThreads = 256;

struct __align__(1024) Smem {
  uint8_t kv[kStages][kTileBytes];
  unsigned long long full[kStages], empty[kStages];
};

__device__ __forceinline__ uint32_t su32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wait_parity(unsigned long long* bar, uint32_t parity, bool cluster_scope) {
  uint32_t a = su32(bar), done = 0;
  while (!done) {
    if (cluster_scope)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0,1,0,p; }"
                   : "=r"(done) : "r"(a), "r"(parity) : "memory");
    else
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0,1,0,p; }"
                   : "=r"(done) : "r"(a), "r"(parity) : "memory");
  }
}
// Arrive on barrier `bar` (this CTA's offset) of cluster CTA `rank`.
__device__ __forceinline__ void arrive_remote(unsigned long long* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(su32(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1)
    gather(const __grid_constant__ CUtensorMap tmap, const __nv_bfloat16* __restrict__ pool,
           const int* __restrict__ idx, int ntiles, int mode, int csize, unsigned long long* sums, uint8_t* dump) {
  extern __shared__ uint8_t raw[];
  Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  const int tid = threadIdx.x;
  const uint32_t rank = csize > 1 ? cluster_rank() : 0;
  const int cluster = blockIdx.x / csize, nclusters = gridDim.x / csize;
  const int t0 = (int)((long long)ntiles * cluster / nclusters), t1 = (int)((long long)ntiles * (cluster + 1) / nclusters);
  const bool mcast = mode == 2 || mode == 4;
  if (tid == 0) {
    for (int b = 0; b < kStages; ++b) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(su32(&sm.full[b])), "r"(mode == 0 ? 128 : 1));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(su32(&sm.empty[b])), "r"(mcast ? csize : 1));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (csize > 1) cluster_sync(); else __syncthreads();

  if (tid < 128) {  // producer warpgroup
    const int warp = tid / 32, lane = tid % 32;
    for (int t = t0; t < t1; ++t) {
      const int i = t - t0, b = i % kStages;
      if (i >= kStages) wait_parity(&sm.empty[b], ((i / kStages) - 1) & 1, mcast);
      const uint32_t kv = su32(sm.kv[b]);
      if (mode == 0) {
        // 2304 chunks of 16 B: thread tid takes key tid / 4 ... 8 keys x 72 chunks per warp
        for (int j = tid; j < kTileN * 72; j += 128) {
          const int k = j / 72, ch = j % 72, slab = ch / 8, cc = ch % 8;
          const __nv_bfloat16* src = pool + (long long)idx[t * kTileN + k] * kDim + ch * 8;
          const uint32_t dst = kv + slab * kSlabBytes + k * 128 + ((cc ^ (k & 7)) << 4);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(su32(&sm.full[b])) : "memory");
        continue;
      }
      if (tid == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(&sm.full[b])), "r"(kTileBytes) : "memory");
      // lane k of warp 0 handles key k (one lane per key; the rest idle)
      if (warp == 0) {
        const int k = lane;
        if (mcast && (uint32_t)(k % csize) != rank) continue;
        const int slot = idx[t * kTileN + k];
        const uint32_t bar = su32(&sm.full[b]);
        const uint16_t mask = (uint16_t)((1u << csize) - 1);
        if (mode == 1 || mode == 2) {
          for (int s = 0; s < kSlabs; ++s) {
            const uint32_t dst = kv + s * kSlabBytes + k * 128;
            if (mode == 1)
              asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                           ::"r"(dst), "l"(&tmap), "r"(s * 64), "r"(slot), "r"(bar) : "memory");
            else
              asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;"
                           ::"r"(dst), "l"(&tmap), "r"(s * 64), "r"(slot), "r"(bar), "h"(mask) : "memory");
          }
        } else {
          const uint32_t dst = kv + k * kRowBytes;
          const __nv_bfloat16* src = pool + (long long)slot * kDim;
          if (mode == 3)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(dst), "l"(src), "r"(kRowBytes), "r"(bar) : "memory");
          else
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
                         ::"r"(dst), "l"(src), "r"(kRowBytes), "r"(bar), "h"(mask) : "memory");
        }
      }
    }
  } else {  // consumer warpgroup: read each tile once, release it to every producer that fills it
    const int ct = tid - 128;
    unsigned long long acc = 0;
    for (int t = t0; t < t1; ++t) {
      const int i = t - t0, b = i % kStages;
      wait_parity(&sm.full[b], (i / kStages) & 1, false);
      const uint4* p = reinterpret_cast<const uint4*>(sm.kv[b]);
      for (int j = ct; j < kTileBytes / 16; j += 128) {
        const uint4 v = p[j];
        acc += (unsigned long long)v.x + v.y + v.z + v.w;
      }
      if (dump && i == 0) {
        uint4* d = reinterpret_cast<uint4*>(dump + (size_t)blockIdx.x * kTileBytes);
        for (int j = ct; j < kTileBytes / 16; j += 128) d[j] = p[j];
      }
      asm volatile("bar.sync 1, 128;" ::: "memory");
      if (ct == 0) {
        if (mcast)
          for (int r = 0; r < csize; ++r) arrive_remote(&sm.empty[b], r);
        else
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(su32(&sm.empty[b])) : "memory");
      }
    }
    atomicAdd(&sums[blockIdx.x], acc);
  }
  if (csize > 1) cluster_sync();  // no CTA leaves while a peer may still write into it or arrive on it
}

// A launch configuration for `grid` CTAs in clusters of `csize` (constructed in place: cfg points at attr).
struct ClusterLaunch {
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = {};
  ClusterLaunch(int csize, int grid, int smem) {
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = csize;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
};

int main(int argc, char** argv) {
  const int nkeys = argc > 1 ? std::atoi(argv[1]) : 131072;
  const long long nslots = argc > 2 ? std::atoll(argv[2]) : 1048576;
  const int ntiles = nkeys / kTileN;
  std::mt19937_64 rng(7);
  std::vector<uint16_t> hpool((size_t)nslots * kDim);
  for (size_t i = 0; i < hpool.size(); ++i) hpool[i] = (uint16_t)(((i * 2654435761u) >> 7) & 0x3f7f);  // finite bf16
  std::vector<int> perm(nslots);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int> hidx(perm.begin(), perm.begin() + nkeys);

  __nv_bfloat16* pool;
  int* idx;
  unsigned long long* sums;
  uint8_t* dump;
  CK(cudaMalloc(&pool, hpool.size() * 2));
  CK(cudaMalloc(&idx, nkeys * 4));
  CK(cudaMalloc(&sums, 132 * 8));
  CK(cudaMalloc(&dump, (size_t)132 * kTileBytes));
  CK(cudaMemcpy(pool, hpool.data(), hpool.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(idx, hidx.data(), nkeys * 4, cudaMemcpyHostToDevice));
  void* flush;
  CK(cudaMalloc(&flush, 256 << 20));

  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000, cudaEnableDefault, &q));
  CUtensorMap tmap;
  const cuuint64_t gdim[2] = {(cuuint64_t)kDim, (cuuint64_t)nslots};
  const cuuint64_t gstride[1] = {(cuuint64_t)kRowBytes};
  const cuuint32_t box[2] = {64, 1}, estride[2] = {1, 1};
  CUresult cr = encode(&tmap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, pool, gdim, gstride, box, estride,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (cr != CUDA_SUCCESS) { std::printf("cuTensorMapEncodeTiled failed: %d\n", (int)cr); return 1; }

  const int smem = sizeof(Smem) + 1024;
  CK(cudaFuncSetAttribute(gather, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(gather, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const char* names[] = {"cp.async", "tma", "tma-mcast", "bulk", "bulk-mcast"};
  std::printf("keys %d (%d tiles), pool %lld slots (%.0f MB), unique bytes %.1f MB\n", nkeys, ntiles, nslots,
              nslots * kRowBytes / 1e6, (double)nkeys * kRowBytes / 1e6);
  std::printf("%-11s %2s %9s %9s %11s %11s %s\n", "mode", "C", "us", "GB/s uniq", "GB/s deliv", "checksum", "layout");
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int csize : {1, 2, 3, 4}) {
    ClusterLaunch oc(csize, 132 / csize * csize, smem);
    int nact = 0;
    CK(cudaOccupancyMaxActiveClusters(&nact, gather, &oc.cfg));
    std::printf("cluster size %d: at most %d clusters resident (%d CTAs)\n", csize, nact, nact * csize);
  }
  for (int csize : {1, 2, 3, 4})
    for (int mode = 0; mode < 5; ++mode) {
      if (csize == 1 && (mode == 2 || mode == 4)) continue;
      const int nclusters = 132 / csize, grid = nclusters * csize;
      ClusterLaunch cl(csize, grid, smem);
      std::vector<float> times;
      bool sum_ok = true, layout_ok = true;
      for (int rep = 0; rep < 12; ++rep) {
        CK(cudaMemset(flush, rep, 256 << 20));  // evict the keys from L2
        CK(cudaMemset(sums, 0, 132 * 8));
        const bool check = rep == 0;
        CK(cudaEventRecord(e0));
        CK(cudaLaunchKernelEx(&cl.cfg, gather, tmap, (const __nv_bfloat16*)pool, (const int*)idx, ntiles, mode, csize, sums,
                              check ? dump : (uint8_t*)nullptr));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (rep >= 2) times.push_back(ms * 1e3f);
        if (!check) continue;
        std::vector<unsigned long long> hs(grid);
        CK(cudaMemcpy(hs.data(), sums, grid * 8, cudaMemcpyDeviceToHost));
        std::vector<uint8_t> hd((size_t)grid * kTileBytes);
        CK(cudaMemcpy(hd.data(), dump, hd.size(), cudaMemcpyDeviceToHost));
        for (int c = 0; c < grid; ++c) {
          const int cl = c / csize;
          const int t0 = (int)((long long)ntiles * cl / nclusters), t1 = (int)((long long)ntiles * (cl + 1) / nclusters);
          unsigned long long want = 0;
          for (int t = t0; t < t1; ++t)
            for (int k = 0; k < kTileN; ++k) {
              const uint32_t* w = reinterpret_cast<const uint32_t*>(&hpool[(size_t)hidx[t * kTileN + k] * kDim]);
              for (int j = 0; j < kRowBytes / 4; ++j) want += w[j];
            }
          if (want != hs[c]) sum_ok = false;
          if (mode >= 3) continue;  // bulk modes land unswizzled rows
          const uint8_t* d = &hd[(size_t)c * kTileBytes];
          for (int k = 0; k < kTileN && layout_ok; ++k) {
            const uint8_t* row = reinterpret_cast<const uint8_t*>(&hpool[(size_t)hidx[t0 * kTileN + k] * kDim]);
            for (int ch = 0; ch < 72; ++ch) {
              const int s = ch / 8, cc = ch % 8;
              if (std::memcmp(d + s * kSlabBytes + k * 128 + ((cc ^ (k & 7)) << 4), row + ch * 16, 16)) { layout_ok = false; break; }
            }
          }
        }
      }
      std::sort(times.begin(), times.end());
      const float us = times[times.size() / 2];
      const double uniq = (double)ntiles * kTileBytes;
      std::printf("%-11s %2d %9.1f %9.0f %11.0f %11s %s\n", names[mode], csize, us, uniq / us / 1e3, uniq * csize / us / 1e3,
                  sum_ok ? "ok" : "WRONG", mode >= 3 ? "-" : (layout_ok ? "ok" : "WRONG"));
    }
  return 0;
}
