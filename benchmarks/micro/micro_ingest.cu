// Microbenchmark: how fast can the SMs of the GPU pull page-size-1 key rows (1152 B at random slots of a
// 2.4 GB pool) in, by method and by the number of threads that keep requests in flight?
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_ingest.cu -o /tmp/micro_ingest
// Every row is read once (131,072 rows, 151 MB: the KV of H16 P131072), so the rate is the rate of
// distinct keys. The verify kernel's own gather (cp.async 16 B from 256 threads, 1 CTA per SM) reaches
// 2.1-2.4 TB/s here; a contiguous copy 4.2 TB/s (PERF.md). The question for the kernel: is that gap
// the random rows, or too few requests in flight per SM?
// "regs":   warps read whole rows into registers with 16-byte ld.global.nc (lane l: chunks l, l + 32,
//           l + 64 < 72), U rows per warp in flight, the data folded into a checksum (no shared memory);
//           blocks per SM x threads per block varied.
// "cp.async": 16-byte cp.async into a shared ring of 32-key tiles (4 deep with 1 CTA per SM, 3 deep
//           with 2), 256-1024 threads per CTA; each thread loads the slots of its chunks before issuing
//           its copies (as the kernel does).
// "contiguous" rows (slot i = i) bound each method from above.
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>
#include "micro_common.cuh"

constexpr int kKeyBytes = 1152, kChunks = kKeyBytes / 16, kTile = 32, kTileBytes = kTile * kKeyBytes;

template <int U>
__global__ void regs(const uint4* pool, const int* slots, int nkeys, unsigned* sink) {
  const int lane = threadIdx.x & 31;
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
  unsigned acc = 0;
  for (int r0 = gw * U; r0 < nkeys; r0 += nw * U) {
    int s[U];
#pragma unroll
    for (int u = 0; u < U; ++u) s[u] = slots[min(r0 + u, nkeys - 1)];
    uint4 v[U][3];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        const int ch = lane + 32 * j;
        v[u][j] = ch < kChunks ? __ldg(pool + (long long)s[u] * kChunks + ch) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 3; ++j) acc ^= v[u][j].x ^ v[u][j].y ^ v[u][j].z ^ v[u][j].w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <int THREADS, int kStages>
__global__ void __launch_bounds__(THREADS, 1) ring(const unsigned char* pool, const int* slots, int nkeys, int chunk,
                                                  unsigned* sink) {
  extern __shared__ __align__(128) unsigned char buf[];
  constexpr int kPer = (kTile * kChunks + THREADS - 1) / THREADS;   // chunks per thread per tile
  const int tid = threadIdx.x;
  const int nsplit = (nkeys + chunk - 1) / chunk;
  unsigned acc = 0;
  for (int split = blockIdx.x; split < nsplit; split += gridDim.x) {
    const int k0 = split * chunk, k1 = min(nkeys, k0 + chunk);
    const int ntiles = (k1 - k0 + kTile - 1) / kTile;
    auto issue = [&](int t) {
      if (t < ntiles) {
        unsigned char* dst = buf + (t % kStages) * kTileBytes;
        int slot[kPer];
#pragma unroll
        for (int p = 0; p < kPer; ++p) {   // the slots first: no index load waits behind a copy
          const int i = tid + p * THREADS;
          slot[p] = i < kTile * kChunks ? slots[min(k0 + t * kTile + i / kChunks, nkeys - 1)] : 0;
        }
#pragma unroll
        for (int p = 0; p < kPer; ++p) {
          const int i = tid + p * THREADS;
          if (i < kTile * kChunks)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                         ::"r"(smem_u32(dst + (i / kChunks) * kKeyBytes + (i % kChunks) * 16)),
                         "l"(pool + (long long)slot[p] * kKeyBytes + (i % kChunks) * 16) : "memory");
        }
      }
      asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    for (int t = 0; t < kStages - 1; ++t) issue(t);
    for (int t = 0; t < ntiles; ++t) {
      issue(t + kStages - 1);
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 1) : "memory");
      __syncthreads();
      acc ^= reinterpret_cast<const unsigned*>(buf + (t % kStages) * kTileBytes)[tid % (kTileBytes / 4)];
      __syncthreads();   // the stage is consumed before it is refilled
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

template <int U>
void run_regs(const char* what, const unsigned char* pool, const int* slots, int nkeys, int sms, int per_sm, int threads) {
  unsigned* sink; cudaMalloc(&sink, 4);
  const float ms = best_ms([&] { regs<U><<<sms * per_sm, threads>>>(reinterpret_cast<const uint4*>(pool), slots, nkeys, sink); });
  printf("regs      %-10s %d x %4d threads/SM, %d rows/warp in flight | %7.1f us | %5.2f TB/s | %s\n", what, per_sm, threads,
         U, ms * 1e3, (double)nkeys * kKeyBytes / (ms * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
  cudaFree(sink);
}

template <int THREADS, int STAGES>
void run_ring(const char* what, const unsigned char* pool, const int* slots, int nkeys, int sms, int per_sm) {
  unsigned* sink; cudaMalloc(&sink, 4);
  const int smem = STAGES * kTileBytes;
  cudaFuncSetAttribute(ring<THREADS, STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const float ms = best_ms([&] { ring<THREADS, STAGES><<<sms * per_sm, THREADS, smem>>>(pool, slots, nkeys, 512, sink); });
  printf("cp.async  %-10s %d x %4d threads/SM, %d x 32-key ring      | %7.1f us | %5.2f TB/s | %s\n", what, per_sm, THREADS,
         STAGES, ms * 1e3, (double)nkeys * kKeyBytes / (ms * 1e-3) / 1e12, cudaGetErrorString(cudaGetLastError()));
  cudaFree(sink);
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int nrows = 1 << 21, nkeys = 131072;
  unsigned char* pool = filled_pool(nrows, kKeyBytes);
  std::vector<int> contiguous(nrows);
  for (int i = 0; i < nrows; ++i) contiguous[i] = i;
  int* shuffled = device_slots(shuffled_slots(nrows), nkeys);
  int* straight = device_slots(contiguous, nkeys);
  for (int pass = 0; pass < 2; ++pass) {
    const char* what = pass == 0 ? "random" : "contiguous";
    const int* slots = pass == 0 ? shuffled : straight;
    run_regs<1>(what, pool, slots, nkeys, sms, 1, 256);
    run_regs<4>(what, pool, slots, nkeys, sms, 1, 256);
    run_regs<1>(what, pool, slots, nkeys, sms, 2, 1024);
    run_regs<2>(what, pool, slots, nkeys, sms, 2, 1024);
    run_regs<4>(what, pool, slots, nkeys, sms, 2, 1024);
    run_ring<256, 4>(what, pool, slots, nkeys, sms, 1);
    run_ring<512, 4>(what, pool, slots, nkeys, sms, 1);
    run_ring<768, 4>(what, pool, slots, nkeys, sms, 1);
    run_ring<1024, 4>(what, pool, slots, nkeys, sms, 1);   // (1152 exceeded the 1,024-thread block limit)
    run_ring<256, 3>(what, pool, slots, nkeys, sms, 2);   // two CTAs per SM (110.6 KB each)
    run_ring<512, 3>(what, pool, slots, nkeys, sms, 2);
  }
  return 0;
}
