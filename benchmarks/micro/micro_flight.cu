// Microbenchmark: how long a key tile is in flight (its copies issued -> landed) at a given consumption rate
// (session 16; written after the device time was spent, compile-checked only).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_flight.cu -o /tmp/micro_flight
// Why: in the dual kernel a tile's S ends ~5,200 clocks after its copies were issued, and when the score warpgroups
// issued the copies as soon as a buffer was free (KDTREE_SPLIT_KERNEL=srefill) ~10,800: earlier copies landed later
// (docs/PERF_LOG.md, history 111). micro_intake measures the gather's rate with nothing consuming; this measures the
// flight time itself while a consumer holds each tile for HOLD clocks, so that the rate is the consumer's, as in the
// kernel. If the flight time stays near the unloaded latency at the kernel's rate (~3.7 TB/s into the SMs at H16 N9),
// the kernel's long flights come from the kernel; if it grows with the tiles in flight, the memory system queues them
// and a deeper lead will not pay.
// 1 CTA per SM, 384 threads, a ring of RING buffers of 32-key tiles (9 slabs of 4 KB, the kernels' 128-byte swizzle):
// - warpgroups 1-2 (256 threads, as the dual kernel's value warpgroups) refill buffer i % RING with tile i as soon as
//   tile i - RING has been consumed (empty mbarrier): 9 cp.async of 16 B per thread, then an arrival on the buffer's
//   full mbarrier once they have landed (cp.async.mbarrier.arrive.noinc); thread 0 stamps the issue;
// - warp 0 waits for every tile's full mbarrier in order and stamps its landing;
// - warps 1-3 (the consumer) wait for tile i, hold it HOLD clocks, and free it.
// Keys repeat across `reuse` consecutive CTAs (3: the three 64-row items of an H16 N9 split read the same keys).
// Reports the keys' rate into the SMs, the median period per tile and the median flight time (median over the SMs of
// each SM's median over its tiles after the first 100).
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "micro_common.cuh"

constexpr int kTileBytes = 9 * 4096;
constexpr int kTiles = 1200;
constexpr int kSkip = 100;

template <int RING>
__global__ void __launch_bounds__(384, 1) flight(const unsigned char* pool, const int* slots, int nslots, int reuse,
                                                 int hold, long long* out) {
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char* ring = raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u);
  __shared__ uint64_t full[RING], empty[RING];
  __shared__ long long t_issue[kTiles], t_land[kTiles];
  __shared__ long long t_first, t_last;
  if (threadIdx.x == 0) {
    for (int b = 0; b < RING; ++b) {
      mbar_init(&full[b], 256);
      mbar_init(&empty[b], 96);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  if (warp >= 4) {   // producer: 256 threads, key vt / 8 of a tile, chunk vt % 8 of each slab
    const int vt = threadIdx.x - 128, key = vt / 8, cc = vt % 8;
    unsigned seed = (blockIdx.x / reuse) * 977u + key;
    for (int i = 0; i < kTiles; ++i) {
      const int b = i % RING;
      if (i >= RING) mbar_wait(&empty[b], ((i / RING) - 1) & 1);
      if (vt == 0) t_issue[i] = clock64();
      seed = seed * 1664525u + 1013904223u;
      const unsigned char* src = pool + (long long)slots[seed % nslots] * 1152 + cc * 16;
      const uint32_t dst = smem_u32(ring + b * kTileBytes) + key * 128 + ((cc ^ (key & 7)) << 4);
#pragma unroll
      for (int slab = 0; slab < 9; ++slab)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + slab * 4096), "l"(src + slab * 128)
                     : "memory");
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(&full[b])) : "memory");
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  } else if (warp == 0) {   // watcher: every tile's landing, in order
    for (int i = 0; i < kTiles; ++i) {
      mbar_wait(&full[i % RING], (i / RING) & 1);
      if (threadIdx.x == 0) {
        t_land[i] = clock64();
        if (i == kSkip) t_first = t_land[i];
        if (i == kTiles - 1) t_last = t_land[i];
      }
    }
  } else {   // consumer: warps 1-3 hold each tile `hold` clocks, then free it
    for (int i = 0; i < kTiles; ++i) {
      const int b = i % RING;
      mbar_wait(&full[b], (i / RING) & 1);
      const long long t0 = clock64();
      while (clock64() - t0 < hold) {
      }
      mbar_arrive(&empty[b]);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {   // this SM's median flight over tiles kSkip .. kTiles - 1 (insertion into a small histogram)
    long long lo = 1ll << 62, hi = 0;
    for (int i = kSkip; i < kTiles; ++i) {
      const long long f = t_land[i] - t_issue[i];
      lo = min(lo, f);
      hi = max(hi, f);
    }
    // median by bisection on the value (kTiles is small; clocks fit in 40 bits)
    long long a = lo, z = hi;
    while (a < z) {
      const long long m = a + (z - a) / 2;
      int below = 0;
      for (int i = kSkip; i < kTiles; ++i) below += (t_land[i] - t_issue[i]) <= m;
      if (2 * below >= kTiles - kSkip) z = m; else a = m + 1;
    }
    out[2 * blockIdx.x] = a;
    out[2 * blockIdx.x + 1] = (t_last - t_first) / (kTiles - 1 - kSkip);   // period per tile
  }
}

template <int RING>
void run(const KeyPool& k, int reuse, int hold) {
  const int sms = k.sms;
  const int smem = RING * kTileBytes + 1024;
  long long* d;
  cudaMalloc(&d, 2 * sms * 8);
  cudaFuncSetAttribute(flight<RING>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const float ms = best_ms([&] { flight<RING><<<sms, 384, smem>>>(k.pool, k.slots, k.rows, reuse, hold, d); });
  const cudaError_t e = cudaDeviceSynchronize();
  std::vector<long long> h(2 * sms), fl(sms), per(sms);
  cudaMemcpy(h.data(), d, 2 * sms * 8, cudaMemcpyDeviceToHost);
  for (int i = 0; i < sms; ++i) {
    fl[i] = h[2 * i];
    per[i] = h[2 * i + 1];
  }
  std::sort(fl.begin(), fl.end());
  std::sort(per.begin(), per.end());
  const double bytes = (double)sms * kTiles * kTileBytes;
  printf("ring %d (%d in flight at most) reuse %d hold %5d clk | keys into the SMs %5.2f TB/s | period %6lld clk/tile | "
         "flight %6lld clk (median SM; p10 %lld, p90 %lld) | %s\n",
         RING, RING - 1, reuse, hold, bytes / (ms * 1e-3) / 1e12, per[sms / 2], fl[sms / 2], fl[sms / 10],
         fl[9 * sms / 10], cudaGetErrorString(e));
  cudaFree(d);
}

int main() {
  const KeyPool k = key_pool();
  for (int reuse : {3, 1})
    for (int hold : {0, 1000, 2000, 3000}) {
      run<4>(k, reuse, hold);
      run<3>(k, reuse, hold);
      run<2>(k, reuse, hold);
    }
  return 0;
}
