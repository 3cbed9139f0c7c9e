// verify_mma.cuh: the mma.sync split-K pass, the kernel of sm_120 (RTX PRO 6000: no wgmma, 99 KB of shared memory
// per block) and of any build without sm_90a code.
//
// - All H x N query rows of a request are folded into the matrix M dimension, r = n * H + h, and cut
//   into row tiles of kBlockM = 48 rows (3 mma row blocks; H=16, N=9 gives exactly 3 tiles).
// - A work item is (request, split, row tile). The keys of a request (P prefix rows through the slot
//   indices, then its N draft rows from k_new) are cut into splits of `chunk` keys; the plan kernel
//   picks nsplit/chunk from the request's own length and row-tile count only (batch-invariant).
//   A persistent grid (one CTA per SM) takes items from an atomic counter.
// - One CTA = 11 warps, warp-specialised, a Stages-deep software pipeline over 32-key tiles
//   (Stages = 3 on sm_90, 2 on sm_120):
//     3 "score" warps: each owns 16 query rows; query columns [0, 384) live in registers as mma A
//       fragments, [384, 576) in shared memory. For tile i they wait for its keys (mbarrier),
//       compute S = Q K^T (4 independent n8 accumulators), run the online softmax and publish P (bf16)
//       and the per-row rescale factor (named barrier, arrive only: they run ahead to tile i+1).
//     8 "value" warps: each owns 64 of the 512 value columns for all 48 rows (96 fp32 accumulators)
//       and computes O = alpha * O + P V for tile i, then refills tile i's buffer with tile
//       i+Stages (each value warp issues 4 of its 32 row copies).
// - Keys arrive by cp.async.bulk: one 1152-byte bulk copy per key row (slot gathered, page size 1),
//   32 per tile, completing on the buffer's mbarrier; rows are padded to 1168 B (conflict-free
//   ldmatrix). Keys past the split end copy a zero row, so no smem row ever holds garbage.
// - Split partials are stored normalised in bf16 with a float log2-sum-exp; the combine kernel merges
//   them in a fixed order (deterministic). A request with one split writes the output directly.
#pragma once

#include "verify_common.cuh"
#include "verify_item.cuh"
#include "verify_profiling.cuh"
#include "verify_ptx.cuh"

namespace kdtree {

// Key buffers (template parameter Stages of the split kernel): tiles i+1 .. i+Stages-1 land while
// tile i is computed. 2 fit sm_120's 99 KB; where a block may take more shared memory (sm_90:
// 227 KB) the launcher picks 3, which hides one more tile of gather latency.
constexpr int kMaxStages = 3;
constexpr int kValueWarps = 8;
constexpr int kValueCols = kDimNope / kValueWarps;  // 64 value columns per value warp

// The shape of a work item of the mma.sync kernel: BlockM query rows (BlockM / 16 row blocks of 16) and
// KeyHalves score warps per row block (1: a score warp runs its row block's S over all 32 keys of a tile;
// 2: two score warps take 16 keys each and exchange their row maxima every tile, halving the serial S chain).
template <int BlockM, int KeyHalves>
struct MmaShape {
  static constexpr int kBlockM = BlockM;
  static constexpr int kRowBlocks = BlockM / 16;
  static constexpr int kKeyHalves = KeyHalves;
  static constexpr int kScoreWarps = kRowBlocks * KeyHalves;
  static constexpr int kWarps = kScoreWarps + kValueWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kGroups = kTileN / 8 / KeyHalves;   // n8 key groups of a score warp's S
  static_assert(BlockM % 16 == 0, "row tile is a whole number of m16 blocks");
  static_assert(KeyHalves == 1 || KeyHalves == 2, "one or two score warps per row block");
};
// The default: 48-row items, 3 score warps + 8 value warps (352 threads, 168 registers a thread).
using MmaWide = MmaShape<48, 1>;
// Items of requests with at most 32 rows (H x N <= 32), 2-stage pipeline (sm_120): 32-row items, two score warps
// per row block, 12 warps (on the H200 with the sm_120 path forced, KDTREE_SPLIT_STAGES=2: 10-12% faster than 32-row
// items with one score warp, N1 -9%).
using MmaHalves = MmaShape<32, 2>;
constexpr int kBlockM = MmaWide::kBlockM;        // the mma.sync kernel's largest item (workspace sizing)
constexpr int kKvPitch = kDimQK + 8;     // bf16 per smem key row: +16 B shifts rows by 4 banks
// Registers: 11 warps put 3 warps on three of the four SM sub-partitions, whose register files hold
// 16,384 registers each, so a thread gets at most 170 (168 allocatable). q_nope columns [0, 384) live
// in registers (24 k-steps x 4 = 96), columns [384, 576) (the last 128 nope + the 64 rope values) in
// shared memory.
constexpr int kQRegSteps = 24;
constexpr int kQRegDims = kQRegSteps * 16;                 // 384
constexpr int kQSmemDims = kDimQK - kQRegDims;             // 192
constexpr int kQSmemPitch = kQSmemDims + 8;  // bf16 per smem q row (400 B: odd multiple of 16 B)


// Named barriers (0 is __syncthreads): the whole block; "P of buffer b is ready" (score warps
// arrive, value warps wait); "P of buffer b is free again" (value warps arrive, score warps wait);
// the value warps among themselves (key buffer consumed, may refill).
constexpr int kBarBlock = 1;
constexpr int kBarPFull = 2;                       // + buffer index (kMaxStages ids)
constexpr int kBarPEmpty = kBarPFull + kMaxStages;  // + buffer index: value warps done reading P/alpha[b]
constexpr int kBarValues = kBarPEmpty + kMaxStages;
static_assert(kBarValues < 16, "16 hardware named barriers");

static_assert(kTileN == 32, "score warps hold four n8 accumulators; P V takes two k16 steps per tile");
static_assert(kDimNope % (kValueWarps * 16) == 0, "value warps take whole ldmatrix.x4.trans column pairs");
static_assert((kKvPitch * 2) % 16 == 0 && ((kKvPitch * 2) / 16) % 2 == 1,
              "key rows must stay 16 B aligned and an odd number of 16 B units apart (conflict-free ldmatrix)");
static_assert(kMinChunk % kTileN == 0, "splits are whole tiles");
static_assert(kQRegDims <= kDimNope && kQSmemDims % 16 == 0, "the register part of q is nope columns only");


// The exchange between the two score warps of a row block (MmaShape KeyHalves 2), on mbarriers: their row maxima
// every tile in slot it % 2 (one mbarrier per row block, key half and slot, so that a warp can be at most one phase
// ahead of the one waiting on it), and key half 1's row sums at the item's end. Empty (no storage: an empty base)
// for the one-score-warp shapes. (Not a 64-thread named barrier: racecheck reports hazards on alpha across the P-full
// barrier with one.)
template <int BlockM, int KeyHalves>
struct PairExchange {};
template <int BlockM>
struct PairExchange<BlockM, 2> {
  float mx[2][2][BlockM];                          // [slot][key half][row]: the tile's row maxima
  float xl[BlockM];                                // key half 1's row sums at the item's end
  unsigned long long mx_full[BlockM / 16][2][2];   // [row block][key half][slot]: maxima stored, 32 arrivals
  unsigned long long xl_full[BlockM / 16];         // key half 1's sums stored, 32 arrivals
};

template <int Stages, int BlockM = kBlockM, int KeyHalves = 1>
struct SharedStorage : PairExchange<BlockM, KeyHalves> {
  __nv_bfloat16 kv[Stages][kTileN][kKvPitch];       // 37,376 B per stage
  __nv_bfloat16 q_tail[BlockM][kQSmemPitch];        // 19,200 B (48 rows): query columns [384, 576)
  // P tiles, [buffer][row][32 keys], 16-byte chunks XOR-swizzled by (row / 2) % 4 (no padding
  // needed: 8 rows of one logical chunk land in 8 distinct bank groups)
  __nv_bfloat16 p[Stages][BlockM][kTileN];          //  3,072 B per stage (48 rows)
  float alpha[Stages][BlockM];                      //    192 B per stage (48 rows)
  float row_m[BlockM];
  float row_l[BlockM];
  unsigned long long full[Stages];                  // mbarriers: the keys of buffer b have landed
  int item;
  KDTREE_MMA_TRACE_STORAGE   // TRACE builds: the per-tile stamps (verify_profiling.cuh)
};
// The sm_120 deployment target gives a block at most 101,376 B of shared memory (opt-in; not so a TRACE build).
static_assert(kExpTrace || sizeof(SharedStorage<2>) <= 101376, "the 2-stage kernel must fit sm_120's 99 KB per block");
static_assert(kExpTrace || sizeof(SharedStorage<2, MmaHalves::kBlockM, MmaHalves::kKeyHalves>) <= 101376,
              "so must its 32-row shape");
static_assert(sizeof(SharedStorage<kMaxStages>) <= 232448, "the deep kernel must fit sm_90's 227 KB per block");

// The value warps fill buffer `b` with tile `t`, kKeysPerWarp keys each (a bulk copy is issued by
// one thread at a time, so one warp issuing all 32 serialises them). The first value thread
// announces the tile's bytes; copies may complete before that: the phase needs the arrival too.
constexpr int kKeysPerWarp = kTileN / kValueWarps;   // 4
static_assert(kTileN % kValueWarps == 0, "keys of a tile split evenly over the value warps");
template <typename Smem>
__device__ __forceinline__ void issue_tile(Smem& sm, const Params& prm, const ItemCtx& cx, int t, int b, int vw, int lane,
                                           long long slot) {
  if (vw == 0 && lane == 0) mbar_arrive_expect_tx(&sm.full[b], kTileN * kKeyBytes);
  if (lane < kKeysPerWarp) {
    fence_proxy_async();   // earlier generic-proxy accesses of this buffer ordered before the async writes
    const int k = vw * kKeysPerWarp + lane;
    bulk_copy_g2s(&sm.kv[b][k][0], key_ptr(prm, cx, cx.k0 + t * kTileN + k, slot), kKeyBytes, &sm.full[b]);
  }
}

// The start of an item's key ring, by the value warps: the slot ids of tiles 0 .. Stages loaded together first (each
// copy's asm orders any load after it, so loading them between the copies waits one round trip per tile), then
// issue(t, slot) for tiles 0 .. Stages - 1. Returns an issuer lane's slot id of tile Stages, the next to issue.
template <int Stages, typename Issue>
__device__ __forceinline__ long long start_key_ring(const Params& prm, const ItemCtx& cx, int vw, bool issuer,
                                                    int my_key, Issue issue) {
  long long slots[Stages + 1];
#pragma unroll
  for (int t = 0; t <= Stages; ++t)
    slots[t] = issuer && t < cx.ntiles ? key_slot(prm, cx, cx.k0 + t * kTileN + my_key) : -1;
  if (vw >= 0) {
#pragma unroll
    for (int t = 0; t < Stages; ++t)
      if (t < cx.ntiles) issue(t, slots[t]);
  }
  return slots[Stages];
}

// Byte offset of (row, 16-byte chunk) in a P tile: chunks XOR-swizzled by (row / 2) % 4.
__device__ __forceinline__ int p_off(int row, int chunk) { return row * kTileN + ((chunk ^ ((row >> 1) & 3)) << 3); }

// A value warp's O = alpha O for the row blocks that hold rows (rblocks, warp-uniform); alpha of tile row r is
// alpha[r]. Once the running maxima settle, alpha is exactly 1 for whole row blocks: those skip their 32 FMULs.
template <int RowBlocks, int Tiles>
__device__ __forceinline__ void rescale_o(float (&o)[RowBlocks][Tiles][4], const float* alpha, int g, int rblocks) {
#pragma unroll
  for (int rb = 0; rb < RowBlocks; ++rb) {
    const float a0 = alpha[rb * 16 + g];
    const float a1 = alpha[rb * 16 + g + 8];
    if (rb < rblocks && !__all_sync(0xffffffffu, a0 == 1.f && a1 == 1.f)) {
#pragma unroll
      for (int nt = 0; nt < Tiles; ++nt) {
        o[rb][nt][0] *= a0;
        o[rb][nt][1] *= a0;
        o[rb][nt][2] *= a1;
        o[rb][nt][3] *= a1;
      }
    }
  }
}

// One work item of the mma.sync pass (cx: its rows and keys [k0, k1)), by every thread of the block: its keys bf16
// (prefix keys from the pool, drafts from k_new), its scores in log2 units times `score_scale` (Params::scale_log2, times
// k_scale for the prefix items of a scaled call), its output rows times `out_scale`. Ends after the block's last
// access to the item's shared memory, with its release to the combine. phase_bits / pair_bits: the calling thread's
// mbarrier parities, carried from item to item.
template <int Stages, typename Shape, typename Smem>
__device__ __forceinline__ void mma_item(Smem& sm, const Params& prm, const ItemCtx& cx, float score_scale,
                                         float out_scale, uint32_t& phase_bits, uint32_t& pair_bits, int item,
                                         long long t_fetch) {
  constexpr int kBlockM = Shape::kBlockM, kRowBlocks = Shape::kRowBlocks, kKeyHalves = Shape::kKeyHalves;
  constexpr int kScoreWarps = Shape::kScoreWarps, kThreads = Shape::kThreads, kGroups = Shape::kGroups;
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;  // mma group: row within an 8-row half
  const int c = lane & 3;   // thread in group: column pair
  const int vw = warp - kScoreWarps;         // value warp index (negative for score warps)
  const bool issuer = vw >= 0 && lane < kKeysPerWarp;   // threads that gather keys (kKeysPerWarp per value warp)
  const int my_key = vw * kKeysPerWarp + lane;          // an issuer's key within each tile
  (void)item;      // (TRACE builds print them)
  (void)t_fetch;
  const int H = prm.heads;

  // ---- prologue: tiles 0 .. Stages-1 on their way, query columns [384, 576) into shared memory ----
  long long next_slot = start_key_ring<Stages>(prm, cx, vw, issuer, my_key, [&](int t, long long slot) {
    issue_tile(sm, prm, cx, t, t, vw, lane, slot);
  });   // issuer lanes: slot id of the next tile to issue
  for (int i = tid; i < kBlockM * (kQSmemDims / 8); i += kThreads) {   // all copies in flight at once
    const int r = i / (kQSmemDims / 8), ch = i % (kQSmemDims / 8);
    const int d = kQRegDims + ch * 8;   // query column
    const __nv_bfloat16* src = prm.zero_row;   // padding rows: zero-filled, nothing read
    if (r < cx.rows) {
      const int rr = cx.row0 + r;
      const long long t = cx.rp.qo_begin + rr / H, h = rr % H;
      src = d < kDimNope ? prm.q_nope + t * prm.q_nope_st + h * prm.q_nope_sh + d
                         : prm.q_pe + t * prm.q_pe_st + h * prm.q_pe_sh + (d - kDimNope);
    }
    cp_async_16z(smem_u32(&sm.q_tail[r][ch * 8]), src, r < cx.rows ? 16 : 0);
  }
  cp_async_wait_all();   // this thread's q copies (the key rows travel as bulk copies, not cp.async)
  __syncthreads();
  KDTREE_TRACE_ITEM_START;

  if (warp < kScoreWarps) {
    // =========================== score warps ===========================
    const int rb = kKeyHalves == 1 ? warp : warp % kRowBlocks;   // row block of this warp
    const int kh = kKeyHalves == 1 ? 0 : warp / kRowBlocks;      // its key half
    const int wrow = rb * 16;                       // first tile row of this warp
    const bool active = wrow < cx.rows;
    uint32_t qa[kQRegSteps][4];                     // q_nope columns [0, 384) as A fragments
    {
      const __nv_bfloat16* qrow[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wrow + g + half * 8;
        const int rr = cx.row0 + r;
        const int n = rr / H, h = rr - n * H;
        qrow[half] = r < cx.rows ? prm.q_nope + (long long)(cx.rp.qo_begin + n) * prm.q_nope_st +
                                       (long long)h * prm.q_nope_sh
                                 : nullptr;
      }
#pragma unroll
      for (int ks = 0; ks < kQRegSteps; ++ks) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int half = j & 1, col = ks * 16 + (j >> 1) * 8 + 2 * c;
          qa[ks][j] = qrow[half] ? *reinterpret_cast<const uint32_t*>(qrow[half] + col) : 0u;
        }
      }
    }
    float m_run[2] = {-INFINITY, -INFINITY};
    float l_run[2] = {0.f, 0.f};

    for (int it = 0; it < cx.ntiles; ++it) {
      const int b = it % Stages;
      // Tile `it` landed. This also means the value warps are done with P/alpha[b] (tile
      // it-Stages): they refilled this buffer only after finishing it.
      mbar_wait_buffer(sm.full, phase_bits, b);
      if (warp == 0) KDTREE_MMA_TRACE(0);
      // P/alpha[b] last held tile it-Stages. Its keys' arrival already implies the value warps
      // finished with it (the refill is issued after), but that chain runs through the copy
      // engine; this barrier states the order directly (and lets racecheck see it).
      if (it >= Stages) bar_sync(kBarPEmpty + b, kThreads);
      if (warp == 0) KDTREE_MMA_TRACE(1);
      if (active) {
        float acc[kGroups][4] = {};   // this warp's n8 key tiles: independent mma chains
        if constexpr (!kExpNoScoreMma) {   // (the knock-out leaves S at zero)
          // ldmatrix.x4 lane address: matrix mi = lane/8 -> keys (mi/2)*8.., dims +(mi%2)*8 (of this warp's keys)
          const __nv_bfloat16* kbase =
              &sm.kv[b][kh * (kTileN / kKeyHalves) + ((lane >> 4) << 3) + (lane & 7)][((lane >> 3) & 1) * 8];
#pragma unroll
          for (int ks = 0; ks < kQRegSteps; ++ks) {
            uint32_t b0[4], b1[4];
            ldmatrix_x4(b0, kbase + ks * 16);
            if constexpr (kGroups == 4) ldmatrix_x4(b1, kbase + 16 * kKvPitch + ks * 16);
            mma_bf16(acc[0], qa[ks], b0[0], b0[1]);
            mma_bf16(acc[1], qa[ks], b0[2], b0[3]);
            if constexpr (kGroups == 4) {
              mma_bf16(acc[2], qa[ks], b1[0], b1[1]);
              mma_bf16(acc[3], qa[ks], b1[2], b1[3]);
            }
          }
          const __nv_bfloat16* qtbase = &sm.q_tail[wrow + (lane & 7) + ((lane >> 3) & 1) * 8][(lane >> 4) * 8];
#pragma unroll
          for (int ks = 0; ks < kQSmemDims / 16; ++ks) {
            uint32_t a[4], b0[4], b1[4];
            ldmatrix_x4(a, qtbase + ks * 16);
            ldmatrix_x4(b0, kbase + kQRegDims + ks * 16);
            if constexpr (kGroups == 4) ldmatrix_x4(b1, kbase + 16 * kKvPitch + kQRegDims + ks * 16);
            mma_bf16(acc[0], a, b0[0], b0[1]);
            mma_bf16(acc[1], a, b0[2], b0[3]);
            if constexpr (kGroups == 4) {
              mma_bf16(acc[2], a, b1[0], b1[1]);
              mma_bf16(acc[3], a, b1[2], b1[3]);
            }
          }
        }
        if (warp == 0) KDTREE_MMA_TRACE_LANDED(2, acc[0][0], acc[kGroups - 1][3], sm.row_m[0]);
        // ---- scale, mask, online softmax ----
        float tmax[2];
        scale_mask_max<kGroups>(prm, cx, H, cx.k0 + it * kTileN + kh * (kTileN / kKeyHalves), wrow + g, c,
                                score_scale, acc, tmax);
        if constexpr (kKeyHalves == 2) {
          // the pair's row maxima meet in slot it % 2: stored, released on this warp's mbarrier, the other's
          // acquired (the other warp read this slot's previous value before its arrival one tile ago)
#pragma unroll
          for (int half = 0; half < 2; ++half) tmax[half] = quad_max(tmax[half]);
          const int slot = it & 1;
          if (c == 0) {
            sm.mx[slot][kh][wrow + g] = tmax[0];
            sm.mx[slot][kh][wrow + g + 8] = tmax[1];
          }
          mbar_arrive(&sm.mx_full[rb][kh][slot]);
          mbar_wait(&sm.mx_full[rb][1 - kh][slot], (pair_bits >> slot) & 1u);
          pair_bits ^= 1u << slot;
          tmax[0] = fmaxf(tmax[0], sm.mx[slot][1 - kh][wrow + g]);
          tmax[1] = fmaxf(tmax[1], sm.mx[slot][1 - kh][wrow + g + 8]);
        }
        float alpha[2], m_use[2];
        softmax_advance_tau<KDTREE_MMA_LAZY_RESCALE>(tmax, m_run, m_use, alpha);   // (m_run: the rows' reference)
        softmax_p_pairs<kGroups>(acc, m_use, alpha, l_run, [&](int nt, int half, uint32_t pair) {
          const int row = wrow + g + half * 8;
          *reinterpret_cast<uint32_t*>(&sm.p[b][0][0] + p_off(row, kh * kGroups + nt) + 2 * c) = pair;
        });
        if (c == 0 && kh == 0) {   // both warps of a pair hold the same alpha
          sm.alpha[b][wrow + g] = alpha[0];
          sm.alpha[b][wrow + g + 8] = alpha[1];
        }
      }
      bar_arrive(kBarPFull + b, kThreads);   // P/alpha[b] published; run ahead to the next tile
      if (warp == 0) KDTREE_MMA_TRACE(3);
    }
    if constexpr (kKeyHalves == 2) {   // key half 1's row sums join half 0's (quad sums first)
      quad_sum_rows(l_run);
      if (kh == 1) {
        if (c == 0) {
          sm.xl[wrow + g] = l_run[0];
          sm.xl[wrow + g + 8] = l_run[1];
        }
        mbar_arrive(&sm.xl_full[rb]);   // (xl is written again only after the item's closing __syncthreads)
      } else {   // one lane per quad carries the pair's sums (finish_rows sums the quad again)
        mbar_wait(&sm.xl_full[rb], (pair_bits >> 2) & 1u);
        const float o0 = sm.xl[wrow + g], o1 = sm.xl[wrow + g + 8];
        l_run[0] = c == 0 ? l_run[0] + o0 : 0.f;
        l_run[1] = c == 0 ? l_run[1] + o1 : 0.f;
      }
      pair_bits ^= 4u;
    }
    if (kh == 0) {
      finish_rows(prm, cx, H, wrow, g, c, m_run, l_run, sm.row_m, sm.row_l,
                  [] { bar_arrive(kBarBlock, kThreads); });   // the value warps' epilogue barrier (they wait)
    } else {
      bar_arrive(kBarBlock, kThreads);
    }
  } else {
    // =========================== value warps ===========================
    const int col0 = vw * kValueCols;
    const int rblocks = (cx.rows + 15) / 16;   // warp-uniform: skip all-padding row blocks
    float o[kRowBlocks][kValueCols / 8][4] = {};

    for (int it = 0; it < cx.ntiles; ++it) {
      const int b = it % Stages;
      bar_sync(kBarPFull + b, kThreads);   // P/alpha[b] of tile `it` published
      mbar_wait_buffer(sm.full, phase_bits, b);   // already complete: acquires the keys' bytes
      if (vw == 0) KDTREE_MMA_TRACE(4);
      rescale_o(o, sm.alpha[b], g, rblocks);
      if constexpr (!kExpNoPvMma) {   // (the knock-out leaves O at zero)
#pragma unroll
        for (int kk = 0; kk < kTileN / 16; ++kk) {
          uint32_t pa[kRowBlocks][4];
#pragma unroll
          for (int rb = 0; rb < kRowBlocks; ++rb) {
            const int row = rb * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            if (rb < rblocks) ldmatrix_x4(pa[rb], &sm.p[b][0][0] + p_off(row, 2 * kk + (lane >> 4)));
          }
          // ldmatrix.x4.trans lane address: matrix mi = lane/8 -> keys (mi%2)*8.., columns +(mi/2)*8
          const __nv_bfloat16* vbase =
              &sm.kv[b][kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)][col0 + (lane >> 4) * 8];
#pragma unroll
          for (int np = 0; np < kValueCols / 16; ++np) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, vbase + np * 16);
#pragma unroll
            for (int rb = 0; rb < kRowBlocks; ++rb) {
              if (rb < rblocks) {
                mma_bf16(o[rb][2 * np], pa[rb], vb[0], vb[1]);
                mma_bf16(o[rb][2 * np + 1], pa[rb], vb[2], vb[3]);
              }
            }
          }
        }
      }
      if (vw == 0) KDTREE_MMA_TRACE_LANDED(5, o[0][0][0], o[0][7][3], sm.row_l[0]);
      if (it + Stages < cx.ntiles) bar_arrive(kBarPEmpty + b, kThreads);   // P/alpha[b] free for tile it+Stages
      // every value warp is done with buffer b (the score warps finished it before publishing P):
      // refill it with tile it+Stages
      bar_sync(kBarValues, kValueWarps * 32);
      if (vw == 0) KDTREE_MMA_TRACE(6);
      if (it + Stages < cx.ntiles) {
        issue_tile(sm, prm, cx, it + Stages, b, vw, lane, next_slot);
        if (issuer && it + Stages + 1 < cx.ntiles)
          next_slot = key_slot(prm, cx, cx.k0 + (it + Stages + 1) * kTileN + my_key);
      }
      if (vw == 0) KDTREE_MMA_TRACE(7);
    }
    bar_sync(kBarBlock, kThreads);  // row_m / row_l written by the score warps (which only arrive)
#pragma unroll
    for (int rb = 0; rb < kRowBlocks; ++rb) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = rb * 16 + g + half * 8;
        if (r >= cx.rows) continue;
        const float l = sm.row_l[r];
        const float inv = l > 0.f ? out_scale / l : 0.f;
        __nv_bfloat16* dst = result_row(prm, cx, r);
#pragma unroll
        for (int nt = 0; nt < kValueCols / 8; ++nt) {
          *reinterpret_cast<uint32_t*>(dst + col0 + nt * 8 + 2 * c) =
              pack_bf16(o[rb][nt][2 * half] * inv, o[rb][nt][2 * half + 1] * inv);
        }
      }
    }
  }
  __syncthreads();   // shared memory of this item fully consumed before the next item's prologue
  // (a thread that issues no copies and not the claimer, whose next claim's round trip hides this one's)
  if (tid == kThreads - 1) signal_item_done(prm, cx);
  KDTREE_MMA_TRACE_DUMP(item, cx.ntiles, t_fetch);
}

// The mma.sync split-K kernel over bf16 keys. DraftsApart (KV scales on a bf16 pool, Params::drafts_apart): the plan
// gives the drafts a split of their own, whose items score them unscaled, while the prefix items scale their scores by
// k_scale and their outputs by v_scale (SGLang's k_descale / v_descale, which apply to prefix keys only).
template <int Stages, typename Shape = MmaWide, bool DraftsApart = false>
__global__ void __launch_bounds__(Shape::kThreads, 1) kdtree_verify_split_kernel(Params prm) {
  constexpr int kBlockM = Shape::kBlockM, kRowBlocks = Shape::kRowBlocks, kKeyHalves = Shape::kKeyHalves;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
  // consumer Blackwell (99 KB per block): only the 2-stage kernel is ever launched there
  if constexpr (Stages > 2) {
    __trap();
  } else
#endif
  {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  using Smem = SharedStorage<Stages, kBlockM, kKeyHalves>;
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x;
  grid_dependency_wait();   // the plan kernel's counter and plan
  grid_dependency_launch_dependents();   // after the wait: the combine reads the plan as soon as it starts
  const int total = prm.counter[1];
  uint32_t phase_bits = 0u;                  // bit b: mbarrier parity buffer b waits for next

  if (tid == 0) {
    for (int b = 0; b < Stages; ++b) mbar_init(&sm.full[b], 1);
    if constexpr (kKeyHalves == 2) {
      for (int r = 0; r < kRowBlocks; ++r) {
        for (int h = 0; h < 2; ++h)
          for (int slot = 0; slot < 2; ++slot) mbar_init(&sm.mx_full[r][h][slot], 32);
        mbar_init(&sm.xl_full[r], 32);
      }
    }
    fence_proxy_async();   // make the initialised barriers visible to the bulk-copy (async) proxy
  }
  __syncthreads();
  uint32_t pair_bits = 0u;   // score warps of a pair: bit slot = parity of mx_full[..][other][slot]; bit 2: xl_full

  for (int k = 0;; ++k) {
    long long t_fetch = 0;   // (TRACE builds: the claim's start)
    if constexpr (kExpTrace) t_fetch = clock64();
    if (tid == 0) sm.item = claim_item(prm, k);
    __syncthreads();
    const int item = sm.item;
    if (item >= total) return;
    const ItemCtx cx = item_ctx<kBlockM, kTileN, DraftsApart>(prm, item);
    const bool scaled = DraftsApart && !drafts_split(cx);   // a prefix item of a scaled call
    mma_item<Stages, Shape>(sm, prm, cx, scaled ? prm.scale_log2 * prm.k_scale : prm.scale_log2,
                            scaled ? prm.v_scale : 1.f, phase_bits, pair_bits, item, t_fetch);
  }
  }
}

}  // namespace kdtree
