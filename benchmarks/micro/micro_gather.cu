// Microbenchmark: the page-size-1 key gather of the verify kernel, alone (no math), four ways.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_gather.cu -o /tmp/micro_gather
// A grid of 1 CTA per SM (256 threads) takes work items (split, reuse copy) from an atomic counter; an
// item streams its split's keys (1152-byte rows, random slots) in 32-key tiles through a STAGES-deep ring,
// touching each landed tile once. reuse = 3 is the H16 N9 pattern (three 64-row items read the same keys).
// MODE 0 cp.async 16 B (8 threads per key row); 1 one cp.async.bulk per key row (1152 B, mbarrier);
// 2 TMA tensor copies, one 64-column slab (128 B) of one key each, 128-byte swizzle, straight into the
//   [slab][key][128 B] layout wgmma reads (the first tile is checked against the pool);
// 3 as 2, but a cluster of 3 CTAs shares each split: every CTA issues a third of the copies, multicast;
// 4 as 1 (one bulk copy per row), in a cluster of 3 CTAs sharing each split, each CTA issuing a third of
//   the rows with .multicast::cluster (L2 read once per key, every SM still receives every key);
// 5 as 4 without multicast (each CTA of the cluster copies every row itself): the control for 4.
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <random>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>
#include "micro_common.cuh"

constexpr int kTile = 32, kKeyBytes = 1152, kChunks = kKeyBytes / 16, kSlabs = 9, kSlabBytes = kTile * 128;
constexpr int kTileBytes = kTile * kKeyBytes, kThreads = 256;

template <int MODE, int STAGES>
__global__ void __launch_bounds__(kThreads, 1) gather(const __grid_constant__ CUtensorMap tmap, const unsigned char* pool,
                                                     const int* slots, int nkeys, int chunk, int reuse, int* counter,
                                                     unsigned* sink, int* bad) {
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char* ring = raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u);
  __shared__ int s_item;
  __shared__ __align__(8) uint64_t full[STAGES];
  const int nsplit = (nkeys + chunk - 1) / chunk, total = nsplit * reuse;
  const int tid = threadIdx.x;
  constexpr bool kCluster = MODE >= 3;
  const uint32_t rank = kCluster ? cluster_rank() : 0;
  if (tid == 0)
    for (int b = 0; b < STAGES; ++b)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&full[b])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  if (kCluster) cluster_sync(); else __syncthreads();
  unsigned acc = 0;
  uint32_t phases = 0;
  int first = 1;
  for (int round = 0;; ++round) {
    int item;
    if (kCluster) {   // one split per cluster, no persistence
      if (round > 0) break;
      item = (blockIdx.x / 3) * reuse;
    } else {
      if (tid == 0) s_item = atomicAdd(counter, 1);
      __syncthreads();
      item = s_item;
      __syncthreads();
      if (item >= total) break;
    }
    const int k0 = (item / reuse) * chunk, k1 = min(nkeys, k0 + chunk);
    const int ntiles = (k1 - k0 + kTile - 1) / kTile;
    auto issue = [&](int t) {
      if (t >= ntiles) { if (MODE == 0) asm volatile("cp.async.commit_group;\n" ::: "memory"); return; }
      unsigned char* buf = ring + (t % STAGES) * kTileBytes;
      uint64_t* bar = &full[t % STAGES];
      if (MODE == 0) {
        for (int i = tid; i < kTile * kChunks; i += kThreads) {
          const int k = i / kChunks, ch = i % kChunks, key = min(k0 + t * kTile + k, nkeys - 1);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(buf + k * kKeyBytes + ch * 16)),
                       "l"(pool + (long long)slots[key] * kKeyBytes + ch * 16) : "memory");
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        return;
      }
      if (tid == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(kTileBytes) : "memory");
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      if (MODE == 4) {
        if (tid < kTile && tid % 3 == (int)rank) {
          const int key = min(k0 + t * kTile + tid, nkeys - 1);
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n"
                       ::"r"(smem_u32(buf + tid * kKeyBytes)), "l"(pool + (long long)slots[key] * kKeyBytes), "r"(kKeyBytes),
                       "r"(smem_u32(bar)), "h"((unsigned short)7) : "memory");
        }
        return;
      }
      if (MODE == 1 || MODE == 5) {
        if (tid < kTile) {
          const int key = min(k0 + t * kTile + tid, nkeys - 1);
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                       ::"r"(smem_u32(buf + tid * kKeyBytes)), "l"(pool + (long long)slots[key] * kKeyBytes), "r"(kKeyBytes),
                       "r"(smem_u32(bar)) : "memory");
        }
        return;
      }
      for (int i = tid; i < kTile * kSlabs; i += kThreads) {
        const int k = i / kSlabs, slab = i % kSlabs, key = min(k0 + t * kTile + k, nkeys - 1);
        const uint32_t dst = smem_u32(buf + slab * kSlabBytes + k * 128);
        if (MODE == 2) {
          asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                       ::"r"(dst), "l"(&tmap), "r"(slab * 64), "r"(slots[key]), "r"(smem_u32(bar)) : "memory");
        } else if (i % 3 == (int)rank) {
          asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n"
                       ::"r"(dst), "l"(&tmap), "r"(slab * 64), "r"(slots[key]), "r"(smem_u32(bar)), "h"((unsigned short)7) : "memory");
        }
      }
    };
    for (int t = 0; t < STAGES - 1; ++t) issue(t);
    for (int t = 0; t < ntiles; ++t) {
      issue(t + STAGES - 1);
      const unsigned char* buf = ring + (t % STAGES) * kTileBytes;
      if (MODE == 0) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1) : "memory");
        __syncthreads();
      } else {
        mbar_wait(&full[t % STAGES], (phases >> (t % STAGES)) & 1u);
        phases ^= 1u << (t % STAGES);
      }
      acc ^= reinterpret_cast<const unsigned*>(buf)[tid * 7];
      if (first && t == 0 && tid < kTile * kSlabs / 8) {   // check where the first tile's bytes landed
        for (int i = tid; i < kTile * kSlabs; i += kTile * kSlabs / 8) {
          const int k = i / kSlabs, slab = i % kSlabs;
          const unsigned char* src = pool + (long long)slots[k0 + k] * kKeyBytes + slab * 128;
          for (int c = 0; c < 8; ++c) {
            const int off = (MODE == 2 || MODE == 3) ? slab * kSlabBytes + k * 128 + ((c ^ (k & 7)) << 4)   // wgmma swizzle
                                                     : k * kKeyBytes + slab * 128 + c * 16;                  // row-contiguous
            if (reinterpret_cast<const uint4*>(src + c * 16)->x != reinterpret_cast<const uint4*>(buf + off)->x)
              atomicAdd(bad, 1);
          }
        }
      }
      if (kCluster) cluster_sync(); else __syncthreads();
    }
    first = 0;
    if (MODE == 0) asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <int MODE, int STAGES>
void run(const CUtensorMap& tmap, const unsigned char* pool, const int* slots, int nkeys, int chunk, int reuse, int sms) {
  int *counter, *bad; unsigned* sink;
  cudaMalloc(&counter, 4); cudaMalloc(&sink, 4); cudaMalloc(&bad, 4); cudaMemset(bad, 0, 4);
  const int smem = STAGES * kTileBytes + 1024;
  auto kern = gather<MODE, STAGES>;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int nsplit = (nkeys + chunk - 1) / chunk;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = launch_config(MODE >= 3 ? nsplit * 3 : sms, kThreads, smem, MODE >= 3 ? 3 : 1, attr);
  const float best = best_ms([&] { cudaLaunchKernelEx(&cfg, kern, tmap, pool, slots, nkeys, chunk, reuse, counter, sink, bad); },
                             [&] { cudaMemset(counter, 0, 4); });
  int hbad = 0; cudaMemcpy(&hbad, bad, 4, cudaMemcpyDeviceToHost);
  const double bytes = (double)nkeys * kKeyBytes * reuse;
  static const char* names[] = {"cp.async 16B", "bulk per row", "TMA per slab", "TMA multicast x3", "bulk multicast x3",
                                "bulk cluster x3"};
  printf("%-17s stages %d chunk %5d reuse %d | %7.1f us | delivered %5.2f TB/s | unique %5.2f TB/s | misplaced %d | %s\n",
         names[MODE], STAGES, chunk, reuse, best * 1e3, bytes / (best * 1e-3) / 1e12, bytes / reuse / (best * 1e-3) / 1e12,
         hbad, cudaGetErrorString(cudaGetLastError()));
  cudaFree(counter); cudaFree(sink); cudaFree(bad);
}

int main(int argc, char**) {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int nrows = 1 << 21, nkeys = 131072;
  unsigned char* pool = filled_pool(nrows, kKeyBytes);
  std::vector<int> perm = shuffled_slots(nrows);
  int* slots = device_slots(perm, nkeys);
  CUtensorMap tmap;
  const cuuint64_t dims[2] = {576, (cuuint64_t)nrows};
  const cuuint64_t strides[1] = {kKeyBytes};
  const cuuint32_t box[2] = {64, 1}, estr[2] = {1, 1};
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                              const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
  CUresult r = reinterpret_cast<Encode>(fn)(&tmap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, pool, dims, strides, box, estr,
                                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  printf("cuTensorMapEncodeTiled: %d\n", (int)r);
  const bool extra = argc > 1;   // the L2-resident and contiguous-slot cases only
  if (!extra) {
    for (int reuse : {1, 3}) {
      run<0, 4>(tmap, pool, slots, nkeys, 512, reuse, sms);
      run<1, 4>(tmap, pool, slots, nkeys, 512, reuse, sms);
      run<1, 6>(tmap, pool, slots, nkeys, 512, reuse, sms);
      run<2, 4>(tmap, pool, slots, nkeys, 512, reuse, sms);
      run<2, 6>(tmap, pool, slots, nkeys, 512, reuse, sms);
      run<2, 4>(tmap, pool, slots, nkeys, 1536, reuse, sms);
    }
    run<3, 4>(tmap, pool, slots, nkeys, 1536, 3, sms);
    run<3, 6>(tmap, pool, slots, nkeys, 1536, 3, sms);
    run<3, 4>(tmap, pool, slots, nkeys, 512, 3, sms);
    run<4, 4>(tmap, pool, slots, nkeys, 512, 3, sms);
    run<4, 4>(tmap, pool, slots, nkeys, 1536, 3, sms);
    run<5, 4>(tmap, pool, slots, nkeys, 512, 3, sms);
    return 0;
  }
  printf("-- L2-resident: 8192 keys (9.4 MB), each read 16 times\n");
  run<0, 4>(tmap, pool, slots, 8192, 512, 16, sms);
  run<1, 4>(tmap, pool, slots, 8192, 512, 16, sms);
  run<1, 8>(tmap, pool, slots, 8192, 512, 16, sms);
  printf("-- contiguous slots\n");
  for (int i = 0; i < nkeys; ++i) perm[i] = i;
  cudaMemcpy(slots, perm.data(), nkeys * 4, cudaMemcpyHostToDevice);
  run<0, 4>(tmap, pool, slots, nkeys, 512, 1, sms);
  run<1, 4>(tmap, pool, slots, nkeys, 512, 1, sms);
  run<1, 4>(tmap, pool, slots, nkeys, 512, 3, sms);
  return 0;
}
