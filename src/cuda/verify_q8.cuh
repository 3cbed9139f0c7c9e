// verify_q8.cuh: the queries of an FP8 call in the form its split kernel reads (verify_mma_fp8.cuh), written once per
// call by the prep kernel's q blocks (verify_plan.cuh): each row (t, h) of q, 576 values, split into two e4m3 terms with
// a power-of-two scale,
//   q = 2^e (hi + lo),   hi = e4m3(q / 2^e),   lo = e4m3(q / 2^e - hi),   amax |q| / 2^e in (224, 448].
// hi alone is SGLang's e4m3 cast of q wherever q / 2^e and q agree in e4m3's normal range (a power of two changes no
// mantissa), with its ~3% relative error per element; hi + lo leaves ~2^-8 relative (bf16's precision), or 2^-10
// absolute where lo is subnormal (2^-19 of the row's largest value). A row's scores are hi . k + lo . k, times 2^e.
// Workspace: Params::q8 [T * H][2][576] bytes (hi, then lo), Params::q_scale [T * H] floats (2^e).
#pragma once

#include <string.h>

#include "verify_common.cuh"
#include "verify_ptx.cuh"

namespace kdtree {

constexpr int kQ8RowBytes = 2 * kDimQK;       // hi and lo of one row
constexpr int kQ8Chunks = kDimQK / 16;        // 36 chunks of 16 dims a row
constexpr int kQ8RowsPerBlock = 8;            // one warp a row, 256 threads a block (the prep kernel's)

// The power of two e with amax / 2^e in (224, 448] (e4m3's top binade), or 0 for amax 0; -126 for a subnormal amax, so
// that 2^-e stays a normal float. Exact: from amax's exponent and mantissa bits (448 = 1.75 * 2^8), never a rounded log.
__host__ __device__ __forceinline__ int q8_row_exponent(float amax) {
  uint32_t bits;
  memcpy(&bits, &amax, sizeof(bits));
  const int biased = (int)((bits >> 23) & 0xffu);
  if (!(amax > 0.f)) return 0;
  if (biased == 0) return -126;
  return biased - 135 + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0);
}

// Global row `row` = t * H + h of q, by one warp: hi and lo into Params::q8, 2^e into Params::q_scale.
__device__ __forceinline__ void quantize_q_row(const Params& prm, int row, int lane) {
  const int t = row / prm.heads, h = row - t * prm.heads;
  const __nv_bfloat16* nope = prm.q_nope + (long long)t * prm.q_nope_st + (long long)h * prm.q_nope_sh;
  const __nv_bfloat16* pe = prm.q_pe + (long long)t * prm.q_pe_st + (long long)h * prm.q_pe_sh;
  // lane's chunks: lane and lane + 32 (< 36): 16 dims each, two 16-byte loads
  float v[2][16];
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int ch = lane + 32 * i;
    if (ch < kQ8Chunks) {
      const int d = ch * 16;
      const __nv_bfloat16* src = d < kDimNope ? nope + d : pe + (d - kDimNope);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const uint4 raw = *reinterpret_cast<const uint4*>(src + 8 * u);
        const __nv_bfloat162* p2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 f = __bfloat1622float2(p2[k]);
          v[i][8 * u + 2 * k] = f.x;
          v[i][8 * u + 2 * k + 1] = f.y;
          amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const int e = q8_row_exponent(amax);
  const float inv = __int_as_float((127 - e) << 23);   // 2^-e, exact
  uint8_t* const out = prm.q8 + (long long)row * kQ8RowBytes;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int ch = lane + 32 * i;
    if (ch < kQ8Chunks) {
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float x[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) x[k] = v[i][4 * w + k] * inv;
        uint32_t h01, l01, h23, l23;
        split_e4m3x2(x[0], x[1], h01, l01);
        split_e4m3x2(x[2], x[3], h23, l23);
        hi[w] = h01 | (h23 << 16);
        lo[w] = l01 | (l23 << 16);
      }
      *reinterpret_cast<uint4*>(out + ch * 16) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
      *reinterpret_cast<uint4*>(out + kDimQK + ch * 16) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  }
  if (lane == 0) prm.q_scale[row] = __int_as_float((127 + e) << 23);
}

}  // namespace kdtree
