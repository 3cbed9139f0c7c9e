// Microbenchmark: does the S chain of the wgmma split kernel slow down when the other warpgroups of
// the SM gather keys (cp.async) or run P V (m64n256k16, B MN-major) at the same time?
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_contention.cu -o /tmp/micro_contention
// 1 CTA per SM, 3 warpgroups. WG0 runs `iters` rounds of 36 wgmma m64n32k16 (SS, one accumulator, the
// kernel's descriptors) and reports clocks per wgmma; WG1/WG2 do MODE: 0 nothing, 1 a continuous cp.async
// gather of random 1152-byte rows into a 4-stage ring (9 copies per thread per 32-key tile, as the
// kernel), 2 a continuous P V loop (2 wgmma m64n256k16, B MN-major), 3 both, one after the other; + 4: S with q
// from registers (wgmma RS) instead of shared memory; + 8: S as 18 m64n64k16 (the same FLOPs, half the q bytes),
// reported per m64n32k16 equivalent.
#include <cstdio>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
#include <cuda_runtime.h>
#include "micro_split.cuh"

template <int MODE>
__global__ void __launch_bounds__(384, 1) bench(const unsigned char* pool, const int* slots, int nslots, long long* out,
                                                int iters, volatile int* stop) {
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char* sm = split_smem(raw, 384);
  const uint32_t qb = smem_u32(sm), kb = qb + kQ, pb = kb + kRing;
  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  __syncthreads();
  __shared__ int done;
  __shared__ int stop_slots[6];   // wg_flag's per-warpgroup answers
  if (threadIdx.x == 0) done = 0;
  __syncthreads();
  if (wg == 0) {
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    uint32_t qa[9][4];   // MODE & 4: q from registers (RS)
#pragma unroll
    for (int i = 0; i < 9; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) qa[i][j] = 0x3c003c00u ^ (uint32_t)(i * 4 + j + t);
    float s64[32];   // MODE & 8: the same FLOPs as m64n64k16 (half the q bytes)
#pragma unroll
    for (int i = 0; i < 32; ++i) s64[i] = 0.f;
    const long long t0 = clock64();
    for (int r = 0; r < iters; ++r) {
      if (MODE & 4) s_round_n32_rs(s, qa, kb + (r & 3) * kTile);
      else if (MODE & 8) s_round_n64(s64, qb, kb + (r & 1) * 2 * kTile);
      else s_round_n32(s, qb, kb + (r & 3) * kTile);
    }
    const long long t1 = clock64();
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] += s64[i] + s64[i + 16];
    if (t == 0) { out[blockIdx.x] = t1 - t0; done = 1; }
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) acc += s[i];
    if (acc == 1234.f) out[0] = 0;
    return;
  }
  const int vt = threadIdx.x - 128;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  unsigned seed = blockIdx.x * 977 + vt / 8;
  for (int r = 0; !wg_flag(&done, stop_slots, wg, r) && r < 1000000; ++r) {   // warpgroup-uniform exit
    if (MODE & 1) {   // one 32-key tile
      seed = seed * 1664525u + 1013904223u;
      gather_tile_async(pool, slots[seed % nslots], vt, kb + (r & 3) * kTile);
    }
    if (MODE & 2) pv_round(o, pb, kb + (r & 3) * kTile + (4 * (vt >> 7)) * 4096);
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) acc += o[i];
  if (acc == 1234.f) out[1] = 0;
}

template <int MODE>
void run(const char* what, const unsigned char* pool, const int* slots, int nslots, int sms) {
  long long* d; int* stop;
  cudaMalloc(&d, sms * 8); cudaMalloc(&stop, 4);
  const int smem = kQ + kRing + kP + 1024;
  cudaFuncSetAttribute(bench<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  bench<MODE><<<sms, 384, smem>>>(pool, slots, nslots, d, 20, stop);
  bench<MODE><<<sms, 384, smem>>>(pool, slots, nslots, d, 200, stop);
  cudaError_t e = cudaDeviceSynchronize();
  std::vector<long long> h(sms);
  cudaMemcpy(h.data(), d, sms * 8, cudaMemcpyDeviceToHost);
  std::sort(h.begin(), h.end());
  printf("%-34s | S wgmma m64n32k16 (or its FLOPs): %6.1f clk each (median SM) %s\n", what, h[sms / 2] / (200.0 * 36), cudaGetErrorString(e));
  cudaFree(d); cudaFree(stop);
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int nrows = 1 << 21;
  unsigned char* pool;
  cudaMalloc(&pool, (size_t)nrows * 1152);
  cudaMemset(pool, 0, (size_t)nrows * 1152);   // the data does not matter here
  int* slots = device_slots(shuffled_slots(nrows), nrows);
  run<0>("alone", pool, slots, nrows, sms);
  run<1>("+ cp.async gather (WG1, WG2)", pool, slots, nrows, sms);
  run<2>("+ P V m64n256k16 MN-major (WG1, WG2)", pool, slots, nrows, sms);
  run<3>("+ gather and P V", pool, slots, nrows, sms);
  // q from registers (wgmma RS; session 11): does S's chain beside P V speed up without its q reads?
  run<4>("S RS, alone", pool, slots, nrows, sms);
  run<5>("S RS, + cp.async gather", pool, slots, nrows, sms);
  run<6>("S RS, + P V m64n256k16 MN-major", pool, slots, nrows, sms);
  run<7>("S RS, + gather and P V", pool, slots, nrows, sms);
  run<8>("S as n64 (SS), alone", pool, slots, nrows, sms);
  run<10>("S as n64 (SS), + P V", pool, slots, nrows, sms);
  return 0;
}
