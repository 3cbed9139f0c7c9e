// verify_mma_fp8.cuh: the split-K pass over an FP8 (e4m3) KV pool: the mma.sync pipeline of verify_mma.cuh with its
// prefix keys in e4m3, for sm_120 (the block-scaled e4m3 mma.sync, twice the bf16 rate there) and, through the plain
// e4m3 mma.sync with the same fragments, for sm_90 (mma_e4m3 in verify_ptx.cuh is the one primitive that differs).
//
// The plan gives a call's drafts a split of their own (Params::drafts_apart), so a work item is either
// - a prefix item: keys from the e4m3 pool, scores sm_scale * k_scale * q . k, values v_scale * v (SGLang's
//   k_descale / v_descale), computed here in e4m3; or
// - a draft item: the N draft rows in bf16 from k_new, unscaled, computed by the bf16 item of verify_mma.cuh
//   (mma_item) in the same shared memory, so that the drafts are as exact as in the bf16 kernel.
// The combine merges the two kinds' partials like any other splits.
//
// Numerics of a prefix item (each chosen to be at least as accurate as SGLang's Triton kernel on the same cache, which
// casts q to e4m3 unscaled and P * 448 to e4m3):
// - q is split into two e4m3 terms with a power-of-two scale per row: q = 2^e (hi + lo / 16), amax |q| / 2^e in
//   (224, 448]. hi alone is SGLang's e4m3 cast of q (exactly, where q is in e4m3's normal range) and carries its ~3%
//   error into the scores; hi + lo / 16 leaves ~2^-8, bf16's precision. S = hi . k + (lo . k) / 16 costs two e4m3
//   products, the time of one bf16 product at the block-scaled rate. hi lives in registers (72 a thread), lo in
//   shared memory.
// - P = 448 * 2^(s - m) with the exact running maximum m (no lazy rescale), e4m3: the same range as SGLang's P * 448.
// - The row sums add the e4m3 values of P (dequantised, in f16x2), not the float ones, so that the normalisation
//   divides by exactly what weighted the values: a row dominated by one key comes out as that key's value.
// Measured against a float64 reference on the dequantised cache (CPU model, random q, k ~ N(0, 1), H16 N9): relative
// L2 error 1.3-1.5e-2 here against SGLang's 3.5-4.1e-2 at prefixes 64..4096.
//
// Layout: 11 warps (3 score, 8 value) as in the bf16 kernel; 32-key tiles, kStages8 deep; a key row is 576 bytes
// padded to 592 (37 16-byte units: ldmatrix rows land in distinct bank groups). Fragments of the e4m3 m16n8k32:
// - S: A = q (row-major bytes), B = keys (their rows are k-major already): one ldmatrix.x4 (b16) of 8 keys x 32 bytes
//   gives two key groups' b0 / b1.
// - P V: A = P, written by the score warps straight from their accumulators in the order the A fragment wants: k
//   position 4c + i of a 16-key half holds key {2c, 2c + 1, 8 + 2c, 9 + 2c}[i], the keys a score thread holds.
//   B = values, which need 4 keys of one value column per register: ldmatrix.x4.trans (b16) of keys 0-7, 8-15, 16-23,
//   24-31 at 16 value bytes gives keys (2c, 2c + 1) at columns (2g, 2g + 1) in each register; two byte permutes make
//   keys (2c, 2c + 1, 8 + 2c, 9 + 2c) at column 2g (one mma) and 2g + 1 (another): each thread's outputs come out as
//   4 adjacent columns 4c .. 4c + 3 of a 16-column segment.
#pragma once

#include "verify_mma.cuh"
#include "verify_q8.cuh"

namespace kdtree {

constexpr int kStages8 = 3;                   // e4m3 key buffers (3 x 18.5 KB beside lo(q) fit sm_120's 99 KB)
constexpr int kKeyBytes8 = kDimQK;            // 576: one bulk copy per key
constexpr int kKSteps8 = kDimQK / 32;         // 18 k32 steps over the 576 dims
// hi(q) of k-steps [0, kQHiRegSteps) lives in the score warps' registers (4 a step), of the last steps in shared
// memory beside lo(q): with all 18 in registers the kernel spills on sm_120 (168 registers a thread: 11 warps share a
// sub-partition's 16,384 three to one). The sm_90 stand-in, whose e4m3 mma ptxas emulates with f16 operands in
// registers, still spills a few words at any split (tests/test_ptxas.py bounds it).
constexpr int kQHiRegSteps = 14;
constexpr int kQHiSmemBytes = (kKSteps8 - kQHiRegSteps) * 32;   // 128
constexpr int kQPitch8 = kDimQK + kQHiSmemBytes + 16;           // a row of lo(q), then hi(q)'s tail: 720 B
constexpr float kLog2PMax = 8.8073549220576f;   // log2(448): P = 448 * 2^(s - m)
static_assert(kStages8 <= kMaxStages, "the e4m3 ring uses the bf16 kernel's named barrier ids");
static_assert(kQPitch8 % 16 == 0 && (kQPitch8 / 16) % 2 == 1, "q rows 16 B aligned, an odd number of 16 B apart");

// Shared memory of the FP8 kernel: the draft items' bf16 layout (the members mma_item reads, as SharedStorage<2> has
// them) and the prefix items' e4m3 layout share their bytes; barriers, rescale factors and row sums are common.
struct SharedStorageFp8 {
  union {
    struct {
      __nv_bfloat16 kv[2][kTileN][kKvPitch];
      __nv_bfloat16 q_tail[kBlockM][kQSmemPitch];
      __nv_bfloat16 p[2][kBlockM][kTileN];
    };
    struct {
      uint8_t kv8[kStages8][kTileN][kKeyPitch8];
      uint8_t q8[kBlockM][kQPitch8];              // per row: lo(q), then hi(q) of dims [kQHiRegSteps * 32, 576)
      uint8_t p8[kStages8][kBlockM][kTileN];      // P (e4m3) in A-fragment key order, 16-byte halves swizzled
    };
  };
  float alpha[kStages8][kBlockM];
  float rscale[kBlockM];   // prefix items: the rows' score factors (log2 units), scale_log2 * k_scale * 2^e
  float row_m[kBlockM];
  float row_l[kBlockM];
  unsigned long long full[kStages8];
  int item, total;
  KDTREE_MMA_TRACE_STORAGE   // TRACE builds: the stamps of the draft items (mma_item)
};
static_assert(kExpTrace || sizeof(SharedStorageFp8) <= 101376, "the FP8 kernel must fit sm_120's 99 KB per block");

// Byte offset of P row `row`, 16-byte half `half`, in a P tile: halves swapped on rows 4-7 of every 8, so that
// ldmatrix's 8 rows of a half and the score warps' 32-bit stores fall in distinct banks.
__device__ __forceinline__ int p8_off(int row, int half) { return row * kTileN + ((half ^ ((row >> 2) & 1)) << 4); }

// The value warps fill buffer b with e4m3 tile t (as issue_tile: 4 keys a value warp, 576-byte bulk copies).
__device__ __forceinline__ void issue_tile8(SharedStorageFp8& sm, const Params& prm, const ItemCtx& cx, int t, int b,
                                            int vw, int lane, long long slot) {
  if (vw == 0 && lane == 0) mbar_arrive_expect_tx(&sm.full[b], kTileN * kKeyBytes8);
  if (lane < kKeysPerWarp) {
    fence_proxy_async();   // earlier generic-proxy accesses of this buffer ordered before the async writes
    const int k = vw * kKeysPerWarp + lane;
    bulk_copy_g2s(&sm.kv8[b][k][0], key_ptr8(prm, cx, cx.k0 + t * kTileN + k, slot), kKeyBytes8, &sm.full[b]);
  }
}

// The context of the block's current item (its index `item`) computed afresh: for the
// epilogue, so that its fields need not stay live in registers across the item's loops (the sm_90 stand-in spilled).
__device__ __forceinline__ ItemCtx item_ctx_again(const Params& prm, int item) {
  return item_ctx<kBlockM, kTileN, true>(prm, item);
}

// One prefix item of the FP8 pass (keys [k0, k1) all in the e4m3 pool), by every thread of the block; as mma_item.
__device__ __forceinline__ void mma_item_fp8(SharedStorageFp8& sm, const Params& prm, const ItemCtx& cx, int item,
                                             uint32_t& phase_bits) {
  using Shape = MmaWide;
  constexpr int kStages = kStages8;
  constexpr int kRowBlocks = Shape::kRowBlocks, kScoreWarps = Shape::kScoreWarps, kThreads = Shape::kThreads;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int c = lane & 3;
  const int vw = warp - kScoreWarps;
  const bool issuer = vw >= 0 && lane < kKeysPerWarp;
  const int my_key = vw * kKeysPerWarp + lane;
  const int H = prm.heads;

  // ---- prologue: tiles 0 .. kStages-1 on their way (value warps); q split and quantised (score warps) ----
  long long next_slot = start_key_ring<kStages>(prm, cx, vw, issuer, my_key, [&](int t, long long slot) {
    issue_tile8(sm, prm, cx, t, t, vw, lane, slot);
  });

  // lo(q) and the last steps of hi(q) of the item's rows (the prep kernel's, verify_q8.cuh) into shared memory; the
  // rest of hi goes to the score warps' registers
  const int wrow = warp * 16;                        // score warps: first tile row of this warp
  constexpr int kHiChunks = kQHiSmemBytes / 16;
  for (int i = tid; i < kBlockM * (kQ8Chunks + kHiChunks); i += kThreads) {   // all copies in flight at once
    const int r = i / (kQ8Chunks + kHiChunks), ch = i - r * (kQ8Chunks + kHiChunks);
    const long long grow = (long long)cx.rp.qo_begin * H + cx.row0 + r;
    const bool lo = ch < kQ8Chunks;
    const void* src = r < cx.rows ? static_cast<const void*>(prm.q8 + grow * kQ8RowBytes +
                                                             (lo ? kDimQK + ch * 16 : kQHiRegSteps * 32 + (ch - kQ8Chunks) * 16))
                                  : static_cast<const void*>(prm.zero_row);
    cp_async_16z(smem_u32(&sm.q8[r][ch * 16]), src, r < cx.rows ? 16 : 0);
  }
  cp_async_wait_all();   // this thread's lo(q) copies (the key rows travel as bulk copies, not cp.async)
  __syncthreads();   // lo(q) and hi(q)'s tail landed for every row

  if (warp < kScoreWarps) {
    // =========================== score warps ===========================
    uint32_t qa[kQHiRegSteps][4];   // hi(q) as e4m3 A fragments
    {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wrow + g + half * 8;
        const bool valid = r < cx.rows;   // padding rows: q = 0
        const long long grow = (long long)cx.rp.qo_begin * H + cx.row0 + r;   // global row t * H + h
        const uint8_t* hi = prm.q8 + grow * kQ8RowBytes + 4 * c;
        if (c == 0) sm.rscale[r] = valid ? prm.scale_log2 * prm.k_scale * prm.q_scale[grow] : 0.f;
#pragma unroll
        for (int ks = 0; ks < kQHiRegSteps; ++ks)
#pragma unroll
          for (int j = 0; j < 2; ++j)   // a0 / a1: dims 32 ks + 4c .. (rows g, g + 8); a2 / a3: + 16
            qa[ks][2 * j + half] = valid ? *reinterpret_cast<const uint32_t*>(hi + ks * 32 + j * 16) : 0u;
      }
    }
    __syncwarp();   // the warp's rscale stored
    const bool active = wrow < cx.rows;
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};
    // ldmatrix lane addresses: keys: matrix mi = lane / 8 -> keys (mi / 2) * 8 .., bytes + (mi % 2) * 16 (a key
    // group's b0, b1); lo(q): rows (mi % 2) * 8 .., bytes + (mi / 2) * 16 (a0 .. a3)
    const int key_lane = ((lane >> 4) << 3) + (lane & 7), key_byte = ((lane >> 3) & 1) * 16;
    const uint8_t* qlbase = &sm.q8[wrow + (lane & 7) + ((lane >> 3) & 1) * 8][(lane >> 4) * 16];

    for (int it = 0; it < cx.ntiles; ++it) {
      const int b = it % kStages;
      mbar_wait_buffer(sm.full, phase_bits, b);
      if (it >= kStages) bar_sync(kBarPEmpty + b, kThreads);   // P / alpha[b] of tile it - kStages consumed
      if (active) {
        float acc[4][4] = {};
        const uint8_t* kbase = &sm.kv8[b][key_lane][key_byte];
#pragma unroll
        for (int ks = 0; ks < kKSteps8; ++ks) {
          uint32_t kb[2][4], al[4], ah[4];
          ldmatrix_x4(kb[0], kbase + ks * 32);                    // keys 0-15: groups 0, 1
          ldmatrix_x4(kb[1], kbase + 16 * kKeyPitch8 + ks * 32);   // keys 16-31: groups 2, 3
          ldmatrix_x4(al, qlbase + ks * 32);
          if (ks >= kQHiRegSteps) ldmatrix_x4(ah, qlbase + kDimQK + (ks - kQHiRegSteps) * 32);
          const uint32_t(&a)[4] = ks < kQHiRegSteps ? qa[ks] : ah;
#pragma unroll
          for (int j = 0; j < 4; ++j) {   // hi then lo into each group's accumulator
            mma_e4m3(acc[j], a, kb[j >> 1][2 * (j & 1)], kb[j >> 1][2 * (j & 1) + 1]);
            mma_e4m3(acc[j], al, kb[j >> 1][2 * (j & 1)], kb[j >> 1][2 * (j & 1) + 1]);
          }
        }
        // scores in log2 units; keys past the split end (zero rows) masked. The rows' factors come from shared memory
        // every tile: held in registers across the loop they were spilled on the sm_90 stand-in.
        const float rs[2] = {sm.rscale[wrow + g], sm.rscale[wrow + g + 8]};
        const int key0 = cx.k0 + it * kTileN;
        const bool plain = key0 + kTileN <= cx.k1;
        float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float s = acc[j][e] * rs[e >> 1];
            acc[j][e] = plain || key0 + 8 * j + 2 * c + (e & 1) < cx.k1 ? s : -INFINITY;
            tmax[e >> 1] = fmaxf(tmax[e >> 1], acc[j][e]);
          }
        float alpha[2], m_use[2];
        softmax_advance(tmax, m_run, m_use, alpha);
        // P = 448 * 2^(s - m) in e4m3, stored in A-fragment order; the rows' sums of the e4m3 values
        uint8_t* const pt = &sm.p8[b][0][0];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float mo = m_use[half] - kLog2PMax;
          __half2 psum = __float2half2_rn(0.f);
#pragma unroll
          for (int kh = 0; kh < 2; ++kh) {   // keys 16 kh .. 16 kh + 15: groups 2 kh, 2 kh + 1
            const uint32_t w0 = cvt_e4m3x2(fast_exp2(acc[2 * kh][2 * half] - mo), fast_exp2(acc[2 * kh][2 * half + 1] - mo));
            const uint32_t w1 =
                cvt_e4m3x2(fast_exp2(acc[2 * kh + 1][2 * half] - mo), fast_exp2(acc[2 * kh + 1][2 * half + 1] - mo));
            psum = __hadd2(psum, __hadd2(as_half2(e4m3x2_to_f16x2(w0)), as_half2(e4m3x2_to_f16x2(w1))));
            const int row = wrow + g + half * 8;
            *reinterpret_cast<uint32_t*>(pt + p8_off(row, kh) + 4 * c) = w0 | (w1 << 16);
          }
          const float2 ps = __half22float2(psum);
          l_run[half] = l_run[half] * alpha[half] + (ps.x + ps.y);
        }
        if (c == 0) {
          sm.alpha[b][wrow + g] = alpha[0];
          sm.alpha[b][wrow + g + 8] = alpha[1];
        }
      }
      bar_arrive(kBarPFull + b, kThreads);   // P / alpha[b] published; run ahead to the next tile
    }
    // the partial log-sum-exp in true units: the sums are of 448 * 2^(s - m)
    const float m_true[2] = {m_run[0] - kLog2PMax, m_run[1] - kLog2PMax};
    const ItemCtx ce = item_ctx_again(prm, item);
    finish_rows(prm, ce, H, wrow, g, c, m_true, l_run, sm.row_m, sm.row_l, [] { bar_arrive(kBarBlock, kThreads); });
  } else {
    // =========================== value warps ===========================
    const int col0 = vw * kValueCols;   // value dims (= bytes) of this warp
    const int rblocks = (cx.rows + 15) / 16;
    float o[kRowBlocks][kValueCols / 8][4] = {};   // [rb][2 seg]: even columns, [rb][2 seg + 1]: odd columns

    for (int it = 0; it < cx.ntiles; ++it) {
      const int b = it % kStages;
      bar_sync(kBarPFull + b, kThreads);
      mbar_wait_buffer(sm.full, phase_bits, b);
      rescale_o(o, sm.alpha[b], g, rblocks);
      uint32_t pa[kRowBlocks][4];
#pragma unroll
      for (int rb = 0; rb < kRowBlocks; ++rb) {
        const int row = rb * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        if (rb < rblocks) ldmatrix_x4(pa[rb], &sm.p8[b][0][0] + p8_off(row, lane >> 4));
      }
      // ldmatrix.x4.trans lane address: matrix mi = lane / 8 -> keys 8 mi .. 8 mi + 7
      const uint8_t* vbase = &sm.kv8[b][lane][col0];
#pragma unroll
      for (int seg = 0; seg < kValueCols / 16; ++seg) {
        uint32_t v[4];
        ldmatrix_x4_trans(v, vbase + seg * 16);
        const uint32_t e0 = __byte_perm(v[0], v[1], 0x6420), e1 = __byte_perm(v[2], v[3], 0x6420);   // column 2g
        const uint32_t d0 = __byte_perm(v[0], v[1], 0x7531), d1 = __byte_perm(v[2], v[3], 0x7531);   // column 2g + 1
#pragma unroll
        for (int rb = 0; rb < kRowBlocks; ++rb) {
          if (rb < rblocks) {
            mma_e4m3(o[rb][2 * seg], pa[rb], e0, e1);
            mma_e4m3(o[rb][2 * seg + 1], pa[rb], d0, d1);
          }
        }
      }
      if (it + kStages < cx.ntiles) bar_arrive(kBarPEmpty + b, kThreads);
      bar_sync(kBarValues, kValueWarps * 32);   // every value warp is done with buffer b: refill it
      if (it + kStages < cx.ntiles) {
        issue_tile8(sm, prm, cx, it + kStages, b, vw, lane, next_slot);
        if (issuer && it + kStages + 1 < cx.ntiles)
          next_slot = key_slot(prm, cx, cx.k0 + (it + kStages + 1) * kTileN + my_key);
      }
    }
    bar_sync(kBarBlock, kThreads);   // row_l written by the score warps
    const ItemCtx ce = item_ctx_again(prm, item);
#pragma unroll
    for (int rb = 0; rb < kRowBlocks; ++rb) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = rb * 16 + g + half * 8;
        if (r >= ce.rows) continue;
        const float l = sm.row_l[r];
        const float inv = l > 0.f ? prm.v_scale / l : 0.f;
        __nv_bfloat16* dst = result_row(prm, ce, r);
#pragma unroll
        for (int seg = 0; seg < kValueCols / 16; ++seg) {   // columns 16 seg + 4c .. + 3
          *reinterpret_cast<uint2*>(dst + col0 + seg * 16 + 4 * c) =
              make_uint2(pack_bf16(o[rb][2 * seg][2 * half] * inv, o[rb][2 * seg + 1][2 * half] * inv),
                         pack_bf16(o[rb][2 * seg][2 * half + 1] * inv, o[rb][2 * seg + 1][2 * half + 1] * inv));
        }
      }
    }
  }
  __syncthreads();   // shared memory of this item fully consumed before the next item's prologue
  if (tid == kThreads - 1) signal_item_done(prm, item_ctx_again(prm, item));
}

// The FP8 split-K kernel: prefix items in e4m3 (mma_item_fp8), draft items in bf16 (mma_item, 2 stages), one
// persistent block per SM taking items from the plan's counter.
__global__ void __launch_bounds__(MmaWide::kThreads, 1) kdtree_verify_split_fp8_kernel(Params prm) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  SharedStorageFp8& sm = *reinterpret_cast<SharedStorageFp8*>(smem_raw);
  const int tid = threadIdx.x;
  grid_dependency_wait();   // the plan kernel's counter and plan
  grid_dependency_launch_dependents();   // after the wait: the combine reads the plan as soon as it starts
  uint32_t phase_bits = 0u, pair_bits = 0u;
  if (tid == 0) {
    for (int b = 0; b < kStages8; ++b) mbar_init(&sm.full[b], 1);
    fence_proxy_async();
  }
  __syncthreads();
  for (int k = 0;; ++k) {
    // (the item and the total both from shared memory: no register held across the items for them)
    if (tid == 0) {
      sm.item = claim_item(prm, k);
      sm.total = prm.counter[1];
    }
    __syncthreads();
    const int item = sm.item;
    if (item >= sm.total) return;
    const ItemCtx cx = item_ctx<kBlockM, kTileN, true>(prm, item);
    if (!drafts_split(cx))
      mma_item_fp8(sm, prm, cx, item, phase_bits);
    else
      mma_item<2, MmaWide>(sm, prm, cx, prm.scale_log2, 1.f, phase_bits, pair_bits, item, 0);
  }
}

}  // namespace kdtree
