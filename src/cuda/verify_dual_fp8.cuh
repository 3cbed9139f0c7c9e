// verify_dual_fp8.cuh: the pieces of the dual kernel's FP8 form (verify_dual.cuh, Fp8 = true) that its prefix items
// run on e4m3 tiles: the copies of a tile, S = q K^T in e4m3 wgmma, P^T in one e4m3 term, O^T = V^T P^T with V^T from
// registers, and the store of O^T. How they fit into the kernel's roles: verify_dual.cuh's head and design.md.
#pragma once

#include "verify_wgmma.cuh"

namespace kdtree {
namespace dual {

using wg::SmemDesc;
using wg::desc_sw64;
using wg::kKSteps;
using wg::kQSlabBytes;
using wg::kSlabs;
using wg::kTileN;

constexpr int kSlab8Bytes = kTileN * 64;           // 2,048: 64 dims of an e4m3 tile's 32 keys, 64-byte swizzle
constexpr int kTileBytes8 = kSlabs * kSlab8Bytes;  // 18,432: an e4m3 tile of 32 keys
constexpr int kPtRowBytes = 64;                    // a query row of P^T: 32 keys' e4m3 P, then 32 bytes unused
constexpr int kCopierThreads = 128;   // a tile's copies: the producer warpgroup, or (FP8) its score warpgroup

// Copier thread pt's part of e4m3 tile t into the buffer at shared address buf: key pt / 4 (slot: its pool slot id),
// 16-byte chunk pt % 4 of each of its row's 9 slabs of 64 bytes (a warp's copy: 8 keys x 64 contiguous bytes), in the
// 64-byte swizzled K-major layout [slab][key][64 B] (chunk c of key r at c ^ (r / 2 % 4)), zeros past the split end;
// then its arrival on `full` once they have landed. Nothing past the item's last tile.
__device__ __forceinline__ void copy_tile8(uint32_t buf, unsigned long long* full, const Params& prm, const ItemCtx& cx,
                                           int t, int pt, long long slot) {
  static_assert(4 * kTileN == kCopierThreads, "four copier threads a key");
  if (t >= cx.ntiles) return;
  const int kt = pt >> 2, cw = pt & 3;
  const int key = cx.k0 + t * kTileN + kt;
  const unsigned char* src = static_cast<const unsigned char*>(key_ptr8(prm, cx, key, slot)) + 16 * cw;
  const uint32_t dst = buf + kt * 64 + ((cw ^ ((kt >> 1) & 3)) << 4);
#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl) cp_async_16z(dst + sl * kSlab8Bytes, src + sl * 64, key < cx.k1 ? 16 : 0);
  wg::arrive_when_landed(full);
}

// S = q K^T over the e4m3 tile at kv: k32 step j of the tile (slab j / 2, + 32 bytes for an odd step) times q's hi
// term, then the same step times its lo term (bytes 32 j and 576 + 32 j of q's rows, which the prep kernel's q8 rows
// hold as 1,152 bytes: hi, then lo, in the bf16 q's layout); the row's 2^e scales the scores after.
// The order is measured (H100, H16 N9 P131072, one run of tools/ab_variants.sh): each B descriptor twice in a row
// takes 149.6 us, all 18 hi(q) steps before the 18 lo(q) ones 155.6, lo(q) first 160.3; the second form also keeps 18
// B descriptors live across the loop, which spilled. Accuracy: Hopper's e4m3 wgmma adds into its accumulator with
// fewer bits than fp32, so each step into a full-size sum costs some, which shows at large |q| (a row's scores spanning
// ~1e3 in log2 units at |q| ~ 1e3): median relative error over 8 inputs 6.9e-2 in this order, 8.4e-2 with hi(q) first,
// 3.3e-2 with lo(q) first (its small sums added while the accumulator is small); 2.7e-3 / 3.0e-3 / 2.5e-3 at |q| ~ 1
// (these with P in two e4m3 terms; in one, P's rounding sets the error at |q| ~ 1: 1.1e-2).
__device__ __forceinline__ void scores8(float (&sc)[16], uint32_t kv, const SmemDesc& qd) {
  wg::wg_fence();
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    if constexpr (kExpNoScoreMma) {   // profiling aid: one k-step instead of 36
      if (ks > 0) continue;
    }
    const int j = ks >> 1, off = (ks & 1) * kDimQK + 32 * j;   // step j of hi(q), then of lo(q): byte off of q's rows
    const uint64_t da = qd.at((off >> 7) * kQSlabBytes + (off & 127));
    wg::wgmma_m64n32k32_e4m3_ss(sc, da, desc_sw64(kv + (j >> 1) * kSlab8Bytes) + (j & 1) * 2, ks > 0);
  }
  wg::wg_commit();
  wg::wg_wait0();
}

// The k position in P^T (a term's byte of a query row) of a thread's keys 8j + 2c and 8j + 2c + 1 (the next byte): the
// k order of the value fragments (wg::e4m3_vt_fragment), where position 4c + i of a 16-key half holds key
// {2c, 2c+1, 8+2c, 9+2c}[i] (the skinny FP8 kernel's p8_offset; tests/test_fp8_cpu.py checks the two agree).
__host__ __device__ constexpr int p8_pair_pos(int j, int c) { return 16 * (j >> 1) + 4 * c + 2 * (j & 1); }

// The tile's P as 448 P in one e4m3 term into P^T, the B operand of O^T (K-major): query row r's 32 bytes (of its 64)
// in the 64-byte swizzle, in p8_pair_pos order: key groups j - 1 and j (odd j) make one 32-bit word a row. The row sums
// take what is stored, e4m3(448 P) / 448. P <= 1 here (no lazy reference: below 2^-9 / 448 the term is zero). One term
// where q has two: an e4m3 P is off by at most 1/16 of itself, an error the sums share and the keys' many terms average
// (the sm_120 code path quantises P so too).
__device__ __forceinline__ void softmax_p8(float (&sc)[16], const float (&m_use)[2], const float (&lfac)[2],
                                           float (&l_own)[2], uint32_t p, int wrow, int g, int c) {
  uint32_t w[2];                    // [half]: the word of key groups j - 1, j
  float rounding[2] = {0.f, 0.f};   // what the stored term adds to the sums beyond P
  softmax_p_pairs<kTileN / 8>(sc, m_use, lfac, l_own, [&](int j, int half, float p0, float p1) {
    uint32_t h;
    const float2 stored = round_e4m3x2(448.f * p0, 448.f * p1, h);
    rounding[half] += (stored.x + stored.y) * (1.f / 448.f) - (p0 + p1);
    if ((j & 1) == 0) {
      w[half] = h & 0xffffu;
    } else {
      static_assert(p8_pair_pos(1, 0) == p8_pair_pos(0, 0) + 2 && p8_pair_pos(3, 3) == p8_pair_pos(2, 3) + 2,
                    "an odd group's keys follow the even one's in its word");
      const int r = wrow + g + 8 * half, pos = p8_pair_pos(j - 1, c);   // the word's first byte
      st_shared_u32(p + r * kPtRowBytes + (((pos >> 4) ^ ((r >> 1) & 3)) << 4) + (pos & 15), w[half] | (h << 16));
    }
  });
  l_own[0] += rounding[0];
  l_own[1] += rounding[1];
}

// O^T (value warpgroup v's 256 dims as 4 blocks of 64 x the 64 rows; block mb: o[32 mb ..], accumulator rows g / g + 8
// of warp w are dims 64 mb + 16 w + 2g / + 1) times the factors of its columns, the rows 8q + 2c, + 1 (q < 8), skipped
// when the warp's factors are all 1.
__device__ __forceinline__ void rescale_o_t(float (&o)[128], const float2 (&a)[8]) {
  bool one = true;
#pragma unroll
  for (int q = 0; q < 8; ++q) one = one && a[q].x == 1.f && a[q].y == 1.f;
  if (__all_sync(0xffffffffu, one)) return;
#pragma unroll
  for (int mb = 0; mb < 4; ++mb)
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      o[32 * mb + 4 * q] *= a[q].x;
      o[32 * mb + 4 * q + 1] *= a[q].y;
      o[32 * mb + 4 * q + 2] *= a[q].x;
      o[32 * mb + 4 * q + 3] *= a[q].y;
    }
}
// A value per O^T column of the thread (rows 8q + 2c, + 1) from a 64-row array in shared memory (alpha, row_l).
__device__ __forceinline__ void load_row_pairs(float2 (&a)[8], const float* rows, int c) {
#pragma unroll
  for (int q = 0; q < 8; ++q) a[q] = *reinterpret_cast<const float2*>(&rows[8 * q + 2 * c]);
}

// O^T += V^T P^T over the e4m3 tile at kv, value warpgroup v: block mb's A fragment by one ldmatrix.x4.trans of the 32
// keys x warp w's 16 bytes of slab 4v + mb (lane: key 8 (lane / 8) + lane % 8) and wg::e4m3_vt_fragment; B = P^T (pd).
__device__ __forceinline__ void values8(float (&o)[128], uint32_t kv, uint64_t pd, int v, int w, int lane) {
  const int key = lane;   // ldmatrix: lane l gives row l % 8 of matrix l / 8, matrix mi = keys 8 mi ..
  const uint32_t row = kv + 4 * v * kSlab8Bytes + key * 64 + ((w ^ ((key >> 1) & 3)) << 4);
  uint32_t a[4][4];
#pragma unroll
  for (int mb = 0; mb < 4; ++mb) {
    uint32_t m[4];
    ldmatrix_x4_trans(m, row + mb * kSlab8Bytes);
    wg::e4m3_vt_fragment(m, a[mb]);
  }
  wg::wg_fence();
#pragma unroll
  for (int mb = 0; mb < 4; ++mb) {
    if constexpr (kExpNoPvMma) continue;   // profiling aid: skip O^T += V^T P^T
    wg::wgmma_m64n64k32_e4m3_rs(&o[32 * mb], a[mb], pd);
  }
  wg::wg_commit();
  wg::wg_wait0();
}

// End of a prefix item, value side: O^T times `scale` (v_scale / 448) over the rows' sums into the stage as bf16 (dims
// 2g, 2g + 1 of a warp's 16 at one row: a 4-byte store), then out as wg::store_o_rows_staged does.
__device__ __forceinline__ void store_o_t_rows_staged(const Params& prm, const ItemCtx& cx, int w, int lane, int v,
                                                      const float (&o)[128], const float* row_l, float scale,
                                                      uint32_t stage, int bar_id, int bar_count) {
  const int g = lane >> 2, c = lane & 3;
  float2 inv[8];
  load_row_pairs(inv, row_l, c);
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    inv[q].x = inv[q].x > 0.f ? scale / inv[q].x : 0.f;
    inv[q].y = inv[q].y > 0.f ? scale / inv[q].y : 0.f;
  }
#pragma unroll
  for (int mb = 0; mb < 4; ++mb) {
    const int dim = 256 * v + 64 * mb + 16 * w + 2 * g;
#pragma unroll
    for (int q = 0; q < 8; ++q)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int r = 8 * q + 2 * c + u;
        const float f = u ? inv[q].y : inv[q].x;
        st_shared_u32(stage_chunk(stage, r, dim >> 3) + ((dim & 7) << 1),
                      pack_bf16(o[32 * mb + 4 * q + u] * f, o[32 * mb + 4 * q + 2 + u] * f));
      }
  }
  wg::copy_staged_rows_out(prm, cx, 16 * w, lane, v, stage, bar_id, bar_count);
}

}  // namespace dual
}  // namespace kdtree
