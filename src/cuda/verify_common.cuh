// verify_common.cuh: what every kernel of a verify call shares: the MLA geometry, the sizes the plan cuts work
// into, the per-request plan (ReqPlan) and the kernel parameters (Params), filled by verify_launch.cu.
//
// The kernels of one call: the plan (verify_plan.cuh; it can also pack the tree mask, verify_mask.cuh), one split-K
// pass (verify_mma.cuh on sm_120 and wherever sm_90a code is absent; verify_dual.cuh / verify_skinny.cuh on
// H100/H200), and the combine (verify_combine.cuh). docs/design.md describes how they fit together.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kdtree_verify.h"
#include "verify_split_rule.h"

namespace kdtree {

constexpr int kDimNope = KDTREE_HEAD_DIM_NOPE;   // 512
constexpr int kDimPe = KDTREE_HEAD_DIM_PE;       // 64
constexpr int kDimQK = KDTREE_HEAD_DIM_QK;       // 576
constexpr int kTileN = 32;                       // keys per pipeline tile (4 n8 mma tiles, 2 k16 steps of P V)

constexpr int kKeyBytes = kDimQK * 2;    // 1152: one bulk copy per key
// An e4m3 key row as the FP8 kernels stage it in shared memory: 576 bytes padded to 592, 37 16-byte units (an odd
// number), so that 8 rows read at one offset (an ldmatrix, a quarter warp's 16-byte loads) fall in distinct bank
// groups.
constexpr int kKeyPitch8 = kDimQK + 16;
static_assert(kKeyPitch8 % 16 == 0 && (kKeyPitch8 / 16) % 2 == 1, "rows 16 B aligned, an odd number of 16 B apart");

#ifndef KDTREE_MIN_CHUNK
#define KDTREE_MIN_CHUNK 256
#endif
constexpr int kMinChunk = KDTREE_MIN_CHUNK;   // smallest split worth its partial-write traffic
// (192 and 128 on the H200: H16 N9 P8192 -4 to -6% with 43 splits instead of 33, B8 +0.4 to +3.7% from its 4k and 8k
// requests' extra items; a request's split count may depend on its own length only, so the two cannot be had apart:
// docs/design.md, "The split rule")
// The combine cuts a row with many splits into up to kCombineMaxSlices slices of value columns
// (the count depends only on the row's own split count: batch-invariant).
constexpr int kCombineMaxSlices = 8;
// Splits per thread per load batch of the combine: 8 (64 registers, 4 blocks per SM); 16 (2 blocks per SM) is 3.4%
// slower at H128 N9 and 1.5% at B8 on the H200, the same elsewhere.
#ifndef KDTREE_COMBINE_BATCH
#define KDTREE_COMBINE_BATCH 8
#endif
constexpr int kCombineBatch = KDTREE_COMBINE_BATCH;
static_assert(kCombineBatch == 8 || kCombineBatch == 16, "combine batch 8 or 16");
// A slice has 4 x slices thread groups, so one load batch covers 4 x kCombineBatch splits per slice; the count is a power
// of two (the combine compiles one work per log2).
__host__ __device__ constexpr int combine_slices_log2(int nsplit) {
  return nsplit <= 4 * kCombineBatch ? 0 : nsplit <= 8 * kCombineBatch ? 1 : nsplit <= 16 * kCombineBatch ? 2 : 3;
}
__host__ __device__ constexpr int combine_slices(int nsplit) { return 1 << combine_slices_log2(nsplit); }

static_assert(kMinChunk % kTileN == 0, "splits are whole tiles");

// Per-request plan, written by the plan kernel, read by the split and combine kernels.
struct ReqPlan {
  int item_begin;    // first work item of this request
  int nsplit;        // splits of the key range (the chunked ones, then the drafts' own where they stand apart)
  int chunk;         // keys per chunked split (multiple of the split kernel's tile), the last one may be shorter
  int mtiles;        // row tiles
  int qo_begin;      // first verify token (row of q / k_new / tree_mask / out)
  int n;             // verify tokens N
  int kv_begin;      // first entry of kv_indices
  int p;             // prefix length P
  long long partial_row;  // first partial row (only when nsplit > 1)
  int chunked;       // splits of `chunk` keys: over the P + N keys, or the P prefix keys where the drafts stand apart
};

struct Params {
  const __nv_bfloat16* q_nope;
  long long q_nope_st, q_nope_sh;
  const __nv_bfloat16* q_pe;
  long long q_pe_st, q_pe_sh;
  const __nv_bfloat16* kv;
  long long kv_ss;
  const void* kv_indices;
  int kv_indices_64;
  const int32_t* kv_indptr;
  const __nv_bfloat16* k_new;
  long long k_new_st;
  const void* qo_indptr;
  int qo_indptr_64;
  const uint64_t* tree_mask;
  int mask_words;
  __nv_bfloat16* out;
  long long out_st, out_sh;
  int batch;
  int num_tokens;
  int heads;
  float scale_log2;   // sm_scale * log2(e)
  int split_target;   // work items a long request is cut into (about 2 per SM)
  int block_m;        // rows per work item of the split kernel that runs (48 mma.sync, 64 wgmma, 16 skinny)
  int tile_n;         // keys per pipeline tile of that kernel (32; 64 skinny): splits are whole tiles
  int min_chunk;      // that kernel's shortest split, in keys (kMinChunk; sk::kMinChunk skinny)
  long long max_partial_rows;
  // workspace views
  int* counter;       // [3]: dynamic work counter, total items, the combine's slice count (max over rows)
  const __nv_bfloat16* zero_row;  // [576] zeros: the source of keys past a split's end
  ReqPlan* plan;      // [B]
  float* partial_lse; // [max_partial_rows]
  __nv_bfloat16* partial_o;  // [max_partial_rows, 512]
  // Per split row tile (indexed by its first row's partial row at split 0, tile_done_index): tile_done[i] counts the
  // tile's finished split items (done_arrivals each), tile_seen[i] the combine's works that saw them all. Both are 0
  // between calls: the plan kernel zeroes its tiles', and the combine work that sees a tile last zeroes both.
  int* tile_done;     // [max_partial_rows]
  int* tile_seen;     // [max_partial_rows]
  // Arrivals on tile_done per split item of the split kernel that runs (1), or 0 where the split kernel signals nothing
  // (the skinny kernel, KDTREE_EARLY_COMBINE=0): the combine then waits for the whole split pass at its start.
  int done_arrivals;
  // The tree mask packed by the prep kernel's pack_blocks (kdtree_verify_params::pack_custom_mask): SGLang's flat
  // custom_mask and its mask_indptr, packed into tree_mask (mask_words words per row) before the split reads it.
  // NULL: tree_mask comes packed (or is NULL).
  const uint8_t* pack_mask;
  const int64_t* pack_mask_indptr;
  // TMA descriptors (CUtensorMap, 128 B each) of q_nope and q_pe as 2-D [num_tokens x heads rows, 512 | 64 columns]
  // bf16 tensors with 64 x 64 boxes and the 128-byte swizzle of the q slabs, for the dual kernel's q load, and (the
  // FP8 form's) of q8 as [num_tokens x heads rows, 576 columns] of 2-byte units, a row's hi and lo terms in the bytes
  // of a bf16 row; q_tma = 0 when the host did not build them (another kernel, q rows not evenly strided,
  // KDTREE_Q_TMA=0). The kernel passes their parameter-space addresses to cp.async.bulk.tensor (__grid_constant__).
  struct alignas(64) TmaMap { unsigned long long w[16]; };
  TmaMap q_map[3];
  int q_tma;
  // The drafts form a split of their own (ReqPlan::chunked): set for e4m3 pools and for KV scales, where prefix keys
  // are read and scaled differently from the bf16 drafts.
  int drafts_apart;
  float k_scale, v_scale;   // prefix keys score as kv * k_scale, their values count as kv[:512] * v_scale
  // The queries split into e4m3 terms for an FP8 call (verify_q8.cuh), written by the prep kernel's q blocks.
  uint8_t* q8;        // [num_tokens * heads][2][576]
  float* q_scale;     // [num_tokens * heads]
  // The prep kernel's blocks: plan_blocks (0 or 1) plan, the next pack_blocks pack the tree mask, the rest split q.
  int plan_blocks, pack_blocks;
};

__device__ __forceinline__ long long load_index(const void* p, int is64, long long i) {
  return is64 ? reinterpret_cast<const long long*>(p)[i] : (long long)reinterpret_cast<const int*>(p)[i];
}

// The last request b in [0, batch) with start(b) <= x, for a nondecreasing start offset (its first
// work item or its first verify token): the request that owns item / token x. A request with an
// empty range shares its start with its successor, so it is never the one returned.
template <typename Start>
__device__ __forceinline__ int owning_request(int batch, long long x, Start start) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (start(mid) <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace kdtree
