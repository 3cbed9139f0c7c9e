// Microbenchmark: do the products running beside the key gather slow the gather down? (session 10)
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_intake.cu -o /tmp/micro_intake
// The dual split kernel takes keys into the SMs at ~3.7 TB/s at H16 N9 P131072 with S and P V running, and at ~5
// TB/s with both knocked out (docs/PERF_LOG.md, sessions 6 and 10); issuing the copies earlier does not help. This
// measures the gather alone against the gather with one warpgroup keeping the tensor cores and shared memory busy,
// to tell whether the shared-memory reads of the products (S as m64n32k16 reads q, 2 KB per 64 KFLOP) are what the
// gather loses to, and whether S as m64n64k16 (half the q bytes per FLOP) would leave it more.
// 1 CTA per SM, 384 threads. WG1 and WG2 gather `tiles` 32-key tiles of random 1152-byte rows into a 4-stage ring
// (9 cp.async of 16 B per thread per tile, as the kernel, at most 4 tiles in flight per thread); keys repeat across
// `reuse` consecutive CTAs (3: the three 64-row items of a split at H16 N9 read the same keys, 2 of 3 from L2).
// WG0, until the gather ends: MODE 0 nothing; 1 S chains (36 wgmma m64n32k16, q and the ring from shared memory);
// 2 the same FLOPs as m64n64k16 (18 per round: half the q bytes); 3 P V (2 x m64n256k16, B MN-major, per round).
// Reports the keys' rate into the SMs (TB/s over the kernel's event time) and WG0's wgmma rate. Then the gather
// alone with 1-3 tiles in flight per thread instead of 4 (DEPTH): its rate against the bytes in flight per SM; then 1-2
// tiles in flight beside each product (session 16).
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "micro_split.cuh"

constexpr int kSmem = kQ + kRing + kP + 1024;

template <int MODE, int DEPTH = 4>
__global__ void __launch_bounds__(384, 1) intake(const unsigned char* pool, const int* slots, int nslots, int tiles,
                                                 int reuse, long long* rounds) {
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char* sm = split_smem(raw, 384);
  const uint32_t qb = smem_u32(sm), kb = qb + kQ, pb = kb + kRing;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  __shared__ int done;
  __shared__ int stop_slots[6];   // wg_flag's per-warpgroup answers
  if (threadIdx.x == 0) done = 0;
  __syncthreads();
  if (wg == 0) {
    long long r = 0;
    // the accumulators' sum is stored only if impossible, so the products are not optimised away
    if (MODE == 1) {
      float s[16] = {};
      for (; !wg_flag(&done, stop_slots, 0, r); ++r) s_round_n32(s, qb, kb + (r & 3) * kTile);
      if (s[0] == 1234.f && s[15] == 1234.f) rounds[gridDim.x] = 0;
    } else if (MODE == 2) {
      float s[32] = {};
      for (; !wg_flag(&done, stop_slots, 0, r); ++r) s_round_n64(s, qb, kb + (r & 1) * 2 * kTile);
      if (s[0] == 1234.f && s[31] == 1234.f) rounds[gridDim.x] = 0;
    } else if (MODE == 3) {
      float o[128] = {};
      for (; !wg_flag(&done, stop_slots, 0, r); ++r) pv_round(o, pb, kb + (r & 3) * kTile);
      if (o[0] == 1234.f && o[127] == 1234.f) rounds[gridDim.x] = 0;
    }
    if (t == 0) rounds[blockIdx.x] = r;
    return;
  }
  const int vt = threadIdx.x - 128;
  unsigned seed = (blockIdx.x / reuse) * 977u + vt / 8;   // key vt / 8 of each tile
  for (int i = 0; i < tiles; ++i) {
    seed = seed * 1664525u + 1013904223u;
    gather_tile_async<DEPTH>(pool, slots[seed % nslots], vt, kb + (i & 3) * kTile);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  asm volatile("bar.sync 1, 256;\n" ::: "memory");   // both gather warpgroups done
  if (vt == 0) *(volatile int*)&done = 1;
}

template <int MODE, int DEPTH = 4>
void run(const char* what, const KeyPool& k, int reuse) {
  const int sms = k.sms;
  const int tiles = 1500;
  long long* d;
  cudaMalloc(&d, (sms + 1) * 8);
  cudaFuncSetAttribute(intake<MODE, DEPTH>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  const float ms = best_ms([&] { intake<MODE, DEPTH><<<sms, 384, kSmem>>>(k.pool, k.slots, k.rows, tiles, reuse, d); }, [] {});
  const cudaError_t e = cudaDeviceSynchronize();
  std::vector<long long> h(sms);
  cudaMemcpy(h.data(), d, sms * 8, cudaMemcpyDeviceToHost);
  std::sort(h.begin(), h.end());
  const double bytes = (double)sms * tiles * 32 * 1152;
  // FLOPs per WG0 round: S 36 x 64x32x16x2 (MODE 1, 2: the same), P V 2 x 64x256x16x2
  const double flop = MODE == 3 ? 2.0 * 64 * 256 * 16 * 2 : 36.0 * 64 * 32 * 16 * 2;
  printf("%-36s reuse %d | keys into the SMs %6.2f TB/s | WG0 %6.1f TFLOP/s (median SM) | %.3f ms %s\n", what, reuse,
         bytes / (ms * 1e-3) / 1e12, MODE ? h[sms / 2] * flop * sms / (ms * 1e-3) / 1e12 : 0.0, ms, cudaGetErrorString(e));
  cudaFree(d);
}

int main() {
  const KeyPool k = key_pool();
  for (int reuse : {1, 3}) {
    run<0>("gather alone", k, reuse);
    run<1>("+ S m64n32k16 (WG0)", k, reuse);
    run<2>("+ S as m64n64k16 (WG0, half the q bytes)", k, reuse);
    run<3>("+ P V m64n256k16 MN-major (WG0)", k, reuse);
  }
  // the rate against the bytes in flight per SM (one tile: 36,864 B): what a ring gets when its buffers are
  // held by the products and only some of its stages are in flight (session 11)
  for (int reuse : {1, 3}) {
    run<0, 1>("gather alone, 1 tile in flight", k, reuse);
    run<0, 2>("gather alone, 2 tiles in flight", k, reuse);
    run<0, 3>("gather alone, 3 tiles in flight", k, reuse);
  }
  // the same few tiles in flight with the products beside (session 16): a ring whose lead is 2-3 tiles (the dual
  // kernel's) sees the gather's latency, which 4 tiles in flight hide; does the products' shared-memory traffic
  // lengthen it?
  for (int reuse : {1, 3}) {
    run<1, 2>("+ S m64n32k16, 2 tiles in flight", k, reuse);
    run<2, 2>("+ S as m64n64k16, 2 tiles in flight", k, reuse);
    run<3, 2>("+ P V, 2 tiles in flight", k, reuse);
    run<1, 1>("+ S m64n32k16, 1 tile in flight", k, reuse);
    run<3, 1>("+ P V, 1 tile in flight", k, reuse);
  }
  return 0;
}
