// q_split_rate.cu: how fast an SM splits q into its two e4m3 terms, hi + lo, in three forms, with nothing else to do:
// - cvt: the prep kernel's (split_e4m3x2, verify_ptx.cuh): hi = e4m3(x) by cvt, back to f16x2 and f32,
//   lo = e4m3(x - hi) by cvt; three conversions and two f16 -> f32 widenings a pair;
// - bits: no conversion instruction. hi is x truncated to e4m3's grid, read from the bits of x * 2^-120 (whose
//   exponent field is then e4m3's, bits 26-20 its exponent and mantissa, e4m3's subnormals included as f32
//   subnormals); lo = x - hi (exact) the same way. For a bf16 x, lo has at most 4 significant bits, so hi + lo = x
//   exactly unless lo falls below e4m3's normal range (there the error is below 2^-9, against 2^-10 rounded);
// - bits + cvt: hi from the bits, lo by one cvt a pair.
// Each thread splits 16 values an iteration (bf16 pairs built from a word and the loop counter, so that nothing is
// hoisted), 8 blocks of 256 threads an SM. Prints values split a clock an SM at the GPU's top clock, the loop alone
// beside them, and a check of every bf16 value in e4m3's range through all three forms.
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Isrc/cuda tools/q_split_rate.cu -o /tmp/q_split_rate
//   /tmp/q_split_rate
#include <cstdio>
#include <cstring>

#include <cuda_runtime.h>

#include "verify_ptx.cuh"

using kdtree::cvt_e4m3x2;
using kdtree::e4m3x2_to_f16x2;
using kdtree::f16x2_to_float2;
using kdtree::split_e4m3x2;

enum Form { kCvt, kBits, kBitsCvt, kLoop };

// An e4m3 value's bits in byte 3 of the result, from the bits u of (that value) * 2^-120 (bits 27-30 are zero there).
__device__ __forceinline__ uint32_t e4m3_in_byte3(uint32_t u) { return (u << 4) | (u & 0x80000000u); }
// Bytes 3 of four words into one word, word 0's lowest.
__device__ __forceinline__ uint32_t pack_byte3(const uint32_t (&w)[4]) {
  return __byte_perm(__byte_perm(w[0], w[1], 0x7373), __byte_perm(w[2], w[3], 0x7373), 0x5410);
}

template <Form F>
__device__ __forceinline__ void split4(const float (&x)[4], uint32_t& hi, uint32_t& lo) {
  if constexpr (F == kCvt) {
    uint32_t h01, l01, h23, l23;
    split_e4m3x2(x[0], x[1], h01, l01);
    split_e4m3x2(x[2], x[3], h23, l23);
    hi = h01 | (h23 << 16);
    lo = l01 | (l23 << 16);
  } else {
    uint32_t wh[4], wl[4];
    float r[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t u = __float_as_uint(x[k] * 0x1p-120f) & 0xfff00000u;   // truncated to e4m3's grid
      r[k] = x[k] - __uint_as_float(u) * 0x1p120f;
      wh[k] = e4m3_in_byte3(u);
      wl[k] = e4m3_in_byte3(__float_as_uint(r[k] * 0x1p-120f) & 0xfff00000u);
    }
    hi = pack_byte3(wh);
    lo = F == kBits ? pack_byte3(wl) : cvt_e4m3x2(r[0], r[1]) | (cvt_e4m3x2(r[2], r[3]) << 16);
  }
}

template <Form F>
__global__ void split_loop(const uint32_t* in, uint32_t* out, int iters) {
  uint32_t w[4], acc = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = in[(threadIdx.x * 4 + j) & 1023];
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {   // four independent groups of four values
      const uint32_t a = w[c] ^ (uint32_t)it, b = w[(c + 1) & 3] + (uint32_t)it;
      const float x[4] = {__uint_as_float(a << 16), __uint_as_float(a & 0xffff0000u), __uint_as_float(b << 16),
                          __uint_as_float(b & 0xffff0000u)};
      uint32_t hi = a, lo = b;
      if constexpr (F != kLoop) split4<F>(x, hi, lo);
      acc += hi ^ lo;
    }
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

__device__ float e4m3_value(uint32_t word, int k) {
  const float2 f = f16x2_to_float2(e4m3x2_to_f16x2((word >> (16 * (k / 2))) & 0xffffu));
  return k % 2 ? f.y : f.x;
}
// Every bf16 pattern v with |v| <= 448, as v, -v, v / 2 and v / 4: bad[0] counts values whose hi + lo misses x by more
// than the form's bound, bad[1] values of magnitude >= 1/4 that the bit forms do not split exactly.
__global__ void check(int* bad) {
  const uint32_t bits = blockIdx.x * blockDim.x + threadIdx.x;
  const float v = __uint_as_float(bits << 16);
  if (bits >= 65536 || !(fabsf(v) <= 448.f)) return;
  const float x[4] = {v, -v, v * 0.5f, v * 0.25f};
  uint32_t h[3], l[3];
  split4<kCvt>(x, h[0], l[0]);
  split4<kBits>(x, h[1], l[1]);
  split4<kBitsCvt>(x, h[2], l[2]);
  for (int k = 0; k < 4; ++k)
    for (int f = 0; f < 3; ++f) {
      const float err = fabsf(e4m3_value(h[f], k) + e4m3_value(l[f], k) - x[k]);
      if (err > (f == kBits ? 0x1p-9f : 0x1p-10f)) atomicAdd(&bad[0], 1);
      if (f != kCvt && err != 0.f && fabsf(x[k]) >= 0.25f) atomicAdd(&bad[1], 1);
    }
}

template <Form F>
float time_ms(const uint32_t* in, uint32_t* out, int blocks, int iters) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  split_loop<F><<<blocks, 256>>>(in, out, iters);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  return ms;
}

int main() {
  int dev = 0, sms = 0, khz = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev);
  const int blocks = 8 * sms, iters = 4096;
  uint32_t *in, *out;
  int* bad;
  cudaMalloc(&in, 4096 * 4);
  cudaMalloc(&out, (size_t)blocks * 256 * 4);
  cudaMalloc(&bad, 8);
  cudaMemset(in, 0x3c, 4096 * 4);
  cudaMemset(bad, 0, 8);
  check<<<256, 256>>>(bad);
  int hb[2];
  cudaMemcpy(hb, bad, 8, cudaMemcpyDeviceToHost);
  printf("check: %d values beyond their form's bound, %d of magnitude >= 1/4 not split exactly by the bit forms\n",
         hb[0], hb[1]);
  const double values = (double)blocks * 256 * iters * 16, clk = khz * 1e3;
  const char* names[4] = {"cvt (the prep kernel's)", "bits", "bits + cvt for lo", "loop alone"};
  for (int round = 0; round < 2; ++round)
    for (int f = 0; f < 4; ++f) {
      const float ms = f == 0   ? time_ms<kCvt>(in, out, blocks, iters)
                       : f == 1 ? time_ms<kBits>(in, out, blocks, iters)
                       : f == 2 ? time_ms<kBitsCvt>(in, out, blocks, iters)
                                : time_ms<kLoop>(in, out, blocks, iters);
      printf("%-24s %8.3f ms  %6.2f values a clock an SM at %.2f GHz\n", names[f], ms,
             values / sms / (ms * 1e-3 * clk), clk * 1e-9);
    }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
