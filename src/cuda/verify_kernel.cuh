// verify_kernel.cuh: __global__ code of the kdtree tree-verify attention (plan, split pass, combine).
//
// Design (numbers and history in docs/PERF_LOG.md):
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
// - Split partials are stored normalised in bf16 with a float log2-sum-exp; a combine kernel merges
//   them in a fixed order (deterministic). A request with one split writes the output directly.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#if defined(KDTREE_EXP_TRACE) || defined(KDTREE_EXP_TIMELINE)
#include <cstdio>
#endif

#include "kdtree_verify.h"
#include "verify_split_rule.h"

namespace kdtree {

constexpr int kDimNope = KDTREE_HEAD_DIM_NOPE;   // 512
constexpr int kDimPe = KDTREE_HEAD_DIM_PE;       // 64
constexpr int kDimQK = KDTREE_HEAD_DIM_QK;       // 576
constexpr int kTileN = 32;                       // keys per pipeline tile (4 n8 mma tiles, 2 k16 steps of P V)
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
// per row block, 12 warps (PERF_LOG history 72: 10-12% faster than 32-row items with one score warp, N1 -9%).
using MmaHalves = MmaShape<32, 2>;
constexpr int kBlockM = MmaWide::kBlockM;        // the mma.sync kernel's largest item (workspace sizing)
constexpr int kKvPitch = kDimQK + 8;     // bf16 per smem key row: +16 B shifts rows by 4 banks
constexpr int kKeyBytes = kDimQK * 2;    // 1152: one bulk copy per key
// Registers: 11 warps put 3 warps on three of the four SM sub-partitions, whose register files hold
// 16,384 registers each, so a thread gets at most 170 (168 allocatable). q_nope columns [0, 384) live
// in registers (24 k-steps x 4 = 96), columns [384, 576) (the last 128 nope + the 64 rope values) in
// shared memory.
constexpr int kQRegSteps = 24;
constexpr int kQRegDims = kQRegSteps * 16;                 // 384
constexpr int kQSmemDims = kDimQK - kQRegDims;             // 192
constexpr int kQSmemPitch = kQSmemDims + 8;  // bf16 per smem q row (400 B: odd multiple of 16 B)
#ifndef KDTREE_MIN_CHUNK
#define KDTREE_MIN_CHUNK 256
#endif
constexpr int kMinChunk = KDTREE_MIN_CHUNK;   // smallest split worth its partial-write traffic
// (192 and 128 measured in sessions 4, 6, 18 and 34, PERF_LOG history 41, 52, 122, 192: H16 N9 P8192 -4 to -6% with
// 43 splits instead of 33, B8 +0.4 to +3.7% from its 4k and 8k requests' extra items; a request's split count may
// depend on its own length only, so the two cannot be had apart)
// Mixed calls (ReqPlan): a last row tile of at most kMixedRemRows rows runs as skinny items of kMixedTileN-key tiles
// (verify_skinny.cuh's kRows and kTileN, asserted there).
#ifndef KDTREE_SKINNY_TILE   // the skinny kernel's tile (an experiment switch there)
#define KDTREE_SKINNY_TILE 64
#endif
constexpr int kMixedRemRows = 16;
constexpr int kMixedTileN = KDTREE_SKINNY_TILE;
// The combine cuts a row with many splits into up to kCombineMaxSlices slices of value columns
// (the count depends only on the row's own split count: batch-invariant).
constexpr int kCombineMaxSlices = 8;
// Splits per thread per load batch of the combine (session 7: 8, 64 registers and 4 blocks per SM, was
// faster than 16 at H128 N9 and B8, the same elsewhere).
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
static_assert(kKeyBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
static_assert(kMinChunk % kTileN == 0, "splits are whole tiles");
static_assert(kQRegDims <= kDimNope && kQSmemDims % 16 == 0, "the register part of q is nope columns only");

// Per-request plan, written by the plan kernel, read by the split and combine kernels.
struct ReqPlan {
  int item_begin;    // first work item of this request
  int nsplit;        // splits of the key range
  int chunk;         // keys per split (multiple of kTileN), last split may be shorter
  int mtiles;        // row tiles
  int qo_begin;      // first verify token (row of q / k_new / tree_mask / out)
  int n;             // verify tokens N
  int kv_begin;      // first entry of kv_indices
  int p;             // prefix length P
  long long partial_row;  // first partial row (only when nsplit > 1 or nsplit_s > 1)
  // A mixed call (Params::mixed, sm_90a): a request whose last row tile has <= 16 rows runs the other row tiles as
  // the split kernel's items (rows [0, rows_f), mtiles tiles, nsplit splits) and that last tile as nsplit_s skinny
  // items (verify_skinny.cuh, remainder mode, numbered from item_begin_s), which share its cells_s cells of 64 keys
  // (rem_tile). Otherwise rows_f is every row and nsplit_s 0.
  int rows_f;
  int nsplit_s;
  int cells_s;
  int item_begin_s;
};

// The exchange between the two score warps of a row block (MmaShape KeyHalves 2), on mbarriers: their row maxima
// every tile in slot it % 2 (one mbarrier per row block, key half and slot, so that a warp can be at most one phase
// ahead of the one waiting on it), and key half 1's row sums at the item's end. Empty (no storage: an empty base)
// for the one-score-warp shapes. (The first version exchanged through a 64-thread named barrier; racecheck then
// reported hazards on alpha across the P-full barrier, history 92.)
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
#ifdef KDTREE_EXP_TRACE   // profiling aid: per-tile clock64 stamps of score warp 0 and value warp 0
  long long trace[64][8];
#endif
};
// The sm_120 deployment target gives a block at most 101,376 B of shared memory (opt-in).
#ifndef KDTREE_EXP_TRACE
static_assert(sizeof(SharedStorage<2>) <= 101376, "the 2-stage kernel must fit sm_120's 99 KB per block");
static_assert(sizeof(SharedStorage<2, MmaHalves::kBlockM, MmaHalves::kKeyHalves>) <= 101376, "so must its 32-row shape");
#endif
static_assert(sizeof(SharedStorage<kMaxStages>) <= 232448, "the deep kernel must fit sm_90's 227 KB per block");

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
  long long max_partial_rows;
  int mixed;          // remainder row tiles of <= 16 rows run as skinny items beside the split kernel (ReqPlan)
  int split_target_s; // skinny items a long request's remainder tile is cut into (mixed calls)
  // workspace views
  int* counter;       // [5]: dynamic work counter, total items, the combine's slice count (max over rows), total
                      // skinny items and their work counter (mixed calls)
  const __nv_bfloat16* zero_row;  // [576] zeros: the source of keys past a split's end
  ReqPlan* plan;      // [B]
  float* partial_lse; // [max_partial_rows]
  __nv_bfloat16* partial_o;  // [max_partial_rows, 512]
  // Per split row tile (indexed by its first row's partial row at split 0, tile_done_index): tile_done[i] counts the
  // tile's finished split items (done_arrivals each), tile_seen[i] the combine's works that saw them all. Both are 0
  // between calls: the plan kernel zeroes its tiles', and the combine work that sees a tile last zeroes both.
  int* tile_done;     // [max_partial_rows]
  int* tile_seen;     // [max_partial_rows]
  // Arrivals on tile_done per split item of the split kernel that runs (1), or 0 for a kernel that signals nothing
  // (the trans experiment): the combine then waits for the whole split pass at its start, as before session 17.
  int done_arrivals;
  // The tree mask packed by the plan kernel's blocks 1.. (kdtree_verify_params::pack_custom_mask; session 19): SGLang's
  // flat custom_mask and its mask_indptr, packed into tree_mask (mask_words words per row) before the split reads it.
  // NULL: tree_mask comes packed (or is NULL). Last in the struct: the other fields' parameter offsets stay as before.
  const uint8_t* pack_mask;
  const int64_t* pack_mask_indptr;
  // TMA descriptors (CUtensorMap, 128 B each) of q_nope and q_pe as 2-D [num_tokens x heads rows, 512 | 64 columns]
  // bf16 tensors with 64 x 64 boxes and the 128-byte swizzle of the q slabs, for the dual kernel's q load (session
  // 20); q_tma = 0 when the host did not build them (another kernel, q rows not evenly strided, KDTREE_Q_TMA=0).
  // The kernel passes their parameter-space addresses to cp.async.bulk.tensor (__grid_constant__).
  struct alignas(64) TmaMap { unsigned long long w[16]; };
  TmaMap q_map[2];
  int q_tma;
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

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90+): the launcher starts each kernel of a call with
// cudaLaunchAttributeProgrammaticStreamSerialization, so its blocks are scheduled while the previous
// kernel still runs and wait here, before touching anything that kernel (or any earlier work on the
// stream) wrote, until it has completed and its memory is visible. Every kernel of the chain waits
// before it can finish, so completion is transitive. Launched without the attribute, both are no-ops.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// Lets the next kernel's blocks be scheduled now (they still wait for this grid's completion).
__device__ __forceinline__ void grid_dependency_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Profiling aid (-DKDTREE_EXP_TIMELINE, never in a normal build): per kernel of a call (0 mask pack, 1 plan,
// 2 split, 3 combine) the %globaltimer of its first block's start, of the first block past
// griddepcontrol.wait and of its last block's end; the combine's last block prints them (ns from the
// first start) and resets them for the next call. benchmarks/timeline_case.py runs it in a CUDA graph.
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#ifdef KDTREE_EXP_TIMELINE
// [4]: inside the combine, the latest block's (plan read, partials summed, row stored) of its first work
__device__ unsigned long long g_timeline[5][3] = {{~0ull, ~0ull, 0}, {~0ull, ~0ull, 0}, {~0ull, ~0ull, 0}, {~0ull, ~0ull, 0},
                                                  {0, 0, 0}};
__device__ unsigned g_timeline_done = 0;
// per combine work (session 18; the first kStampWorks works): iteration start, tile wait done, partials summed, row
// stored, and (session 35) its addresses ready and its first load batch landed (thread 0, ns), its tile's counter
// index; per tile (counter index mod kStampTiles) the latest item release
constexpr int kStampWorks = 2048, kStampTiles = 256;
__device__ unsigned long long g_work[kStampWorks][6];
// %globaltimer read only once dep is known: the read is predicated on it, so it cannot issue before the loads or the
// arithmetic that dep comes from (0 in the one case in 2^32 where dep equals the test value; such a work is skipped)
__device__ __forceinline__ unsigned long long global_ns_after(unsigned dep) {
  unsigned long long t;
  asm volatile("{\n .reg .pred p;\n setp.ne.u32 p, %1, 0x7fc00001;\n @p mov.u64 %0, %%globaltimer;\n"
               " @!p mov.u64 %0, 0;\n}\n" : "=l"(t) : "r"(dep));
  return t;
}
__device__ long long g_work_tile[kStampWorks];
__device__ unsigned long long g_tile_rel[kStampTiles];
// per split item (the dual kernel): ns from its value side's store of O to the barrier after it (max, sum, count)
__device__ unsigned long long g_item_store[3];
#define KDTREE_ITEM_STORE_BEGIN(cond) const unsigned long long t_store0_ = (cond) ? global_ns() : 0ull
#define KDTREE_ITEM_STORE_END(cond) \
  do { if (cond) { const unsigned long long d_ = global_ns() - t_store0_; atomicMax(&g_item_store[0], d_); \
                   atomicAdd(&g_item_store[1], d_); atomicAdd(&g_item_store[2], 1ull); } } while (0)
#define KDTREE_WORK_STAMP(w, e) \
  do { if (threadIdx.x == 0 && (w) < kStampWorks) g_work[w][e] = global_ns(); } while (0)
#define KDTREE_WORK_STAMP_AFTER(w, e, dep) \
  do { if (threadIdx.x == 0 && (w) < kStampWorks) g_work[w][e] = global_ns_after(dep); } while (0)
#define KDTREE_TIMELINE_BY(cond, k, e) \
  do { if (cond) { if (e == 2) atomicMax(&g_timeline[k][2], global_ns()); else atomicMin(&g_timeline[k][e], global_ns()); } } while (0)
#define KDTREE_TIMELINE(k, e) KDTREE_TIMELINE_BY(threadIdx.x == 0, k, e)
#define KDTREE_TIMELINE_LATEST(e) \
  do { if (threadIdx.x == 0) atomicMax(&g_timeline[4][e], global_ns()); } while (0)
#else
#define KDTREE_ITEM_STORE_BEGIN(cond) do { } while (0)
#define KDTREE_ITEM_STORE_END(cond) do { } while (0)
#define KDTREE_WORK_STAMP(w, e) do { } while (0)
#define KDTREE_WORK_STAMP_AFTER(w, e, dep) do { } while (0)
#define KDTREE_TIMELINE_LATEST(e) do { } while (0)
#define KDTREE_TIMELINE_BY(cond, k, e) do { } while (0)
#define KDTREE_TIMELINE(k, e) do { } while (0)
#endif

// ---------------------------------------------------------------------------------------------
// Plan: one block; per request its split count, chunk, row tiles and offsets (exclusive scans). A call that packs its
// own tree mask (Params::pack_mask) launches more blocks: blocks 1.. pack it, kPlanThreads words each.
// ---------------------------------------------------------------------------------------------
constexpr int kPlanThreads = 256;
// Batches of up to 32 requests are planned by one warp with shuffle scans (session 8); 0: the block-wide scan
// for every batch, as before (an experiment switch: the same plan either way).
#ifndef KDTREE_PLAN_WARP
#define KDTREE_PLAN_WARP 1
#endif

// The plan of request b alone (item_begin and partial_row are the caller's scan): its lengths, row tiles,
// splits and chunk; `items` its work items, `rows` its partial rows (0 when it is not split).
__device__ __forceinline__ ReqPlan request_plan(const Params& prm, int b, int& items, long long& rows, int& items_s) {
  ReqPlan rp = {};
  const int qb = (int)load_index(prm.qo_indptr, prm.qo_indptr_64, b);
  const int qe = (int)load_index(prm.qo_indptr, prm.qo_indptr_64, b + 1);
  const int kb = prm.kv_indptr[b];
  const int ke = prm.kv_indptr[b + 1];
  rp.qo_begin = qb;
  rp.n = max(qe - qb, 0);
  rp.kv_begin = kb;
  rp.p = max(ke - kb, 0);
  const int len = rp.p + rp.n;
  const int r = rp.n * prm.heads;
  rp.mtiles = (r + prm.block_m - 1) / prm.block_m;
  rp.rows_f = r;
  const int rem = r % prm.block_m;
  const bool skinny_rem = prm.mixed && r > prm.block_m && rem > 0 && rem <= kMixedRemRows;
  if (skinny_rem) {
    rp.mtiles = r / prm.block_m;
    rp.rows_f = rp.mtiles * prm.block_m;
  }
  const SplitShape sh = split_shape(len, rp.mtiles, prm.split_target, prm.tile_n, kMinChunk);
  const int nsplit = sh.nsplit;
  const int chunk = sh.chunk;
  rp.nsplit = nsplit;
  rp.chunk = chunk;
  items = rp.mtiles * nsplit;
  rows = nsplit > 1 ? (long long)nsplit * rp.rows_f : 0;
  items_s = 0;
  if (skinny_rem) {
    rp.cells_s = nsplit * ((chunk + kMixedTileN - 1) / kMixedTileN);
    const int ns = max(1, min(min((len + kMinChunk - 1) / kMinChunk, prm.split_target_s), rp.cells_s));
    rp.nsplit_s = ns;
    items_s = ns;
    if (ns > 1) rows += (long long)ns * (r - rp.rows_f);
  }
  return rp;
}

// Partial row of request-local row rr, split `split` (of the row's own kind: the split kernel's rows [0, rows_f), then
// the remainder's skinny splits after all of theirs). A row's splits are adjacent (session 35; before, a split's rows
// were), so that a combine thread's loads are one base and immediate offsets.
__device__ __forceinline__ long long partial_index(const ReqPlan& rp, int heads, int rr, int split) {
  if (rr < rp.rows_f) return rp.partial_row + (long long)rr * rp.nsplit + split;
  const long long base = rp.partial_row + (rp.nsplit > 1 ? (long long)rp.nsplit * rp.rows_f : 0);
  return base + (long long)(rr - rp.rows_f) * rp.nsplit_s + split;
}
// How many splits request-local row rr's keys were cut into (1: its item wrote the output row).
__device__ __forceinline__ int row_nsplit(const ReqPlan& rp, int rr) { return rr < rp.rows_f ? rp.nsplit : rp.nsplit_s; }
// The first row of request-local row rr's row tile (a split kernel's tile of block_m rows, or a mixed call's remainder),
// and the tile's entry in Params::tile_done / tile_seen: its first row's partial row at split 0 (distinct per tile; a
// tile is split only when it has partial rows).
__device__ __forceinline__ int tile_row0(const ReqPlan& rp, int block_m, int rr) {
  return rr < rp.rows_f ? rr / block_m * block_m : rp.rows_f;
}
__device__ __forceinline__ long long tile_done_index(const ReqPlan& rp, int heads, int row0) {
  return partial_index(rp, heads, row0, 0);
}
// The plan's zeroes for request rp's split row tiles (a fresh workspace; afterwards the combine leaves them zero).
__device__ __forceinline__ void zero_tile_counters(const Params& prm, const ReqPlan& rp) {
  const int r = rp.n * prm.heads;
  for (int row0 = 0; row0 < r; row0 = row0 < rp.rows_f ? row0 + prm.block_m : r) {
    if (row_nsplit(rp, row0) <= 1) continue;
    const long long i = tile_done_index(rp, prm.heads, row0);
    prm.tile_done[i] = 0;
    prm.tile_seen[i] = 0;
  }
}


// The plan's totals for the split and combine kernels: the work counter reset, the item count, and the
// combine's loop bound from the largest split count of any request.
__device__ __forceinline__ void write_plan_totals(const Params& prm, int items, int max_nsplit, int items_s) {
  prm.counter[0] = 0;
  prm.counter[1] = items;
  prm.counter[2] = combine_slices(max_nsplit);
  prm.counter[3] = items_s;
  prm.counter[4] = 0;
}

// Tree-mask packing from SGLang's flat custom_mask: word idx = t * words + w of the packed mask, by one thread (the pack
// kernel's, or the plan kernel's blocks 1.. when a verify call packs its own mask).
__device__ __forceinline__ void pack_tree_mask_word(const uint8_t* custom_mask, const int64_t* mask_indptr,
                                                    const void* qo_indptr, int qo64, const int32_t* kv_indptr,
                                                    int batch, int num_tokens, uint64_t* out, int words, long long idx) {
  if (idx >= (long long)num_tokens * words) return;
  const int t = (int)(idx / words);
  const int w = (int)(idx - (long long)t * words);
  const int lo = owning_request(batch, t, [&](int b) { return load_index(qo_indptr, qo64, b); });
  const long long qb = load_index(qo_indptr, qo64, lo);
  const long long qe = load_index(qo_indptr, qo64, lo + 1);
  uint64_t bits = 0;
  if (t >= qb && t < qe) {
    const long long n_tok = qe - qb;
    const long long p = kv_indptr[lo + 1] - kv_indptr[lo];
    const long long i = t - qb;
    const uint8_t* row = custom_mask + mask_indptr[lo] + i * (p + n_tok) + p;
    const int j0 = w * 64;
    const int j1 = (int)(n_tok < j0 + 64 ? n_tok : j0 + 64);
    for (int j = j0; j < j1; ++j) bits |= (uint64_t)(row[j] != 0) << (j - j0);
  }
  out[idx] = bits;
}

__global__ void __launch_bounds__(kPlanThreads) kdtree_verify_plan_kernel(Params prm) {
  __shared__ int s_items[kPlanThreads];
  __shared__ int s_items_s[kPlanThreads];
  __shared__ long long s_rows[kPlanThreads];
  __shared__ int s_carry_items, s_carry_items_s;
  __shared__ int s_max_nsplit;
  __shared__ long long s_carry_rows;
  const int tid = threadIdx.x;
  KDTREE_TIMELINE(1, 0);
  grid_dependency_launch_dependents();
  grid_dependency_wait();   // the indptr arrays may come from the previous kernel on the stream
  KDTREE_TIMELINE(1, 1);
  if (blockIdx.x > 0) {   // the tree mask, packed beside the plan (launched only with prm.pack_mask)
    pack_tree_mask_word(prm.pack_mask, prm.pack_mask_indptr, prm.qo_indptr, prm.qo_indptr_64, prm.kv_indptr, prm.batch,
                        prm.num_tokens, const_cast<uint64_t*>(prm.tree_mask), prm.mask_words,
                        (long long)(blockIdx.x - 1) * kPlanThreads + tid);
    KDTREE_TIMELINE(1, 2);
    return;
  }
  __nv_bfloat16* zero_row = const_cast<__nv_bfloat16*>(prm.zero_row);
  for (int i = tid; i < kDimQK; i += kPlanThreads) zero_row[i] = __float2bfloat16(0.f);
  if (KDTREE_PLAN_WARP && prm.batch <= 32) {   // one warp: shuffle scans, no block barriers (the split waits on this)
    if (tid < 32) {
      int items = 0, items_s = 0;
      long long rows = 0;
      ReqPlan rp = {};
      if (tid < prm.batch) rp = request_plan(prm, tid, items, rows, items_s);
      int inc_items = items, inc_items_s = items_s, max_nsplit = tid < prm.batch ? max(rp.nsplit, rp.nsplit_s) : 1;
      long long inc_rows = rows;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int vi = __shfl_up_sync(0xffffffffu, inc_items, off);
        const int vs = __shfl_up_sync(0xffffffffu, inc_items_s, off);
        const long long vr = __shfl_up_sync(0xffffffffu, inc_rows, off);
        if (tid >= off) {
          inc_items += vi;
          inc_items_s += vs;
          inc_rows += vr;
        }
        max_nsplit = max(max_nsplit, __shfl_xor_sync(0xffffffffu, max_nsplit, off));
      }
      if (tid < prm.batch) {
        rp.item_begin = inc_items - items;
        rp.item_begin_s = inc_items_s - items_s;
        rp.partial_row = inc_rows - rows;
        prm.plan[tid] = rp;
        zero_tile_counters(prm, rp);
      }
      if (tid == 31) write_plan_totals(prm, inc_items, max_nsplit, inc_items_s);
    }
    KDTREE_TIMELINE(1, 2);
    return;
  }
  if (tid == 0) {
    s_carry_items = 0;
    s_carry_items_s = 0;
    s_max_nsplit = 1;
    s_carry_rows = 0;
  }
  __syncthreads();
  for (int base = 0; base < prm.batch; base += kPlanThreads) {
    const int b = base + tid;
    ReqPlan rp = {};
    int items = 0, items_s = 0;
    long long rows = 0;
    if (b < prm.batch) {
      rp = request_plan(prm, b, items, rows, items_s);
      atomicMax(&s_max_nsplit, max(rp.nsplit, rp.nsplit_s));
    }
    s_items[tid] = items;
    s_items_s[tid] = items_s;
    s_rows[tid] = rows;
    __syncthreads();
    // Hillis-Steele inclusive scan over a chunk of 256 requests.
    for (int off = 1; off < kPlanThreads; off <<= 1) {
      const int vi = tid >= off ? s_items[tid - off] : 0;
      const int vs = tid >= off ? s_items_s[tid - off] : 0;
      const long long vr = tid >= off ? s_rows[tid - off] : 0;
      __syncthreads();
      s_items[tid] += vi;
      s_items_s[tid] += vs;
      s_rows[tid] += vr;
      __syncthreads();
    }
    if (b < prm.batch) {
      rp.item_begin = s_carry_items + s_items[tid] - items;
      rp.item_begin_s = s_carry_items_s + s_items_s[tid] - items_s;
      rp.partial_row = s_carry_rows + s_rows[tid] - rows;
      prm.plan[b] = rp;
      zero_tile_counters(prm, rp);
    }
    __syncthreads();
    if (tid == kPlanThreads - 1) {
      s_carry_items += s_items[tid];
      s_carry_items_s += s_items_s[tid];
      s_carry_rows += s_rows[tid];
    }
    __syncthreads();
  }
  if (tid == 0) write_plan_totals(prm, s_carry_items, s_max_nsplit, s_carry_items_s);
  KDTREE_TIMELINE(1, 2);
}

// ---------------------------------------------------------------------------------------------
// mma.sync / ldmatrix / cp.async helpers
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3]) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// 16 bytes global -> shared, asynchronous; src_bytes 0 zero-fills (nothing is read).
__device__ __forceinline__ void cp_async_16z(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// until at most N of this thread's latest committed groups are in flight
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// D += A(16x16, row) * B(16x8, col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- mbarrier + bulk copy (sm_90+, also sm_120): the gather of whole 1152-byte key rows ----
__device__ __forceinline__ void mbar_init(unsigned long long* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {   // release semantics (.release.cta)
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, uint32_t phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(phase)
      : "memory");
}
// Waits for the next phase of buffer b's mbarrier (bit b of `bits`: the parity it waits for) and
// advances that bit: the ring of key buffers, one mbarrier each, waited once per tile.
__device__ __forceinline__ void mbar_wait_buffer(unsigned long long* bars, uint32_t& bits, int b) {
  mbar_wait(&bars[b], (bits >> b) & 1u);
  bits ^= 1u << b;
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, int bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
// A 2-D TMA tensor copy global -> shared of the box at (x, y) of the tensor map at generic address `map` (a
// __grid_constant__ kernel parameter), completing on `bar` with its bytes (mbarrier complete_tx).
__device__ __forceinline__ void tma_load_2d(void* dst, const void* map, int x, int y, unsigned long long* bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
               ::"r"(smem_u32(dst)), "l"(map), "r"(x), "r"(y), "r"(smem_u32(bar))
               : "memory");
}
// threadIdx.x read where it is used (a volatile read is not hoisted out of a loop): keeps ptxas from holding values
// derived from it live across the loop where registers are short
__device__ __forceinline__ int thread_index_now() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Named barriers: `count` threads take part; bar.arrive does not wait (producer side). bar.sync is the aligned form
// (barrier.sync.aligned): every thread that waits on one use of a barrier must execute that same instruction. Where
// two roles of a warp-specialised kernel meet, one role therefore only arrives and the other waits; a barrier that
// both must wait on from their own branches is the unaligned sync_block_roles. (Both roles waiting at bar.sync from
// different instructions is undefined; compute-sanitizer's synccheck reports it as "Divergent thread(s) in block",
// session 20.)
__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// __syncthreads for roles that reach it from their own branches: barrier 0 of the whole block, unaligned (ptxas
// puts a WARPSYNC before it).
__device__ __forceinline__ void sync_block_roles() { asm volatile("barrier.sync 0;\n" ::: "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// 2^x on the SFU (ex2.approx: ~2 ulp, flushes denormals; -inf -> +0), as flash kernels use for softmax.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ---------------------------------------------------------------------------------------------
// The split pass.
// ---------------------------------------------------------------------------------------------
struct ItemCtx {
  ReqPlan rp;
  int split, mtile;
  int row0, rows;        // first request-local row of this tile, valid rows in it (<= kBlockM)
  int k0, k1;            // key range [k0, k1) of this split, keys >= p are drafts
  int ntiles;
};

// The work item `item` of the plan: its request, split, row tile and key range, for row tiles of
// BlockM rows and key tiles of TileN keys (the split kernel's own sizes, as the plan used them).
template <int BlockM, int TileN>
__device__ __forceinline__ ItemCtx item_ctx(const Params& prm, int item) {
  ItemCtx cx;
  cx.rp = prm.plan[owning_request(prm.batch, item, [&](int b) { return prm.plan[b].item_begin; })];
  const int local = item - cx.rp.item_begin;
  cx.split = local / cx.rp.mtiles;
  cx.mtile = local - cx.split * cx.rp.mtiles;
  cx.row0 = cx.mtile * BlockM;
  cx.rows = min(BlockM, cx.rp.n * prm.heads - cx.row0);
  cx.k0 = cx.split * cx.rp.chunk;
  cx.k1 = min(cx.rp.p + cx.rp.n, cx.k0 + cx.rp.chunk);
  cx.ntiles = (cx.k1 - cx.k0 + TileN - 1) / TileN;
  return cx;
}

// The block's k-th work item: block i starts with item i (no atomic on the way to the first tile, session 10),
// later ones come from the plan's counter (reset to 0 by the plan kernel and by every combine), after the
// grid's first items.
template <int Counter = 0>   // 4: the skinny remainder items of a mixed call
__device__ __forceinline__ int claim_item(const Params& prm, int k) {
  return k == 0 ? (int)blockIdx.x : (int)gridDim.x + atomicAdd(prm.counter + Counter, 1);
}

// A request's plan read from L2 (ld.global.cg): the skinny kernel of a mixed call reads the plan without a
// griddepcontrol.wait (it runs beside the split kernel, which waited for the plan kernel before it let it start).
__device__ __forceinline__ ReqPlan load_plan_cg(const ReqPlan* src) {
  static_assert(sizeof(ReqPlan) % 8 == 0 && alignof(ReqPlan) == 8, "whole 8-byte words");
  unsigned long long v[sizeof(ReqPlan) / 8];
#pragma unroll
  for (int i = 0; i < (int)(sizeof(ReqPlan) / 8); ++i) v[i] = __ldcg(reinterpret_cast<const unsigned long long*>(src) + i);
  ReqPlan rp;
  memcpy(&rp, v, sizeof(rp));
  return rp;
}

// A mixed call's skinny item `item` (of the remainder row tiles, ReqPlan::item_begin_s): its request and index
// among the request's nsplit_s. The request's keys are cut into cells: cell g is the (g / nsplit)-th 64-key tile of
// the split kernel's split g % nsplit (cells_s of them, offset-major), and item j takes cells j, j + nsplit_s, ...
// (rem_tile): at any time it reads the keys at about the offset that the split kernel's items are reading in each of
// their splits, so the keys it shares with them come from L2 (session 15: one contiguous range per item, walked at
// the split kernel's offsets over the two or three splits it spans, fell behind them and read ~35 ns per key, where
// nine skinny items reading together had taken ~25).
__device__ __forceinline__ ItemCtx item_ctx_rem(const Params& prm, int item) {
  ItemCtx cx;
  const int b = owning_request(prm.batch, item, [&](int q) { return __ldcg(&prm.plan[q].item_begin_s); });
  cx.rp = load_plan_cg(prm.plan + b);
  cx.split = item - cx.rp.item_begin_s;
  cx.mtile = cx.rp.mtiles;
  cx.row0 = cx.rp.rows_f;
  cx.rows = cx.rp.n * prm.heads - cx.row0;
  cx.k0 = 0;
  cx.k1 = cx.rp.p + cx.rp.n;
  cx.ntiles = (cx.rp.cells_s - cx.split + cx.rp.nsplit_s - 1) / cx.rp.nsplit_s;   // cells, some of them empty
  return cx;
}
// End of split item cx, by one thread of the kernel after a barrier that follows every store of the item's partials
// (its rows' partial O and log-sum-exp): the release that lets the combine read them (CUTLASS's generic barrier
// pattern: the writers' barrier, then one thread's gpu-scope fence and relaxed add). Nothing for an unsplit tile, or
// when done_arrivals is 0 (the combine then waits for the whole pass and reads no counter).
__device__ __forceinline__ void signal_item_done(const Params& prm, const ItemCtx& cx) {
  if (row_nsplit(cx.rp, cx.row0) <= 1 || prm.done_arrivals == 0) return;
  int* const done = prm.tile_done + tile_done_index(cx.rp, prm.heads, cx.row0);
  asm volatile("fence.acq_rel.gpu;\n"
               "red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(done) : "memory");
#ifdef KDTREE_EXP_TIMELINE
  atomicMax(&g_tile_rel[(done - prm.tile_done) % kStampTiles], global_ns());
#endif
}

// Cell t of a remainder item: keys [kb, ke) (empty when kb >= ke: past the request's last key).
__device__ __forceinline__ void rem_tile(const ItemCtx& cx, int t, int& kb, int& ke) {
  const int g = cx.split + t * cx.rp.nsplit_s;
  const int o = g / cx.rp.nsplit;
  const int s0 = (g - o * cx.rp.nsplit) * cx.rp.chunk;
  kb = s0 + o * kMixedTileN;
  ke = min(min(kb + kMixedTileN, s0 + cx.rp.chunk), cx.k1);
}

// Slot id of a prefix key (-1 otherwise): the only global load on the address path, issued one
// tile before its copy so its latency never stalls the pipeline.
__device__ __forceinline__ long long key_slot(const Params& prm, const ItemCtx& c, int key) {
  return key < c.k1 && key < c.rp.p ? load_index(prm.kv_indices, prm.kv_indices_64, (long long)c.rp.kv_begin + key) : -1;
}
__device__ __forceinline__ const __nv_bfloat16* key_ptr(const Params& prm, const ItemCtx& c, int key, long long slot) {
// profiling aid: every key copies the (L2-resident) zero row. Not a measure of delivery without DRAM at full scale:
// 132 SMs reading one 1,152-byte row meet on the same L2 lines, and the default's H16 N9 P131072 took 329 us so, not
// 115 (session 30, history 182).
#ifdef KDTREE_EXP_NO_GATHER
  return prm.zero_row;
#endif
  if (key >= c.k1) return prm.zero_row;
  if (key < c.rp.p) return prm.kv + slot * prm.kv_ss;
  return prm.k_new + (long long)(c.rp.qo_begin + key - c.rp.p) * prm.k_new_st;
}

// Is request-local key `key` (keys >= p are drafts) visible to verify token n (-1: a padding row)?
// Prefix keys inside the split are; drafts follow the tree mask (or the causal chain without one);
// padding rows see none.
__device__ __forceinline__ bool key_visible_n(const Params& prm, const ItemCtx& cx, int key, int n) {
  bool vis = key < cx.k1;
  if (vis && key >= cx.rp.p) {
    const int j = key - cx.rp.p;
    if (n < 0 || (prm.tree_mask && (j >> 6) >= prm.mask_words)) {
      // padding row; or a request longer than the mask's 64 * words columns (a caller bug the host
      // cannot see without a sync): never read past the mask row
      vis = false;
    } else if (prm.tree_mask) {
      const uint64_t w = prm.tree_mask[(long long)(cx.rp.qo_begin + n) * prm.mask_words + (j >> 6)];
      vis = (w >> (j & 63)) & 1ull;
    } else {
      vis = j <= n;
    }
  }
  return vis;
}
// The verify token of tile row r (-1: a padding row).
__device__ __forceinline__ int row_token(const ItemCtx& cx, int r, int H) {
  return r < cx.rows ? (cx.row0 + r) / H : -1;
}

// A thread's scores of a tile (16 of 32 keys; 32 of the dual kernel's 64-key pairs), as the split kernels hold them:
// key group j (8 keys) x value e (rows r0 / r0 + 8 for e < 2 / e >= 2, keys 2c / 2c + 1 of the group for even / odd e).
template <int N>
__device__ __forceinline__ float& score_at(float (&v)[N], int j, int e) { return v[4 * j + e]; }
template <int G>
__device__ __forceinline__ float& score_at(float (&v)[G][4], int j, int e) { return v[j][e]; }

// Scale the tile's scores to log2 units, mask them, and take the maxima of the thread's two rows. A plain
// tile (all prefix keys inside the split) needs no mask and takes the short path; otherwise the rows'
// verify tokens are found once and each key tested against them. Groups: the thread's n8 key groups (keys
// key0 .. key0 + 8 Groups - 1).
template <int Groups = kTileN / 8, typename Scores>
__device__ __forceinline__ void scale_mask_max(const Params& prm, const ItemCtx& cx, int H, int key0, int r0, int c,
                                               Scores& v, float (&tmax)[2]) {
  tmax[0] = tmax[1] = -INFINITY;
  const bool plain = key0 + Groups * 8 <= cx.k1 && key0 + Groups * 8 <= cx.rp.p;
  if (plain) {
#pragma unroll
    for (int j = 0; j < Groups; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& x = score_at(v, j, e);
        x *= prm.scale_log2;
        tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
      }
  } else {
    const int rn[2] = {row_token(cx, r0, H), row_token(cx, r0 + 8, H)};
#pragma unroll
    for (int j = 0; j < Groups; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& x = score_at(v, j, e);
        x = key_visible_n(prm, cx, key0 + j * 8 + 2 * c + (e & 1), rn[e >> 1]) ? x * prm.scale_log2 : -INFINITY;
        tmax[e >> 1] = fmaxf(tmax[e >> 1], x);
      }
  }
}

// A thread's row maximum reduced over its quad (the four threads that hold a row's columns).
__device__ __forceinline__ float quad_max(float m) {
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  return fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
}

// One online-softmax step for the two rows (g, g+8) of an mma / wgmma accumulator: the tile's row
// maxima (tmax, per thread) are reduced over the quad, the running maxima advance, and the factor
// that rescales what was accumulated before comes back (m_use: the max to subtract, 0 for a row
// that has seen nothing visible yet).
__device__ __forceinline__ void softmax_advance(float (&tmax)[2], float (&m_run)[2], float (&m_use)[2],
                                                float (&alpha)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    tmax[half] = quad_max(tmax[half]);
    const float m_new = fmaxf(m_run[half], tmax[half]);
    m_use[half] = m_new == -INFINITY ? 0.f : m_new;
    alpha[half] = fast_exp2(m_run[half] - m_use[half]);
    m_run[half] = m_new;
  }
}

// softmax_advance with a lazy reference for Tau > 0 (FlashAttention-4's conditional rescale; Tau 0: softmax_advance):
// m_run is the reference a row's P subtracts, and it moves to the row's maximum only when that exceeds it by more than
// Tau (log2 units; at the row's first visible key it always does), so P <= 2^Tau and alpha is exactly 1 wherever the
// reference stays.
// KDTREE_MMA_LAZY_RESCALE = Tau (0 turns it off): the mma.sync split kernel (the sm_120 path) takes it, as the dual
// kernel's KDTREE_DUAL_LAZY_RESCALE (session 27, PERF_LOG history 167). Measured on the H200 with the sm_120 depth
// (KDTREE_SPLIT_STAGES=2; A/B within one run, means of two): 8 -1.3% at H16 N9 P131072 (187.1 against 189.5 us), -2.0%
// B8, -0.3% H128 N9 P32768.
#ifndef KDTREE_MMA_LAZY_RESCALE
#define KDTREE_MMA_LAZY_RESCALE 8
#endif
static_assert(KDTREE_MMA_LAZY_RESCALE >= 0, "KDTREE_MMA_LAZY_RESCALE: 0 (off) or tau > 0");
template <int Tau>
__device__ __forceinline__ void softmax_advance_tau(float (&tmax)[2], float (&m_run)[2], float (&m_use)[2],
                                                    float (&alpha)[2]) {
  if constexpr (Tau <= 0) {
    softmax_advance(tmax, m_run, m_use, alpha);
  } else {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      tmax[half] = quad_max(tmax[half]);
      const bool keep = tmax[half] <= m_run[half] + float(Tau);   // (-inf <= -inf: nothing visible yet keeps -inf)
      const float m_new = keep ? m_run[half] : tmax[half];
      m_use[half] = m_new == -INFINITY ? 0.f : m_new;
      alpha[half] = keep ? 1.f : fast_exp2(m_run[half] - m_use[half]);
      m_run[half] = m_new;
    }
  }
}

// A warpgroup's own row sums move from its previous step's reference mu to this step's m_use: lfac is the factor that
// rescales them (softmax_p_pairs' alpha, where each of two warpgroups keeps sums of its own steps).
__device__ __forceinline__ void move_sums_reference(float (&mu)[2], const float (&m_use)[2], float (&lfac)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    lfac[half] = fast_exp2(mu[half] - m_use[half]);
    mu[half] = m_use[half];
  }
}

// The tile's P = 2^(score - m_use) for the thread's 4 x Groups scores, as bf16 pairs handed to sink(j, half, pair)
// (key group j, row r0 / r0 + 8 for half 0 / 1, keys 2c / 2c + 1), and the rows' running sums advanced:
// l = alpha * l + this thread's part of the tile's row sums.
template <int Groups = kTileN / 8, typename Scores, typename Sink>
__device__ __forceinline__ void softmax_p_pairs(Scores& v, const float (&m_use)[2], const float (&alpha)[2],
                                                float (&l_run)[2], Sink sink) {
  float psum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < Groups; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float p0 = fast_exp2(score_at(v, j, 2 * half) - m_use[half]);
      const float p1 = fast_exp2(score_at(v, j, 2 * half + 1) - m_use[half]);
      psum[half] += p0 + p1;
      sink(j, half, pack_bf16(p0, p1));
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) l_run[half] = l_run[half] * alpha[half] + psum[half];
}

// The partial log2-sum-exp of tile row r of a split request's item (-inf for a row that saw no key).
__device__ __forceinline__ void write_partial_lse(const Params& prm, const ItemCtx& cx, int H, int r, float m, float l) {
  prm.partial_lse[partial_index(cx.rp, H, cx.row0 + r, cx.split)] = l > 0.f ? m + log2f(l) : -INFINITY;
}

// The partial log2-sum-exps of a split item's rows r0 and r0 + 8 (those inside the tile), by the quad's thread c == 0.
__device__ __forceinline__ void write_partial_lse_rows(const Params& prm, const ItemCtx& cx, int H, int r0, int c,
                                                       const float (&m)[2], const float (&l)[2]) {
  if (cx.rp.nsplit > 1 && c == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + half * 8;
      if (r < cx.rows) write_partial_lse(prm, cx, H, r, m[half], l[half]);
    }
  }
}

// A thread's partial row sums of its two rows (a quad of threads holds each row's columns) reduced over the quad.
__device__ __forceinline__ void quad_sum_rows(float (&l)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
  }
}

// End of an item, score side: l (a per-thread partial) reduced over the quad, the row statistics
// stored for the value side, and for a split request the partial log2-sum-exp of each row (after
// `bar`, the barrier the value side waits on before it reads row_m / row_l).
template <typename Bar>
__device__ __forceinline__ void finish_rows(const Params& prm, const ItemCtx& cx, int H, int wrow, int g, int c,
                                            const float (&m_run)[2], float (&l_run)[2], float* row_m,
                                            float* row_l, Bar bar) {
  quad_sum_rows(l_run);
  if (c == 0) {
    row_m[wrow + g] = m_run[0];
    row_m[wrow + g + 8] = m_run[1];
    row_l[wrow + g] = l_run[0];
    row_l[wrow + g + 8] = l_run[1];
  }
  bar();
  write_partial_lse_rows(prm, cx, H, wrow + g, c, m_run, l_run);
}

// An item's result rows on their way out through shared memory (session 18): row r at r * 1 KB (512 bf16), its 16-byte
// chunk k at (k ^ (r % 8)) * 16, so that stmatrix's 8 rows of one chunk and a warp's 32 chunks of one row are free of
// bank conflicts. Value threads store their accumulators there (stmatrix), then copy whole rows out, 16 B per lane.
__device__ __forceinline__ uint32_t stage_chunk(uint32_t stage, int r, int k) {
  return stage + r * 1024 + ((k ^ (r & 7)) << 4);
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 x;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "r"(addr) : "memory");
  return x;
}

// Where tile row r of the item goes: its partial row (split requests) or the output row.
__device__ __forceinline__ __nv_bfloat16* result_row(const Params& prm, const ItemCtx& cx, int r) {
  const int rr = cx.row0 + r;
  if (row_nsplit(cx.rp, rr) > 1) return prm.partial_o + partial_index(cx.rp, prm.heads, rr, cx.split) * kDimNope;
  const int n = rr / prm.heads, h = rr - n * prm.heads;
  return prm.out + (long long)(cx.rp.qo_begin + n) * prm.out_st + (long long)h * prm.out_sh;
}

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

// Byte offset of (row, 16-byte chunk) in a P tile: chunks XOR-swizzled by (row / 2) % 4.
__device__ __forceinline__ int p_off(int row, int chunk) { return row * kTileN + ((chunk ^ ((row >> 1) & 3)) << 3); }

#ifdef KDTREE_EXP_TRACE
#define KDTREE_TRACE(e) \
  do { if (lane == 0 && it < 64) sm.trace[it][e] = clock64() - t_item; } while (0)
#else
#define KDTREE_TRACE(e) do { } while (0)
#endif

template <int Stages, typename Shape = MmaWide>
__global__ void __launch_bounds__(Shape::kThreads, 1) kdtree_verify_split_kernel(Params prm) {
  constexpr int kBlockM = Shape::kBlockM, kRowBlocks = Shape::kRowBlocks, kKeyHalves = Shape::kKeyHalves;
  constexpr int kScoreWarps = Shape::kScoreWarps, kThreads = Shape::kThreads, kGroups = Shape::kGroups;
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
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;  // mma group: row within an 8-row half
  const int c = lane & 3;   // thread in group: column pair
  grid_dependency_wait();   // the plan kernel's counter and plan
  grid_dependency_launch_dependents();   // after the wait: the combine reads the plan as soon as it starts
  const int total = prm.counter[1];
  const int vw = warp - kScoreWarps;         // value warp index (negative for score warps)
  const bool issuer = vw >= 0 && lane < kKeysPerWarp;   // threads that gather keys (kKeysPerWarp per value warp)
  const int my_key = vw * kKeysPerWarp + lane;          // an issuer's key within each tile
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
#ifdef KDTREE_EXP_TRACE
    const long long t_fetch = clock64();
#endif
    if (tid == 0) sm.item = claim_item(prm, k);
    __syncthreads();
    const int item = sm.item;
    if (item >= total) return;

    const ItemCtx cx = item_ctx<kBlockM, kTileN>(prm, item);
    const int H = prm.heads;

    // ---- prologue: tiles 0 .. Stages-1 on their way, query columns [384, 576) into shared memory ----
    // (the slot ids of tiles 0 .. Stages are loaded together first: each copy's asm orders any load
    // after it, so loading them between the copies waits one round trip per tile)
    long long slots[Stages + 1];
#pragma unroll
    for (int t = 0; t <= Stages; ++t)
      slots[t] = issuer && t < cx.ntiles ? key_slot(prm, cx, cx.k0 + t * kTileN + my_key) : -1;
    if (vw >= 0) {
#pragma unroll
      for (int t = 0; t < Stages; ++t)
        if (t < cx.ntiles) issue_tile(sm, prm, cx, t, t, vw, lane, slots[t]);
    }
    long long next_slot = slots[Stages];   // issuer lanes: slot id of the next tile to issue
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
#ifdef KDTREE_EXP_TRACE
    const long long t_item = clock64();
#endif

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
        if (warp == 0) KDTREE_TRACE(0);
        // P/alpha[b] last held tile it-Stages. Its keys' arrival already implies the value warps
        // finished with it (the refill is issued after), but that chain runs through the copy
        // engine; this barrier states the order directly (and lets racecheck see it).
        if (it >= Stages) bar_sync(kBarPEmpty + b, kThreads);
        if (warp == 0) KDTREE_TRACE(1);
        if (active) {
          float acc[kGroups][4] = {};   // this warp's n8 key tiles: independent mma chains
#ifndef KDTREE_EXP_NO_SCORE_MMA   // profiling aid: leave S at zero
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
#endif

#ifdef KDTREE_EXP_TRACE
          if (warp == 0) {   // stamp once the score product has landed in the accumulators
            if (acc[0][0] == 12345.f && acc[kGroups - 1][3] == 12345.f) sm.row_m[0] = 0.f;
            KDTREE_TRACE(2);
          }
#endif
          // ---- scale, mask, online softmax ----
          float tmax[2];
          scale_mask_max<kGroups>(prm, cx, H, cx.k0 + it * kTileN + kh * (kTileN / kKeyHalves), wrow + g, c, acc,
                                  tmax);
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
        if (warp == 0) KDTREE_TRACE(3);
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
        if (vw == 0) KDTREE_TRACE(4);
#pragma unroll
        for (int rb = 0; rb < kRowBlocks; ++rb) {
          const float a0 = sm.alpha[b][rb * 16 + g];
          const float a1 = sm.alpha[b][rb * 16 + g + 8];
          // once the running maxima settle, alpha is exactly 1 for whole row blocks: skip 32 FMULs
          if (rb < rblocks && !__all_sync(0xffffffffu, a0 == 1.f && a1 == 1.f)) {
#pragma unroll
            for (int nt = 0; nt < kValueCols / 8; ++nt) {
              o[rb][nt][0] *= a0;
              o[rb][nt][1] *= a0;
              o[rb][nt][2] *= a1;
              o[rb][nt][3] *= a1;
            }
          }
        }
#ifndef KDTREE_EXP_NO_PV_MMA   // profiling aid: skip P V
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
#endif
#ifdef KDTREE_EXP_TRACE
        if (vw == 0) {   // stamp once P V has landed in the accumulators
          if (o[0][0][0] == 12345.f && o[0][7][3] == 12345.f) sm.row_l[0] = 0.f;
          KDTREE_TRACE(5);
        }
#endif
        if (it + Stages < cx.ntiles) bar_arrive(kBarPEmpty + b, kThreads);   // P/alpha[b] free for tile it+Stages
        // every value warp is done with buffer b (the score warps finished it before publishing P):
        // refill it with tile it+Stages
        bar_sync(kBarValues, kValueWarps * 32);
        if (vw == 0) KDTREE_TRACE(6);
        if (it + Stages < cx.ntiles) {
          issue_tile(sm, prm, cx, it + Stages, b, vw, lane, next_slot);
          if (issuer && it + Stages + 1 < cx.ntiles)
            next_slot = key_slot(prm, cx, cx.k0 + (it + Stages + 1) * kTileN + my_key);
        }
        if (vw == 0) KDTREE_TRACE(7);
      }
      bar_sync(kBarBlock, kThreads);  // row_m / row_l written by the score warps (which only arrive)
#pragma unroll
      for (int rb = 0; rb < kRowBlocks; ++rb) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = rb * 16 + g + half * 8;
          if (r >= cx.rows) continue;
          const float l = sm.row_l[r];
          const float inv = l > 0.f ? 1.f / l : 0.f;
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
#ifdef KDTREE_EXP_TRACE
    if (tid == 0 && blockIdx.x < 2) {
      printf("TRACE block %d item %d tiles %d prologue %lld total %lld\n", blockIdx.x, item, cx.ntiles,
             t_item - t_fetch, clock64() - t_item);
      for (int it = 0; it < min(cx.ntiles, 64); ++it)
        printf("TRACE block %d item %d it %2d | %6lld %6lld %6lld %6lld | %6lld %6lld %6lld %6lld\n", blockIdx.x, item, it,
               sm.trace[it][0], sm.trace[it][1], sm.trace[it][2], sm.trace[it][3], sm.trace[it][4], sm.trace[it][5],
               sm.trace[it][6], sm.trace[it][7]);
    }
    __syncthreads();
#endif
  }
  }
}

// ---------------------------------------------------------------------------------------------
// Combine: per (verify token, head) row of a request that was split and per column slice (blocks
// stride over rows x the largest slice count of any row), fixed split order. A row with many splits
// is cut into up to kCombineMaxSlices slices of value columns, so a short request's few rows do not
// leave the GPU idle (H16 N1 P131072: 16 rows x 264 splits in 16 blocks took 16 us); a row with few
// splits takes one block (its unused slices are skipped iterations of the stride). The block's
// 4 x slices groups of threads each take every (4 x slices)-th split (16 bytes of partial O per thread
// and its log-sum-exp): up to kCombineBatch splits per thread are loaded together (one memory round trip
// for up to 32 x kCombineBatch splits; session 7: the dependent load phases of the earlier version took
// ~7 us in a graph, this one ~5), summed against the thread's own running maximum, then rescaled to the block maximum and
// summed over the groups in a fixed order. The slice count comes from the row's own split count:
// batch-invariant, deterministic.
// ---------------------------------------------------------------------------------------------
constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kCombineAcc = 4 * kDimNope;   // floats of group sums: (4 x slices) groups x (512 / slices) columns
// Blocks per SM the combine asks for (registers: <= 64 / 80 / 128): 4 with batch 8 on sm_90 (as
// measured), 3 on sm_120 (where the work before session 35 spilled at 64 registers; today's takes 72 there and would
// fit 64, but 4 blocks an SM have not been measured on an sm_120 GPU), 2 with batch 16.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int kCombineMinBlocks = kCombineBatch == 8 ? 3 : 2;
#else
constexpr int kCombineMinBlocks = kCombineBatch == 8 ? 4 : 2;
#endif

// Block-wide max in a fixed tree order (deterministic); every thread gets the result.
__device__ __forceinline__ float combine_block_max(float v, float* s_red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();   // s_red of an earlier reduction has been read
  if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = s_red[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) v = fmaxf(v, s_red[w]);
  return v;
}

// A combine work of request-local row r (nsplit splits) waits, in one thread, until every split item of the row's tile
// has stored its partials (acquire: the block barrier after it orders the block's loads of them). A wait that outlasts
// kDoneWaitNs can only be a broken count: it traps (a launch error) rather than hang the GPU.
constexpr unsigned long long kDoneWaitNs = 30ull * 1000 * 1000 * 1000;
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int n;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(n) : "l"(p) : "memory");
  return n;
}
// Spins (acquire) until counter *done reaches target.
__device__ __forceinline__ void spin_until_done(const int* done, int target) {
  const unsigned long long t0 = global_ns();
  int n;
  do {
    __nanosleep(128);
    n = ld_acquire_gpu(done);
    if (n < target && global_ns() - t0 > kDoneWaitNs) __trap();
  } while (n < target);
}
// The works of row r's tile: its rows times the slices of each (every one passes its tile wait once per call).
__device__ __forceinline__ int tile_works(const Params& prm, const ReqPlan& rp, int r, int slices) {
  const int row0 = tile_row0(rp, prm.block_m, r);
  const int rows = row0 < rp.rows_f ? min(prm.block_m, rp.rows_f - row0) : rp.n * prm.heads - rp.rows_f;
  return rows * slices;
}

// One work of the combine: value-column slice `slice` of 2^S of request-local row r (global row gr = t * H + h), its
// nsplit partials merged in a fixed order. Session 35 (history 193-195): every shape of the work (columns, thread
// groups, the group sums) is a compile-time constant, a thread's loads are one base and immediate offsets (a row's
// splits adjacent), and the tile counter's acquire is in flight while the addresses are computed. The work before it
// took ~4 us at the call's tail, most of it the latency of ~1,000 dependent instructions (64-bit index divisions,
// divisions by the run-time slice shape, a 64-bit address product per split); the sums and their order are the same
// (bit-identical output on every benchmark shape).
template <int S>
__device__ __forceinline__ void combine_work(const Params& prm, const ReqPlan& rp, int r, int nsplit, int t, int h,
                                             int slice, bool early, int w, float* s_acc, float* s_wsum, float* s_red,
                                             long long* s_tile) {
  constexpr int kCols = kDimNope >> S;                 // value columns of this work
  constexpr int kLanes = kCols / 8;                    // threads per split row (8 columns each)
  constexpr int kGroups = kCombineThreads / kLanes;    // thread groups, each taking every kGroups-th split
  const int tid = threadIdx.x;
  const int grp = tid / kLanes;
  const int lcol = (tid % kLanes) * 8;                 // within the slice
  // the tile's counter: its acquire in flight while the addresses are computed
  long long tile = 0;
  int target = 0, seen = 0;
  if (early && tid == 0) {
    tile = tile_done_index(rp, prm.heads, tile_row0(rp, prm.block_m, r));
    target = nsplit * prm.done_arrivals;
    seen = ld_acquire_gpu(prm.tile_done + tile);
  }
  const long long prow = partial_index(rp, prm.heads, r, grp);   // the group's first split (the next: kGroups on)
  const float* lse = prm.partial_lse + prow;
  const __nv_bfloat16* src = prm.partial_o + prow * kDimNope + slice * kCols + lcol;
  const int left = nsplit - grp;                       // this group's splits: k * kGroups < left
  // the thread's output pair (the threads 2 * tid < kCols store one each), so that t, h and slice are not kept
  __nv_bfloat16* const dst = prm.out + (long long)t * prm.out_st + (long long)h * prm.out_sh + slice * kCols + 2 * tid;
  if (early) {   // the row tile's split items have all stored their partials
    if (tid == 0) {
      if (seen < target) spin_until_done(prm.tile_done + tile, target);
      s_tile[0] = tile;
      s_tile[1] = tile_works(prm, rp, r, 1 << S);   // (for the end of the work, kept out of registers)
    }
    __syncthreads();
  }
  if (w == blockIdx.x) KDTREE_TIMELINE_LATEST(0);
  KDTREE_WORK_STAMP(w, 1);
#ifdef KDTREE_EXP_TIMELINE
  if (tid == 0 && w < kStampWorks) g_work_tile[w] = early ? s_tile[0] : -1;
#endif
  float m_run = -INFINITY, wsum = 0.f;
  float acc[8] = {};
  KDTREE_WORK_STAMP_AFTER(w, 4, (unsigned)(uintptr_t)src ^ (unsigned)prow);
  // once for <= 32 << S splits: always, but with 2^3 slices (a row of more than 256 splits)
  constexpr int kBatchSplits = S < 3 ? 1 << 30 : kGroups * kCombineBatch;
  static_assert(S == 3 || kGroups * kCombineBatch >= (4 * kCombineBatch) << S, "one batch takes every split");
  for (int base = 0; base < left; base += kBatchSplits) {
    float l[kCombineBatch];
    uint4 v[kCombineBatch];
#pragma unroll
    for (int k = 0; k < kCombineBatch; ++k) {
      const bool in = base + k * kGroups < left;
      // (from L2: written by other SMs during this kernel when it started early; immediate offsets from one base)
      l[k] = in ? __ldcg(lse + k * kGroups) : -INFINITY;
      v[k] = in ? __ldcg(reinterpret_cast<const uint4*>(src + k * kGroups * kDimNope)) : make_uint4(0, 0, 0, 0);
    }
    lse += kCombineBatch * kGroups;
    src += kCombineBatch * kGroups * kDimNope;
#ifdef KDTREE_EXP_TIMELINE
    if (base == 0) {   // the first batch's loads have landed
      unsigned dep = 0;
#pragma unroll
      for (int k = 0; k < kCombineBatch; ++k) dep ^= __float_as_uint(l[k]) ^ v[k].w;
      KDTREE_WORK_STAMP_AFTER(w, 5, dep);
    }
#endif
    float m_new = m_run;
#pragma unroll
    for (int k = 0; k < kCombineBatch; ++k) m_new = fmaxf(m_new, l[k]);
    if (m_new == -INFINITY) continue;   // nothing visible yet (group-uniform)
    const float sc = exp2f(m_run - m_new);   // 0 on the first visible batch (acc and wsum are 0 then)
    wsum *= sc;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= sc;
#pragma unroll
    for (int k = 0; k < kCombineBatch; ++k) {
      const float wk = exp2f(l[k] - m_new);
      wsum += wk;
      const __nv_bfloat162* pv = reinterpret_cast<const __nv_bfloat162*>(&v[k]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(pv[q]);
        acc[2 * q] += wk * f.x;
        acc[2 * q + 1] += wk * f.y;
      }
    }
    m_run = m_new;
  }
  if (w == blockIdx.x) KDTREE_TIMELINE_LATEST(1);
  KDTREE_WORK_STAMP(w, 2);
  // to the block maximum, then the groups' sums in a fixed order
  const float m_blk = combine_block_max(m_run, s_red);
  const float sc = m_run == -INFINITY ? 0.f : exp2f(m_run - m_blk);
#pragma unroll
  for (int i = 0; i < 8; ++i) s_acc[grp * kCols + lcol + i] = acc[i] * sc;
  if (lcol == 0) s_wsum[grp] = wsum * sc;
  __syncthreads();
  if (2 * tid < kCols) {   // one bf16 pair a thread, groups in fixed order
    float wtot = 0.f;
#pragma unroll
    for (int q = 0; q < kGroups; ++q) wtot += s_wsum[q];
    const float inv = wtot > 0.f ? 1.f / wtot : 0.f;
    const int c = 2 * tid;
    float v0 = 0.f, v1 = 0.f;
#pragma unroll
    for (int q = 0; q < kGroups; ++q) {
      v0 += s_acc[q * kCols + c];
      v1 += s_acc[q * kCols + c + 1];
    }
    *reinterpret_cast<uint32_t*>(dst) = pack_bf16(v0 * inv, v1 * inv);
  }
  if (w == blockIdx.x) KDTREE_TIMELINE_LATEST(2);
  KDTREE_WORK_STAMP(w, 3);
  // the work counts itself among its tile's, and the tile's last work zeroes both counters for the next call
  if (early && tid == 0) {
    const long long tl = s_tile[0];
    if (atomicAdd(prm.tile_seen + tl, 1) == s_tile[1] - 1) {
      prm.tile_done[tl] = 0;
      prm.tile_seen[tl] = 0;
    }
  }
}

__global__ void __launch_bounds__(kCombineThreads, kCombineMinBlocks) kdtree_verify_combine_kernel(Params prm) {
  __shared__ float s_acc[kCombineAcc];
  __shared__ float s_wsum[kCombineThreads];   // per thread group: its weight sum at the block maximum
  __shared__ float s_red[kCombineWarps];
  __shared__ long long s_tile[2];   // the work's tile: its counter index and its work count
  KDTREE_TIMELINE(3, 0);
  // With done_arrivals, the combine starts while the split pass still runs: its blocks are scheduled once every split
  // block has passed its own wait for the plan kernel (the split kernels let their dependents launch only then), so
  // the plan is complete, and each work waits only for its own row tile's items (tile_done); the wait for the whole
  // split pass comes at the end, so that this kernel's completion still implies the split pass's. Without them
  // (a split kernel that signals nothing), the whole split pass first.
  const bool early = prm.done_arrivals > 0;
  if (!early) grid_dependency_wait();      // the split pass's partials (programmatic launch)
  KDTREE_TIMELINE(3, 1);
  const int tid = threadIdx.x;
  // the split pass is over: reset its work counter, so that the next call on this workspace may run on
  // the same plan without the plan kernel (kdtree_verify_params.reuse_plan)
  auto reset_work_counters = [&] {
    if (blockIdx.x == 0 && tid == 0) {
      prm.counter[0] = 0;
      prm.counter[4] = 0;   // the skinny items' work counter (mixed calls)
    }
  };
  if (!early) reset_work_counters();
  // work w = (column slice, global row), slice-major: a grid of about one wave strides over them, the
  // works in use (slice < the row's slice count) come first, and the slices a row does not use cost
  // a skipped iteration, not a launched block
  // 32-bit: the host bounds rows * kCombineMaxSlices (and so every w of the loop) below 2^30
  const unsigned rows = (unsigned)prm.num_tokens * (unsigned)prm.heads;
  for (unsigned w = blockIdx.x;; w += gridDim.x) {   // block-uniform
    const unsigned slice = w / rows;
    const unsigned gr = w - slice * rows;   // global row = t * H + h
    const int t = (int)(gr / (unsigned)prm.heads), h = (int)gr - t * prm.heads;
    // the loop bound (counter[2]: the largest slice count of any row) and the work's plan, loaded side by side
    const unsigned max_slices = (unsigned)prm.counter[2];
    const ReqPlan rp = prm.plan[owning_request(prm.batch, t, [&](int b) { return prm.plan[b].qo_begin; })];
    if (slice >= max_slices) break;                                                 // block-uniform
    if (t < rp.qo_begin || t >= rp.qo_begin + rp.n) continue;                      // block-uniform
    const int r = (t - rp.qo_begin) * prm.heads + h;
    const int nsplit = row_nsplit(rp, r);   // the row's own kind: split kernel rows or a skinny remainder's
    if (nsplit <= 1) continue;                                                      // block-uniform
    const int sl = combine_slices_log2(nsplit);
    if (slice >= (1u << sl)) continue;                                              // block-uniform
    KDTREE_WORK_STAMP(w, 0);
    switch (sl) {
      case 0: combine_work<0>(prm, rp, r, nsplit, t, h, (int)slice, early, (int)w, s_acc, s_wsum, s_red, s_tile); break;
      case 1: combine_work<1>(prm, rp, r, nsplit, t, h, (int)slice, early, (int)w, s_acc, s_wsum, s_red, s_tile); break;
      case 2: combine_work<2>(prm, rp, r, nsplit, t, h, (int)slice, early, (int)w, s_acc, s_wsum, s_red, s_tile); break;
      default: combine_work<3>(prm, rp, r, nsplit, t, h, (int)slice, early, (int)w, s_acc, s_wsum, s_red, s_tile); break;
    }
  }
  if (early) {
    grid_dependency_wait();   // the split pass's completion (this kernel's then implies it)
    reset_work_counters();
  }
#ifdef KDTREE_EXP_TIMELINE
  KDTREE_TIMELINE(3, 2);
  __threadfence();
  if (threadIdx.x == 0 && atomicAdd(&g_timeline_done, 1u) == gridDim.x - 1) {
    unsigned long long t0 = ~0ull;
    for (int k = 0; k < 4; ++k) t0 = min(t0, g_timeline[k][0]);
    // -1: a kernel that did not run (the mask pack when the call packs its own mask)
    auto us = [&](unsigned long long t) { return t == ~0ull || t == 0 ? -1.0 : (double)(t - t0) * 1e-3; };
    printf("TIMELINE us from the first start: mask %.2f %.2f %.2f | plan %.2f %.2f %.2f | split %.2f %.2f %.2f | combine %.2f %.2f %.2f"
           " (latest plan read %.2f, summed %.2f, stored %.2f)\n",
           us(g_timeline[0][0]), us(g_timeline[0][1]), us(g_timeline[0][2]),
           us(g_timeline[1][0]), us(g_timeline[1][1]), us(g_timeline[1][2]),
           us(g_timeline[2][0]), us(g_timeline[2][1]), us(g_timeline[2][2]),
           us(g_timeline[3][0]), us(g_timeline[3][1]), us(g_timeline[3][2]),
           us(g_timeline[4][0]), us(g_timeline[4][1]), us(g_timeline[4][2]));
    // the works: how long each waited past its tile's release, loaded and summed, stored; the latest six in full
    {
      const long long rows = (long long)prm.num_tokens * prm.heads, nw = min(rows * prm.counter[2], (long long)kStampWorks);
      double s_wait = 0, s_sum = 0, s_store = 0, m_wait = 0, m_sum = 0, m_store = 0, s_sum2 = 0, m_sum2 = 0;
      double s_addr = 0, s_land = 0, s_math = 0, m_addr = 0, m_land = 0, m_math = 0;   // summing's three parts
      int n = 0, n2 = 0, n3 = 0;
      long long last[6] = {-1, -1, -1, -1, -1, -1};
      for (long long w = 0; w < nw; ++w) {
        if (g_work[w][3] == 0 || g_work[w][1] < g_work[w][0]) continue;   // skipped (an unsplit row, an unused slice)
        const long long tile = g_work_tile[w];
        const unsigned long long rel = tile >= 0 ? g_tile_rel[tile % kStampTiles] : g_work[w][0];
        const unsigned long long from = max(rel, g_work[w][0]);
        const double dw = g_work[w][1] > from ? (g_work[w][1] - from) * 1e-3 : 0.0;
        const double ds = (g_work[w][2] - g_work[w][1]) * 1e-3, dt = (g_work[w][3] - g_work[w][2]) * 1e-3;
        s_wait += dw; s_sum += ds; s_store += dt; ++n;
        if (g_work[w][4] >= g_work[w][1] && g_work[w][5] >= g_work[w][4] && g_work[w][2] >= g_work[w][5]) {
          const double da = (g_work[w][4] - g_work[w][1]) * 1e-3, dl = (g_work[w][5] - g_work[w][4]) * 1e-3,
                       dm = (g_work[w][2] - g_work[w][5]) * 1e-3;
          s_addr += da; s_land += dl; s_math += dm; ++n3;
          m_addr = fmax(m_addr, da); m_land = fmax(m_land, dl); m_math = fmax(m_math, dm);
        }
        if (w >= gridDim.x) { s_sum2 += ds; m_sum2 = fmax(m_sum2, ds); ++n2; }   // a block's second or later work
        m_wait = fmax(m_wait, dw); m_sum = fmax(m_sum, ds); m_store = fmax(m_store, dt);
        for (int j = 0; j < 6; ++j)   // insertion into the six latest stored
          if (last[j] < 0 || g_work[w][3] > g_work[last[j]][3]) {
            for (int k = 5; k > j; --k) last[k] = last[k - 1];
            last[j] = w;
            break;
          }
      }
      if (n > 0)
        printf("TIMELINE works %d: us past the tile's release to the wait's end mean %.2f max %.2f | summing mean %.2f max "
               "%.2f | storing mean %.2f max %.2f | summing in a block's later works (%d) mean %.2f max %.2f\n", n, s_wait / n,
               m_wait, s_sum / n, m_sum, s_store / n, m_store, n2, n2 ? s_sum2 / n2 : 0.0, m_sum2);
      if (n3 > 0)
        printf("TIMELINE summing in parts (%d works): wait's end to addresses mean %.2f max %.2f | to the first batch "
               "landed mean %.2f max %.2f | to summed mean %.2f max %.2f\n", n3, s_addr / n3, m_addr, s_land / n3, m_land,
               s_math / n3, m_math);
      for (int j = 0; j < 6 && last[j] >= 0; ++j) {
        const long long w = last[j], tile = g_work_tile[w];
        printf("TIMELINE work %lld (tile %lld): released %.2f | start %.2f waited %.2f addresses %.2f landed %.2f summed %.2f"
               " stored %.2f\n", w, tile,
               tile >= 0 ? (double)(g_tile_rel[tile % kStampTiles] - t0) * 1e-3 : -1.0, (double)(g_work[w][0] - t0) * 1e-3,
               (double)(g_work[w][1] - t0) * 1e-3, (double)(g_work[w][4] - t0) * 1e-3, (double)(g_work[w][5] - t0) * 1e-3,
               (double)(g_work[w][2] - t0) * 1e-3, (double)(g_work[w][3] - t0) * 1e-3);
      }
      if (g_item_store[2])
        printf("TIMELINE split items %llu: storing O to the barrier after it mean %.2f max %.2f us\n", g_item_store[2],
               g_item_store[1] * 1e-3 / g_item_store[2], g_item_store[0] * 1e-3);
      g_item_store[0] = g_item_store[1] = g_item_store[2] = 0;
      for (long long w = 0; w < kStampWorks; ++w)
        for (int e = 0; e < 6; ++e) g_work[w][e] = 0;
      for (int i = 0; i < kStampTiles; ++i) g_tile_rel[i] = 0;
    }
    for (int k = 0; k < 4; ++k) { g_timeline[k][0] = g_timeline[k][1] = ~0ull; g_timeline[k][2] = 0; }
    g_timeline[4][0] = g_timeline[4][1] = g_timeline[4][2] = 0;
    g_timeline_done = 0;
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Tree-mask packing from SGLang's flat custom_mask: one thread per (verify token, 64-bit word).
// ---------------------------------------------------------------------------------------------
__global__ void kdtree_pack_tree_mask_kernel(const uint8_t* custom_mask, const int64_t* mask_indptr,
                                             const void* qo_indptr, int qo64, const int32_t* kv_indptr,
                                             int batch, int num_tokens, uint64_t* out, int words) {
  KDTREE_TIMELINE(0, 0);
  grid_dependency_launch_dependents();
  grid_dependency_wait();   // custom_mask and the indptr arrays come from earlier work on the stream
  KDTREE_TIMELINE(0, 1);
  KDTREE_TIMELINE(0, 2);   // (the start of the last block to run: its few loads and store follow)
  pack_tree_mask_word(custom_mask, mask_indptr, qo_indptr, qo64, kv_indptr, batch, num_tokens, out, words,
                      (long long)blockIdx.x * blockDim.x + threadIdx.x);
}

}  // namespace kdtree
