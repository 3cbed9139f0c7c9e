// Pieces every microbenchmark in this folder uses (device aids, not part of the package).
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>
#include <cuda_runtime.h>

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// Shared-memory matrix descriptor, 128-byte swizzle (as src/cuda/verify_wgmma.cuh builds it).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// mbarriers: init with an arrival count, a plain arrival (release), a wait on a phase's parity (acquire).
__device__ __forceinline__ void mbar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(b)), "r"(parity) : "memory");
}

// setmaxnreg from the launch's Launch registers a thread to N (the pool is what the block got at launch: a request past
// it waits forever, history 16)
template <int N, int Launch>
__device__ __forceinline__ void set_max_regs() {
  if constexpr (N > Launch) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
  else asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

__device__ __forceinline__ uint32_t cluster_rank() { uint32_t r; asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r)); return r; }
__device__ __forceinline__ uint32_t mapa(uint32_t addr, uint32_t rank) {   // my shared address -> rank's
  uint32_t r; asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank)); return r;
}
__device__ __forceinline__ void wait_cluster(uint32_t bar, uint32_t parity) {   // acquire at cluster scope
  asm volatile("{\n.reg .pred d;\nW_%=:\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 d, [%0], %1;\n@!d bra W_%=;\n}\n"
               ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// A recognisable, never-constant pool content, so a misplaced copy shows.
__global__ void fill(unsigned* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = (unsigned)(i * 2654435761u) ^ (unsigned)(i >> 17);
}

// A key pool of `rows` rows of `row_bytes`, filled by fill().
inline unsigned char* filled_pool(int rows, int row_bytes) {
  unsigned char* pool;
  cudaMalloc(&pool, (size_t)rows * row_bytes);
  fill<<<1024, 256>>>(reinterpret_cast<unsigned*>(pool), (size_t)rows * row_bytes / 4);
  return pool;
}

// A random permutation of 0 .. n-1 (page-size-1 slots as a long-running server leaves them).
inline std::vector<int> shuffled_slots(int n) {
  std::vector<int> perm(n);
  for (int i = 0; i < n; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(1));
  return perm;
}

// The first `count` entries of `slots` on the device.
inline int* device_slots(const std::vector<int>& slots, int count) {
  int* d;
  cudaMalloc(&d, count * 4);
  cudaMemcpy(d, slots.data(), count * 4, cudaMemcpyHostToDevice);
  return d;
}

// The gather micros' key pool: 2^21 random 1152-byte rows (2.4 GB, so the distinct keys come from DRAM), all of their
// slots shuffled, and the SM count.
struct KeyPool {
  int sms, rows;
  unsigned char* pool;
  int* slots;
};
inline KeyPool key_pool() {
  KeyPool k;
  cudaDeviceGetAttribute(&k.sms, cudaDevAttrMultiProcessorCount, 0);
  k.rows = 1 << 21;
  k.pool = filled_pool(k.rows, 1152);
  k.slots = device_slots(shuffled_slots(k.rows), k.rows);
  return k;
}

// Launch configuration of a 1-D grid, in clusters of `cluster` CTAs when cluster > 1 (attr must outlive cfg).
inline cudaLaunchConfig_t launch_config(int grid, int block, int smem, int cluster, cudaLaunchAttribute& attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  if (cluster > 1) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster; attr.val.clusterDim.y = 1; attr.val.clusterDim.z = 1;
    cfg.attrs = &attr; cfg.numAttrs = 1;
  }
  return cfg;
}

// Best CUDA-event time of `launch()` in milliseconds over 5 runs after a warm-up run; `before()` runs
// ahead of each, outside the timed span.
template <typename F, typename G>
float best_ms(F launch, G before) {
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  float best = 1e30f;
  for (int rep = 0; rep < 6; ++rep) {
    before();
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    if (rep > 0) best = std::min(best, ms);
  }
  return best;
}
template <typename F>
float best_ms(F launch) { return best_ms(launch, [] {}); }
