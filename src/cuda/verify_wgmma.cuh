// verify_wgmma.cuh: the sm_90a split pass (wgmma), same work items, plan, partials and combine as the
// mma.sync kernel in verify_kernel.cuh, which every other architecture (sm_120 included) runs.
//
// Design (numbers in docs/PERF_LOG.md):
// - A work item is (request, split, 64-row tile): rows r = n * H + h as in the mma.sync kernel, but
//   one wgmma M of 64 rows per item, and 32-key tiles.
// - 3 warpgroups (168 registers each, one CTA per SM):
//     WG0 "score": S = Q K^T as 36 wgmma m64n32k16 with both operands in shared memory (q is
//       loaded once per item), then the online softmax in registers; P (bf16) and the per-row
//       rescale go to shared memory.
//     WG1, WG2 "value": each owns 256 of the 512 value columns for all 64 rows (128 fp32 per
//       thread) and runs O = alpha * O + P V as 2 wgmma m64n256k16 (A = P, B = the same key tile read
//       MN-major: V is the first 512 columns of the latent row). They also gather the keys.
// - All shared operands use the 128-byte swizzled K-major layout: a matrix of R rows x 576 columns
//   is 9 slabs of 64 columns, [slab][row][128 B], 16-byte chunk c of row r stored at c ^ (r % 8).
// - Keys are gathered with cp.async, 16 bytes per copy, straight into that layout; 4 stages
//   (144 KB). Each value thread follows its copies of a tile with cp.async.mbarrier.arrive.noinc, so
//   a tile announces itself on its mbarrier when it has landed; readers wait on the mbarrier and
//   fence the tile into the async proxy before their wgmma.
// - The score warpgroup keeps two S accumulators: S of tile i+1 is in flight on the tensor cores
//   while it runs the softmax of tile i, its 36 wgmma issued in pieces between the softmax's parts.
// - P / alpha hand-off, per tile: the score WG stores them, arrives on the p_full mbarrier (release)
//   and on named barrier kBarPFull; the value WGs sleep in bar.sync on kBarPFull, then wait on p_full
//   (acquire, complete by then). They give P back through the p_empty mbarrier. The mbarriers carry
//   the memory order (compute-sanitizer racecheck does not accept bar.arrive -> bar.sync as publishing
//   the alpha stores); the named barrier only saves the value WGs from spinning (13% at H16 N9).
#pragma once

#include <type_traits>

#include "verify_kernel.cuh"

namespace kdtree {
namespace wg {

constexpr int kBlockM = 64;                 // one wgmma M
// Experiment switch (session 7, PERF_LOG next step 0): KDTREE_WG_Q16=1 makes work items of 16 rows (q in
// 18 KB instead of 72 KB) and gives the freed shared memory to a fifth key stage. The wgmma still computes
// 64 rows: rows 16-63 read whatever follows each 2 KB q slab (other slabs, then the key ring: finite
// values) and are discarded (padding rows). For H*N <= 16 requests (N1) only: larger requests get 16-row
// items, correct but reading every key once per 16 rows.
#ifndef KDTREE_WG_Q16
#define KDTREE_WG_Q16 0
#endif
constexpr int kItemRows = KDTREE_WG_Q16 ? 16 : kBlockM;   // rows per work item (the plan's block_m)
constexpr int kTileN = 32;                  // keys per pipeline tile
static_assert(kTileN == kdtree::kTileN, "scale_mask_max (shared with the mma.sync kernel) takes 32-key tiles");
// Experiment switch (session 7, history 54): the key ring's depth (4 fills the 227 KB with q's 72 KB;
// KDTREE_WG_Q16 frees room for a fifth)
#ifndef KDTREE_WG_STAGES
#define KDTREE_WG_STAGES (KDTREE_WG_Q16 ? 5 : 4)
#endif
constexpr int kStages = KDTREE_WG_STAGES;
static_assert(kStages >= 2 && kStages <= (KDTREE_WG_Q16 ? 5 : 4), "key stages that fit beside q");
constexpr int kThreads = 384;               // 3 warpgroups
constexpr int kSlabDims = 64;               // bf16 per 128-byte swizzle row
constexpr int kSlabs = kDimQK / kSlabDims;  // 9
constexpr int kSlabBytes = kTileN * 128;    // 4,096: one 64-column slab of a key tile
constexpr int kTileBytes = kSlabs * kSlabBytes;  // 36,864
constexpr int kQSlabBytes = kItemRows * 128;  // 8,192: one 64-column slab of q (2,048 with KDTREE_WG_Q16)
constexpr int kChunksPerKey = kKeyBytes / 16;    // 72
constexpr int kValueThreads = 256;
constexpr int kThreadsPerKey = kValueThreads / kTileN;       // 8: thread vt copies chunk vt % 8 of each slab
constexpr int kChunksPerThread = kChunksPerKey / kThreadsPerKey;  // 9
constexpr int kKSteps = kDimQK / 16;        // 36
constexpr int kPvSteps = kTileN / 16;       // 2
// S of the next tile is issued in this many pieces between the parts of the current tile's softmax
// (1: all 36 wgmma first, as up to session 4)
#ifndef KDTREE_WG_S_PIECES
#define KDTREE_WG_S_PIECES 3
#endif
constexpr int kSPieces = KDTREE_WG_S_PIECES;
// The start-up of an item (session 8, history 68): the value WGs gather the first KDTREE_WG_Q_FIRST tiles,
// then wait until the item's q has landed before they ask for the rest of the ring, so that q and the first
// tiles are not queued behind the whole ring (every SM asks for 72 KB of q and four 36 KB tiles at once: q
// landed ~10,000 clocks into the item at 8k, history 65). 2: -0.3..-3.7 us (0.6-1.5%, N1 2.4%) on the six
// shapes measured in one run, 1 about as much; kStages: no wait (the session-7 kernel).
#ifndef KDTREE_WG_Q_FIRST
#define KDTREE_WG_Q_FIRST (KDTREE_WG_STAGES < 2 ? KDTREE_WG_STAGES : 2)
#endif
constexpr int kQFirst = KDTREE_WG_Q_FIRST;
static_assert(kQFirst >= 1 && kQFirst <= kStages, "tiles asked for before q has landed: 1 .. kStages");
static_assert(kSPieces >= 1 && kSPieces <= 3, "S pieces: 1, 2 or 3");
constexpr int kSCut1 = kKSteps / kSPieces;                       // k-steps [0, kSCut1) before the softmax
constexpr int kSCut2 = kSPieces == 3 ? 2 * kKSteps / 3 : kSCut1;  // [kSCut1, kSCut2) after the row maxima

// Named barriers (0 is __syncthreads).
constexpr int kBarBlock = 1;
constexpr int kBarPFull = 2;    // score WG arrives, value WGs wait: wake-up for P/alpha (p_full orders them)
constexpr int kBarValues = 4;   // the two value WGs: the key tile consumed, may refill
constexpr int kBarScore = 5;    // the score WG: q of the item in shared memory

static_assert(kKSteps * 16 == kDimQK && kTileN % 16 == 0, "whole k16 steps");
static_assert(kThreadsPerKey == 8 && kChunksPerThread == kSlabs, "a gather thread copies one chunk per slab");

struct Smem {
  unsigned char q[kSlabs * kQSlabBytes];   // 73,728: q of the item (the struct sits on a 1 KB boundary)
  unsigned char kv[kStages][kTileBytes];   // 147,456
  unsigned char p[kBlockM * 128];          // P: [row][32 keys in a 128-byte row], swizzled (K-major A)
  float alpha[kBlockM];
  float row_m[kBlockM];
  float row_l[kBlockM];
  unsigned long long full[kStages];   // tile landed: 256 arrivals, one per value thread's copies
  unsigned long long p_full;          // P / alpha published: 128 score-thread arrivals (release, RAW)
  unsigned long long p_empty;         // P / alpha consumed: 256 value-thread arrivals (release, WAR)
  unsigned long long q_full;          // q of the item landed: 128 score-thread arrivals (KDTREE_WG_Q_FIRST)
  int item;
#ifdef KDTREE_EXP_TRACE   // profiling aid: per-tile clock stamps (32-bit deltas) of warp 0 and warp 4
  unsigned trace[32][8];
#endif
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;   // + room to align the base to 1 KB
static_assert(kSmemBytes <= 232448, "sm_90 gives a block at most 227 KB of shared memory");
static_assert(kSlabBytes % 1024 == 0 && kQSlabBytes % 1024 == 0, "swizzle atoms stay 1 KB aligned");
static_assert(kSlabs * kQSlabBytes + 6 * 1024 <= kSlabs * kQSlabBytes + kStages * kTileBytes,
              "rows past a short q tile are read inside the struct");

// Shared-memory matrix descriptor, 128-byte swizzle (start address, leading and stride byte offsets),
// kept as its two 32-bit halves so that a step through a tile is one add on the low half: at(off) is
// the descriptor of the base address + off. The 14-bit start-address field never carries into the
// next field (the shared window is below 256 KB).
struct SmemDesc {
  uint32_t lo, hi;
  __device__ __forceinline__ SmemDesc(uint32_t saddr, uint32_t lbo, uint32_t sbo)
      : lo(((saddr & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16)), hi(((sbo & 0x3FFFF) >> 4) | (1u << 30)) {}
  __device__ __forceinline__ uint64_t at(uint32_t byte_off) const {
    return ((uint64_t)hi << 32) | (uint64_t)(lo + (byte_off >> 4));
  }
};

// Shared-memory descriptor of a K-major operand in the 64-byte swizzle (8 rows x 64 B atoms, SBO 512): P of the
// pingpong and dual kernels (32 keys per row).
__device__ __forceinline__ uint64_t desc_sw64(uint32_t saddr) {
  const uint32_t lo = ((saddr & 0x3FFFF) >> 4) | (1u << 16);   // LBO unused for swizzled K-major: 1
  const uint32_t hi = (512u >> 4) | (2u << 30);                // SBO 512 B, layout type 2 (64-byte swizzle)
  return ((uint64_t)hi << 32) | lo;
}

// The kernel's shared-memory struct at the first 1 KB boundary of the dynamic shared memory (the swizzle
// atoms need a 1 KB aligned base; an offset within the shared window, so the address space is kept).
template <class SmemT>
__device__ __forceinline__ SmemT& smem_1k(unsigned char* raw) {
  return *reinterpret_cast<SmemT*>(raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u));
}

// setmaxnreg from the launch's LaunchRegs registers per thread to Regs: .inc to grow, .dec to shrink (a .dec to more
// than the warp holds is an illegal instruction; the trans kernel's score warpgroup once did that).
template <int Regs, int LaunchRegs>
__device__ __forceinline__ void set_max_regs() {
  static_assert(Regs != LaunchRegs && Regs % 8 == 0 && Regs >= 24 && Regs <= 256, "setmaxnreg: 24..256, by 8");
  if constexpr (Regs > LaunchRegs)
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
  else
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// until at most N of the warp's latest committed wgmma groups are in flight
template <int N>
__device__ __forceinline__ void wg_wait_group() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// D[64 x 32] (+)= A[64 x 16] (shared memory, K-major) * B[16 x 32] (shared memory, K-major), fp32 accumulate.
__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The same product with A from registers: warp w of the warpgroup holds rows 16 w .. 16 w + 15 in mma.m16n8k16's A
// fragment layout (the dual kernel's q, KDTREE_DUAL_QREG)
__device__ __forceinline__ void wgmma_m64n32k16_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t desc_b,
                                                   int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// D[64 x 64] (+)= A[64 x 16] (shared memory, K-major) * B[16 x 64] (shared memory, K-major), fp32 accumulate: the
// dual kernel's S over a pair of 32-key buffers (KDTREE_SPLIT_KERNEL=pair).
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, "
      "1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64 x 256] (+)= A[64 x 16] (shared memory, K-major) * B[16 x 256] (shared memory, MN-major), fp32 accumulate.
__device__ __forceinline__ void wgmma_m64n256k16_ss_bt(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64 x 128] (+)= A[64 x 16] (shared memory, K-major) * B[16 x 128] (shared memory, MN-major), fp32 accumulate:
// half of the P V product above, for kernels of four warpgroups (512 threads cap ptxas at 128 registers per
// instruction, and m64n256k16 needs 154; after setmaxnreg the two halves' 128 accumulators fit, verify_dual.cuh).
__device__ __forceinline__ void wgmma_m64n128k16_ss_bt(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1, 0, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b));
}

// q of a work item into shared memory by asynchronous copies (all in flight at once): Rows rows (64, or the
// skinny kernel's 16) x 72 chunks of 16 bytes in the 128-byte swizzled K-major layout (9 slabs of Rows x 128 B),
// zeros for padding rows, thread `tid` of `nthreads` taking every nthreads-th chunk. The caller waits for its copies.
template <int Rows = kItemRows>
__device__ __forceinline__ void issue_q_copies(const Params& prm, const ItemCtx& cx, int H, unsigned char* q, int tid,
                                               int nthreads) {
  constexpr int kRowsSlabBytes = Rows * 128;
  for (int i = tid; i < Rows * kChunksPerKey; i += nthreads) {
    const int r = i / kChunksPerKey, ch = i - r * kChunksPerKey;
    const __nv_bfloat16* src = prm.zero_row;   // padding rows: zero-filled, nothing read
    if (r < cx.rows) {
      const int rr = cx.row0 + r;
      const long long t = cx.rp.qo_begin + rr / H, h = rr % H;
      const int d = ch * 8;
      src = d < kDimNope ? prm.q_nope + t * prm.q_nope_st + h * prm.q_nope_sh + d
                         : prm.q_pe + t * prm.q_pe_st + h * prm.q_pe_sh + (d - kDimNope);
    }
    cp_async_16z(smem_u32(&q[(ch >> 3) * kRowsSlabBytes + r * 128 + (((ch & 7) ^ (r & 7)) << 4)]), src,
                 r < cx.rows ? 16 : 0);
  }
}

// The block's k-th work item (claim_item) from thread `tid` 0 to every thread that calls this, through slot k % 2 of
// `item` and the mbarrier `full` (one arrival per item; release / acquire: with __syncthreads between the store and the
// loads, racecheck reported the pair as a race, session 9). The barriers that end an item order a slot's reuse two
// items later. wait_item: the same for a thread of a role that never claims (acquire only).
__device__ __forceinline__ int wait_item(int k, const int (&item)[2], unsigned long long* full) {
  mbar_wait(full, k & 1);
  return item[k & 1];
}
__device__ __forceinline__ int fetch_item(const Params& prm, int k, int tid, int (&item)[2], unsigned long long* full) {
  if (tid == 0) {
    item[k & 1] = claim_item(prm, k);
    mbar_arrive(full);
  }
  return wait_item(k, item, full);
}

// End of an item in a kernel whose two warpgroups each keep row sums of their own steps relative to their own latest
// m_use (the dual kernel's score warpgroups, the seesaw kernel's two): the second one's sums (already summed over the
// quad) and references into xl / xmu for the first's rows, by the quad's thread c == 0 ...
__device__ __forceinline__ void put_row_sums(float* xl, float* xmu, int wrow, int g, int c, const float (&l)[2],
                                             const float (&mu)[2]) {
  if (c != 0) return;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    xl[wrow + g + half * 8] = l[half];
    xmu[wrow + g + half * 8] = mu[half];
  }
}
// ... and the first one's merge of them with its own at the larger reference: the rows' final m and l (its mu is
// finite: the first warpgroup owns the item's first step), l also into row_l by the quad's thread c == 0.
__device__ __forceinline__ void merge_row_sums(const float* xl, const float* xmu, int wrow, int g, int c,
                                               const float (&l)[2], const float (&mu)[2], float (&m_fin)[2],
                                               float (&l_fin)[2], float* row_l) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = wrow + g + half * 8;
    const float xm = xmu[r], xs = xl[r];
    m_fin[half] = fmaxf(mu[half], xm);
    l_fin[half] = l[half] * fast_exp2(mu[half] - m_fin[half]) + xs * fast_exp2(xm - m_fin[half]);
    if (c == 0) row_l[r] = l_fin[half];
  }
}

// q of a 64-row item by TMA, from one thread: nine boxes (64 rows x one 64-column slab each) of the call's two tensor
// maps (q_nope, q_pe as T x H rows) into `q` (9 slabs of 64 x 128 B, 128-byte swizzle), completing on `land` with their
// bytes. Rows past the tensor's last are zeros; rows of the next request are padding rows, computed and dropped.
__device__ __forceinline__ void issue_q_tma(const Params& prm, const ItemCtx& cx, int H, unsigned char* q,
                                            unsigned long long* land) {
  mbar_arrive_expect_tx(land, kSlabs * kBlockM * 128);
  const int y = cx.rp.qo_begin * H + cx.row0;   // the item's first row of the [T x H] rows
#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl)
    tma_load_2d(q + sl * kBlockM * 128, &prm.q_map[sl == kSlabs - 1], sl == kSlabs - 1 ? 0 : sl * 64, y, land);
}

// q's last N k-steps (of kKSteps) into registers for wgmma RS: k-step ks is in slab ks / 4, 16-byte chunks 2 (ks % 4)
// and + 1 of the rows' 128-byte lines, swizzled by row % 8; lane l addresses row l % 16 of the warp's 16 (wrow ..),
// chunk + l / 16 (mma.m16n8k16's A fragment, 4 registers per k-step).
template <int N>
__device__ __forceinline__ void load_q_regs(uint32_t (&qa)[N][4], const unsigned char* q, int wrow, int lane) {
  const int row = wrow + (lane & 15);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int ks = kKSteps - N + i;
    const int ch = 2 * (ks & 3) + (lane >> 4);
    ldmatrix_x4(qa[i], q + (ks >> 2) * kBlockM * 128 + row * 128 + ((ch ^ (row & 7)) << 4));
  }
}

// Chunk cc (0..7) of each of the 9 slabs of key kt of tile t (TileN keys: 32, or the skinny kernel's 64) into the
// key buffer at shared address `kv`, in the 128-byte swizzled layout, [slab][key][128 B] (zero-fill past the split
// end). Eight threads with cc = 0..7 on one key make a warp's copy a whole 128-byte line per key. SlabStride: the
// bytes from one slab to the next (the dual kernel's pairs of 32-key buffers interleave their slabs: 8,192).
template <int TileN = kTileN, int SlabStride = TileN * 128>
__device__ __forceinline__ void copy_key_chunks(uint32_t kv, const Params& prm, const ItemCtx& cx, int t, int kt, int cc,
                                                long long slot) {
  const int key = cx.k0 + t * TileN + kt;
  const bool valid = key < cx.k1;
  const __nv_bfloat16* src = key_ptr(prm, cx, key, slot);
  const uint32_t dst = kv + kt * 128 + ((cc ^ (kt & 7)) << 4);
#pragma unroll
  for (int slab = 0; slab < kSlabs; ++slab)
    cp_async_16z(dst + slab * SlabStride, src + slab * kSlabDims + cc * 8, valid ? 16 : 0);
}
// The tile announces itself: a thread follows its copies with this, which arrives on the tile's
// mbarrier once they have landed, so no thread waits for its own copies.
__device__ __forceinline__ void arrive_when_landed(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Slot id of key kt of tile t of TileN keys (0 past the tiles, the split or the prefix: those copy no pool row).
template <int TileN = kTileN>
__device__ __forceinline__ long long tile_key_slot(const Params& prm, const ItemCtx& cx, int t, int kt) {
  const int key = cx.k0 + t * TileN + kt;
  return t < cx.ntiles && key < cx.k1 && key < cx.rp.p
             ? load_index(prm.kv_indices, prm.kv_indices_64, (long long)cx.rp.kv_begin + key)
             : 0;
}

// Copier thread i (of kTileN * kThreadsPerKey / Keys) copies chunk i % 8 of each slab of its Keys keys of tile t,
// i / 8 + (kTileN / Keys) h for h < Keys, into the key buffer at shared address `buf` (slabs SlabStride apart), then
// arrives on the buffer's mbarrier `full` once they have landed. Past the last tile nothing is issued and nobody
// arrives. Keys 1: 256 value threads (the wgmma and dual kernels); 2: 128 threads (the pingpong kernel's owner
// warpgroup, the dual kernel's score warpgroups with SRefill).
template <int Keys, int SlabStride = kSlabBytes>
__device__ __forceinline__ void copy_tile(uint32_t buf, unsigned long long* full, const Params& prm, const ItemCtx& cx,
                                          int t, int i, const long long (&slot)[Keys]) {
  if (t >= cx.ntiles) return;
#pragma unroll
  for (int h = 0; h < Keys; ++h)
    copy_key_chunks<kTileN, SlabStride>(buf, prm, cx, t, i / kThreadsPerKey + (kTileN / Keys) * h, i % kThreadsPerKey,
                                        slot[h]);
  arrive_when_landed(full);
}
// The slot ids of copier thread i's keys of tile t, as copy_tile takes them.
template <int Keys>
__device__ __forceinline__ void tile_slots(const Params& prm, const ItemCtx& cx, int t, int i, long long (&slot)[Keys]) {
#pragma unroll
  for (int h = 0; h < Keys; ++h) slot[h] = tile_key_slot(prm, cx, t, i / kThreadsPerKey + (kTileN / Keys) * h);
}

// Value thread vt's copies of tile t into buffer b of a ring of whole tiles (`kv`, mbarriers `full`): copy_tile, one
// key per thread.
template <class SmemT>
__device__ __forceinline__ void gather_tile(SmemT& sm, const Params& prm, const ItemCtx& cx, int t, int b, int vt,
                                            long long slot) {
  const long long one[1] = {slot};
  copy_tile<1>(smem_u32(&sm.kv[b][0]), &sm.full[b], prm, cx, t, vt, one);
}

__device__ __forceinline__ long long gather_slot(const Params& prm, const ItemCtx& cx, int t, int vt) {
  long long one[1];
  tile_slots<1>(prm, cx, t, vt, one);
  return one[0];
}

// The block's k-th work item in kernels whose producer warpgroup runs up to one item ahead of the others (the skinny
// and trans kernels): thread `claimer` claims it into slot[k % 2] once every thread has read that slot's previous item
// (k - 2); every thread waits for it, reads it and gives the slot back. Mbarriers: full[i] 1 arrival (release),
// empty[i] one arrival per thread of the block.
template <int Counter = 0>
__device__ __forceinline__ int fetch_item_ahead(const Params& prm, int k, int tid, int claimer, int (&slot)[2],
                                                unsigned long long (&full)[2], unsigned long long (&empty)[2]) {
  if (tid == claimer) {
    if (k >= 2) mbar_wait(&empty[k & 1], ((k >> 1) - 1) & 1);
    slot[k & 1] = claim_item<Counter>(prm, k);
    mbar_arrive(&full[k & 1]);
  }
  mbar_wait(&full[k & 1], (k >> 1) & 1);
  const int item = slot[k & 1];
  mbar_arrive(&empty[k & 1]);
  return item;
}

// O (64 rows x 256 value columns, wgmma accumulator layout) *= the factors of the thread's two rows,
// skipped when the whole warp's factors are 1.
__device__ __forceinline__ void rescale_o(float (&o)[128], float a0, float a1) {
  if (!__all_sync(0xffffffffu, a0 == 1.f && a1 == 1.f)) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[4 * j] *= a0;
      o[4 * j + 1] *= a0;
      o[4 * j + 2] *= a1;
      o[4 * j + 3] *= a1;
    }
  }
}
// Row r (the thread's row `half`) of O, times inv, as bf16 into value columns [256 v, 256 v + 256) of
// the row's result.
__device__ __forceinline__ void store_o_row(const Params& prm, const ItemCtx& cx, int r, int v, const float (&o)[128],
                                            int half, int c, float inv) {
  __nv_bfloat16* dst = result_row(prm, cx, r) + 256 * v;
#pragma unroll
  for (int j = 0; j < 32; ++j)
    *reinterpret_cast<uint32_t*>(dst + j * 8 + 2 * c) = pack_bf16(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
}

// End of an item, value side: the thread's two rows of O (value columns [256 v, 256 v + 256)) divided by the
// rows' sums row_l (stored by the score side), into their result rows.
__device__ __forceinline__ void store_o_rows(const Params& prm, const ItemCtx& cx, int wrow, int g, int c, int v,
                                             const float (&o)[128], const float* row_l) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = wrow + g + half * 8;
    if (r < cx.rows) {
      const float l = row_l[r];
      store_o_row(prm, cx, r, v, o, half, c, l > 0.f ? 1.f / l : 0.f);
    }
  }
}

// The same through shared memory (session 18): `stage` (64 rows x 1 KB, free until the item's closing barrier) takes the
// thread's rows as bf16 by stmatrix, then each warp copies whole rows of its warpgroup's 256 columns out, 16 B per lane:
// 512 contiguous bytes per store instruction. store_o_rows's 4-byte stores put 8 rows into every instruction, each
// half a 32-byte sector: 64 KB of partials cost an item ~3.6 us before its release (timeline, history 120).
// Layout: stage_chunk (verify_kernel.cuh). `bar_id` / `bar_count`: a barrier over the threads that stage (both value
// warpgroups). (Each warp copying out only its own 16 rows after a __syncwarp, no barrier, was no faster: session 19,
// history 125; removed.)
__device__ __forceinline__ void store_o_rows_staged(const Params& prm, const ItemCtx& cx, int wrow, int lane, int v,
                                                    const float (&o)[128], const float* row_l, uint32_t stage,
                                                    int bar_id, int bar_count) {
  const int g = lane >> 2;
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float l = row_l[wrow + g + 8 * half];
    inv[half] = l > 0.f ? 1.f / l : 0.f;
  }
  // stmatrix.x4 j: matrices (8-column block j + mi / 2, rows + 8 (mi % 2)) for mi = lane / 8; lane's row mr = lane % 8
  const int mi = lane >> 3, mr = lane & 7;
#pragma unroll
  for (int j = 0; j < 32; j += 2) {
    uint32_t r[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int jj = j + (q >> 1), h = q & 1;
      r[q] = pack_bf16(o[4 * jj + 2 * h] * inv[h], o[4 * jj + 2 * h + 1] * inv[h]);
    }
    stmatrix_x4(stage_chunk(stage, wrow + 8 * (mi & 1) + mr, 32 * v + j + (mi >> 1)), r);
  }
  bar_sync(bar_id, bar_count);
  const int wv = (wrow >> 4);   // the warp within its warpgroup: rows wv, wv + 4, ...
  for (int r = wv; r < cx.rows; r += 4) {
    *reinterpret_cast<uint4*>(result_row(prm, cx, r) + 256 * v + 8 * lane) = ld_shared_v4(stage_chunk(stage, r, 32 * v + lane));
  }
}

#ifdef KDTREE_EXP_TRACE
#define KDTREE_WTRACE(e) \
  do { if (lane == 0 && it < 32) sm.trace[it][e] = (unsigned)(clock64() - t_item); } while (0)
#else
#define KDTREE_WTRACE(e) do { } while (0)
#endif

#ifdef KDTREE_EXP_TRACE
// Profiling aid (session 22): the wgmma kernels' TRACE builds keep their stamps in global memory, and a one-thread
// kernel launched after the call prints them (kdtree_trace_dump_kernel, verify_launch.cu). Until session 21 these
// kernels called printf themselves; a call is a function boundary, across which ptxas serialises every wgmma of the
// kernel ("C7510: wgmma pipeline crossing function boundary"): those traces timed S with its wgmma serialised (~3,000
// clocks per S, where micro_contention gives ~1,100 for an S alone; PERF_LOG history 143).
namespace trace {
constexpr int kItems = 4;    // items recorded per block: the block's first four
constexpr int kTiles = 32;   // tiles recorded per item: the first 32
constexpr int kStamps = 16;  // per tile: 0-3 score side, 4-7 value side (the wgmma kernel's sm.trace), 8-15 dual extras
struct ItemRec { int item, tiles; long long total; };
__device__ unsigned g_tile[2][kItems][kTiles][kStamps];   // blocks 0 and 1 (the dual kernel: block 0 only)
__device__ ItemRec g_item[2][kItems];
__device__ int g_items[2];   // items block b recorded in the latest call (the dump kernel prints and clears them)
}  // namespace trace
#endif

__global__ void __launch_bounds__(kThreads, 1) kdtree_verify_split_wgmma_kernel(Params prm) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem& sm = smem_1k<Smem>(smem_raw);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int c = lane & 3;
  KDTREE_TIMELINE(2, 0);
  grid_dependency_wait();   // the plan kernel's counter and plan
  grid_dependency_launch_dependents();   // after the wait: the combine reads the plan as soon as it starts
  KDTREE_TIMELINE(2, 1);
  const int total = prm.counter[1];
  const int H = prm.heads;

  if (tid == 0) {
    for (int b = 0; b < kStages; ++b) mbar_init(&sm.full[b], kValueThreads);
    mbar_init(&sm.p_full, 128);
    mbar_init(&sm.p_empty, kValueThreads);
    if constexpr (kQFirst < kStages) mbar_init(&sm.q_full, 128);
    fence_proxy_async();
  }
  __syncthreads();

  if (warp < 4) {
    // =========================== score warpgroup ===========================
    const int wrow = warp * 16;   // rows of this warp within the tile
    uint32_t phase_bits = 0u, p_parity = 0u;
    for (int k = 0;; ++k) {
      if (tid == 0) sm.item = claim_item(prm, k);
      sync_block_roles();
      const int item = sm.item;
      if (item >= total) {
        KDTREE_TIMELINE(2, 2);
        return;
      }
      const ItemCtx cx = item_ctx<kItemRows, kTileN>(prm, item);

      // q of the item into shared memory (swizzled K-major, zeros for padding rows): 64 rows x 72
      // chunks of 16 bytes over the 128 score threads, as asynchronous copies that are all in flight
      // at once (a load-then-store loop waits one L2 round trip per chunk: 36 in a row per thread)
      issue_q_copies(prm, cx, H, sm.q, tid, 128);
      cp_async_wait_all();   // this thread's q copies (the score WG issues no other cp.async)
      fence_proxy_async();   // read next by wgmma (the async proxy)
      if constexpr (kQFirst < kStages) mbar_arrive(&sm.q_full);   // the value WGs may ask for the rest
      bar_sync(kBarScore, 128);
#ifdef KDTREE_EXP_TRACE
      const long long t_item = clock64();
#endif
      float m_run[2] = {-INFINITY, -INFINITY};
      float l_run[2] = {0.f, 0.f};

      // S of tile t into acc: wait for the tile to land and fence it into the async proxy (s_begin),
      // issue k-steps [k0, k1) of its 36 wgmma (s_steps), commit (the caller waits). S of tile it+1 is
      // issued in kSPieces pieces between the parts of tile it's softmax: issuing a wgmma blocks once a
      // few are queued, so a softmax placed after all 36 issues would start only when S(it+1) is nearly
      // done instead of running beside it.
      const SmemDesc qd(smem_u32(&sm.q[0]), 16, 1024);
      SmemDesc kd(0, 16, 1024);
      auto s_begin = [&](int t) {
        const int bt = t % kStages;
        mbar_wait_buffer(sm.full, phase_bits, bt);   // every value thread's copies landed
        fence_proxy_async();   // cp.async wrote the tile (generic proxy); wgmma reads it (async proxy)
        kd = SmemDesc(smem_u32(&sm.kv[bt][0]), 16, 1024);
        wg_fence();
      };
      auto s_steps = [&](float (&acc)[16], auto k0, auto k1) {
        if (decltype(k0)::value > 0) wg_fence();   // a later piece: the softmax ran in between
#pragma unroll
        for (int ks = decltype(k0)::value; ks < decltype(k1)::value; ++ks) {
#ifdef KDTREE_EXP_NO_SCORE_MMA   // profiling aid: one k-step instead of 36
          if (ks > 0) continue;
#endif
          wgmma_m64n32k16_ss(acc, qd.at((ks >> 2) * kQSlabBytes + (ks & 3) * 32),
                             kd.at((ks >> 2) * kSlabBytes + (ks & 3) * 32), ks > 0);
        }
      };
      using K0 = std::integral_constant<int, 0>;
      using K1 = std::integral_constant<int, kSCut1>;
      using K2 = std::integral_constant<int, kSCut2>;
      using K3 = std::integral_constant<int, kKSteps>;
      float s[16], s_next[16];
      float alpha[2], m_use[2];
      // softmax of tile it, part 1: scale, mask, row maxima, running max and the rescale factor
      auto softmax_max = [&](int it) {
        float tmax[2];
        scale_mask_max(prm, cx, H, cx.k0 + it * kTileN, wrow + g, c, s, tmax);
        softmax_advance(tmax, m_run, m_use, alpha);
      };
      // part 2: once the value WGs are done with the previous P / alpha (the first wait of an item is
      // on the phase before: complete), P of tile it into shared memory and the running sums
      auto softmax_p = [&]() {
        mbar_wait(&sm.p_empty, p_parity);
        p_parity ^= 1u;
        softmax_p_pairs(s, m_use, alpha, l_run, [&](int j, int half, uint32_t pair) {
          const int row = wrow + g + half * 8;
          *reinterpret_cast<uint32_t*>(&sm.p[row * 128 + ((j ^ (row & 7)) << 4) + 4 * c]) = pair;
        });
      };
      // part 3: P and alpha published: the mbarrier carries the release (memory order), the named
      // barrier the wake-up (the value WGs sleep in bar.sync instead of spinning on the mbarrier)
      auto publish = [&]() {
        fence_proxy_async();   // P is read next by wgmma (the async proxy); alpha by plain loads
        if (c == 0) {
          sm.alpha[wrow + g] = alpha[0];
          sm.alpha[wrow + g + 8] = alpha[1];
        }
        mbar_arrive(&sm.p_full);
        bar_arrive(kBarPFull, kThreads);
      };
      // The item's first p_empty wait is on the phase before the current one (complete). The score WG then
      // waits once per tile and the value WGs arrive once per tile but the last, so the parity stays in
      // step across items; every item has at least one tile (each split of a request holds >= 1 key).
      p_parity ^= 1u;
      if (cx.ntiles > 0) {
        s_begin(0);
        s_steps(s, K0{}, K3{});
        wg_commit();
        wg_wait0();
      }
      // every tile but the last: S(it+1) in pieces between the parts of tile it's softmax (no branch
      // between the pieces of one wgmma group: ptxas would serialise them, C7520)
      int it = 0;
      for (; it + 1 < cx.ntiles; ++it) {
        if (warp == 0) KDTREE_WTRACE(0);
        s_begin(it + 1);
        s_steps(s_next, K0{}, K1{});
        if (warp == 0) KDTREE_WTRACE(1);
        softmax_max(it);
        s_steps(s_next, K1{}, K2{});
        if (warp == 0) KDTREE_WTRACE(2);
        softmax_p();
        s_steps(s_next, K2{}, K3{});
        wg_commit();
        publish();
        if (warp == 0) KDTREE_WTRACE(3);
        wg_wait0();
#pragma unroll
        for (int i = 0; i < 16; ++i) s[i] = s_next[i];
      }
      if (it < cx.ntiles) {   // the last tile
        softmax_max(it);
        softmax_p();
        publish();
      }
      finish_rows(prm, cx, H, wrow, g, c, m_run, l_run, sm.row_m, sm.row_l, [] { bar_arrive(kBarBlock, kThreads); });
      sync_block_roles();   // the item's shared memory is consumed before the next item starts
      if (tid == 32) signal_item_done(prm, cx);   // every partial of the item is stored (not the claimer)
#ifdef KDTREE_EXP_TRACE
      if (tid == 0 && blockIdx.x < 2 && k < trace::kItems) {   // (printed after the call: trace::)
        trace::g_item[blockIdx.x][k] = {item, cx.ntiles, clock64() - t_item};
        for (int it = 0; it < min(cx.ntiles, trace::kTiles); ++it)
          for (int e = 0; e < 8; ++e) trace::g_tile[blockIdx.x][k][it][e] = sm.trace[it][e];
        trace::g_items[blockIdx.x] = k + 1;
      }
      sync_block_roles();   // the stamps are copied before the next item's overwrite them
#endif
    }
  } else {
    // =========================== value warpgroups ===========================
    const int vt = tid - 128;           // 0..255
    const int v = vt >> 7;              // value warpgroup: columns [256 v, 256 v + 256)
    const int wrow = (warp & 3) * 16;   // rows of this warp within the tile
    uint32_t phase_bits = 0u, p_parity = 0u, q_parity = 0u;
    for (;;) {
      sync_block_roles();   // pairs with the score WG's item fetch
      const int item = sm.item;
      if (item >= total) return;
      const ItemCtx cx = item_ctx<kItemRows, kTileN>(prm, item);

      // prologue: tiles 0 .. kStages-1 on their way (each announces itself when it has landed); the
      // slot ids of tiles 0 .. kStages are loaded together first (each copy's asm orders any load
      // after it, so loading them between the copies waits one round trip per tile)
      long long slots[kStages + 1];
#pragma unroll
      for (int t = 0; t <= kStages; ++t) slots[t] = gather_slot(prm, cx, t, vt);
#pragma unroll
      for (int t = 0; t < kStages; ++t) {
        if (t == kQFirst) {   // (KDTREE_WG_Q_FIRST) the rest of the ring once q has landed
          mbar_wait(&sm.q_full, q_parity);
          q_parity ^= 1u;
        }
        gather_tile(sm, prm, cx, t, t, vt, slots[t]);
      }
      long long slot = slots[kStages];
#ifdef KDTREE_EXP_TRACE
      const long long t_item = clock64();   // (a little later than the score WG's origin)
#endif

      float o[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] = 0.f;

      for (int it = 0; it < cx.ntiles; ++it) {
        const int b = it % kStages;
        if (warp == 4) KDTREE_WTRACE(4);
        bar_sync(kBarPFull, kThreads);   // P / alpha of tile it: wake up ...
        mbar_wait(&sm.p_full, p_parity);   // ... and acquire (complete by now)
        p_parity ^= 1u;
        mbar_wait_buffer(sm.full, phase_bits, b);   // landed (the score WG saw it already)
        fence_proxy_async();   // the tile's V is read by wgmma (the async proxy)
        if (warp == 4) KDTREE_WTRACE(5);
        rescale_o(o, sm.alpha[wrow + g], sm.alpha[wrow + g + 8]);
        {
          const SmemDesc pd(smem_u32(&sm.p[0]), 16, 1024);
          const SmemDesc vd(smem_u32(&sm.kv[b][0]) + (4 * v) * kSlabBytes, kSlabBytes, 1024);
          wg_fence();
#ifndef KDTREE_EXP_NO_PV_MMA   // profiling aid: skip P V
#pragma unroll
          for (int kk = 0; kk < kPvSteps; ++kk) {
            const uint64_t da = pd.at(kk * 32);
            const uint64_t db = vd.at(kk * 16 * 128);
            wgmma_m64n256k16_ss_bt(o, da, db, 1);
          }
#endif
          wg_commit();
          wg_wait0();
        }
        if (warp == 4) KDTREE_WTRACE(6);
        if (it + 1 < cx.ntiles) mbar_arrive(&sm.p_empty);   // release: done reading P / alpha
        bar_sync(kBarValues, kValueThreads);   // both value WGs are done with buffer b
        const long long next = gather_slot(prm, cx, it + kStages + 1, vt);
        gather_tile(sm, prm, cx, it + kStages, b, vt, slot);
        slot = next;
        if (warp == 4) KDTREE_WTRACE(7);
      }
      // every copy of the item has landed: the score WG waited on all of its tiles
      bar_sync(kBarBlock, kThreads);   // row_m / row_l written by the score WG (which only arrives)
      store_o_rows(prm, cx, wrow, g, c, v, o, sm.row_l);
      sync_block_roles();
#ifdef KDTREE_EXP_TRACE
      sync_block_roles();   // pairs with the score WG's copy-out barrier
#endif
    }
  }
#else
  __trap();   // built without sm_90a: the launcher never selects this kernel
#endif
}

}  // namespace wg

// ---------------------------------------------------------------------------------------------
// Kernels with the keys as the wgmma M (verify_skinny.cuh: 16-row items, verify_trans.cuh: 48): S^T = K q^T and
// O^T = V^T P^T as wgmma m64nNk16 with N = the item's rows, so a query row is an accumulator column.
// ---------------------------------------------------------------------------------------------
namespace km {

// D[64 x N] (+)= A[64 x 16] * B[16 x N], fp32 accumulate, both operands in shared memory: B K-major, A K-major
// (TransA 0: S^T, the keys' rows) or MN-major (TransA 1: V^T, the same rows read down their dims). N = 16 or 48.
template <int N, int TransA>
__device__ __forceinline__ void wgmma_m64nNk16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  static_assert(N == 16 || N == 48, "the item rows of the skinny and trans kernels");
  if constexpr (N == 16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TransA));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %26, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n48k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
        "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, %24, %25, p, 1, 1, %27, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
          "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
          "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TransA));
  }
}

// A thread's accumulator value i of an m64nN product: row (key, or value dim) 16 warp + g + 8 row_half(i), column
// (query row) col_of(c, col_q(i)), where col_q(i) = (i & 1) + 2 (i >> 2) indexes the thread's N / 4 columns;
// acc_index(q, h) is the value i of column index q and row half h.
__device__ __forceinline__ int col_q(int i) { return (i & 1) + 2 * (i >> 2); }
__device__ __forceinline__ int row_half(int i) { return (i >> 1) & 1; }
__device__ __forceinline__ int col_of(int c, int q) { return 2 * c + (q & 1) + 8 * (q >> 1); }
__device__ __forceinline__ int acc_index(int q, int h) { return 4 * (q >> 1) + 2 * h + (q & 1); }

// A value per accumulator column (query row) of the thread's K, reduced over the 8 key rows g of the warp (the lanes
// 4 apart: same c): the column maxima and sums before they meet over the warpgroup's 4 warps in shared memory.
template <int K, class Op>
__device__ __forceinline__ void reduce_over_key_rows(float (&v)[K], Op op) {
#pragma unroll
  for (int q = 0; q < K; ++q)
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) v[q] = op(v[q], __shfl_xor_sync(0xffffffffu, v[q], off));
}
__device__ __forceinline__ float fmax_op(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float add_op(float a, float b) { return a + b; }

// Byte offset of P^T's element (query row, key) in [row][64 keys] bf16 rows of 128 bytes, 128-byte swizzle (the B
// operand of O^T, K-major).
__device__ __forceinline__ int pt_offset(int row, int key) {
  return row * 128 + ((((key >> 3) ^ (row & 7)) << 4) | ((key & 7) << 1));
}

// S^T of one key tile into s: k-steps [K0, K1) of the 36 of wgmma m64nNk16, A = the tile at shared address kv
// ([slab][key][128 B], SlabBytes per slab), B = q (QSlabBytes per slab); the caller fences, commits and waits
// (scores_t: all 36, committed and waited for).
template <int N, int SlabBytes, int QSlabBytes, class K0, class K1>
__device__ __forceinline__ void scores_t_steps(float (&s)[N / 2], uint32_t kv, const wg::SmemDesc& qd, K0, K1) {
  const wg::SmemDesc kd(kv, 16, 1024);
#pragma unroll
  for (int ks = K0::value; ks < K1::value; ++ks) {
#ifdef KDTREE_EXP_NO_SCORE_MMA   // profiling aid: one k-step instead of 36
    if (ks > 0) continue;
#endif
    wgmma_m64nNk16<N, 0>(s, kd.at((ks >> 2) * SlabBytes + (ks & 3) * 32),
                         qd.at((ks >> 2) * QSlabBytes + (ks & 3) * 32), ks > 0);
  }
}
template <int N, int SlabBytes, int QSlabBytes>
__device__ __forceinline__ void scores_t(float (&s)[N / 2], uint32_t kv, const wg::SmemDesc& qd) {
  wg::wg_fence();
  scores_t_steps<N, SlabBytes, QSlabBytes>(s, kv, qd, std::integral_constant<int, 0>{},
                                           std::integral_constant<int, kDimQK / 16>{});
  wg::wg_commit();
  wg::wg_wait0();
}

// O^T += V^T P^T over one key tile: VBlocks blocks of 64 value dims (block mb read MN-major from the tile's slab at
// shared address kv + mb SlabBytes) x PvSteps k-steps of 16 keys, B = P^T (pd); committed and waited for.
template <int N, int VBlocks, int SlabBytes, int PvSteps>
__device__ __forceinline__ void values_t(float (&o)[VBlocks][N / 2], uint32_t kv, const wg::SmemDesc& pd) {
  wg::wg_fence();
#ifndef KDTREE_EXP_NO_PV_MMA   // profiling aid: skip O^T += V^T P^T
#pragma unroll
  for (int kk = 0; kk < PvSteps; ++kk)
#pragma unroll
    for (int mb = 0; mb < VBlocks; ++mb)
      wgmma_m64nNk16<N, 1>(o[mb], wg::SmemDesc(kv + mb * SlabBytes, SlabBytes, 1024).at(kk * 16 * 128), pd.at(kk * 32),
                           1);
#endif
  wg::wg_commit();
  wg::wg_wait0();
}

#ifdef KDTREE_EXP_TRACE   // profiling aid (session 21): the start of block 0's first item in the kernels whose keys come
// from key_producer (skinny, trans), SM clocks: the consumer's item fetched, q issued, q landed, tile 0 landed, tile
// 0's S^T done, the item's end; the producer's item fetched, tile 0 issued, tile 1 issued
__device__ volatile long long g_sk_start[9];
__device__ int g_sk_item[3];   // block 0's first item, its tiles, 1 once recorded (the dump kernel clears it)
#define KDTREE_SKSTART(cond, e) do { if (blockIdx.x == 0 && (cond)) ::kdtree::km::g_sk_start[e] = clock64(); } while (0)
#else
#define KDTREE_SKSTART(cond, e) do { } while (0)
#endif

// The producer of a kernel with the keys as the wgmma M: thread pt of Threads (whole warpgroups) gathers its share of
// every tile of the block's items (Rows-row items of TileN-key tiles) into the ring of Stages key buffers sm.kv, eight
// threads per key with one 16-byte chunk of each slab each (a warp's copy is whole 128-byte lines; with two threads
// per key every sector crossed from L2 twice, history 95); it waits for a buffer's release on sm.empty, announces each
// tile on sm.full once its copies have landed, and runs on into the next item (fetch_item) while the others end theirs.
template <int Rows, int TileN, int Stages, int Threads, bool Rem = false, class SmemT, class Fetch>
__device__ __forceinline__ void key_producer(SmemT& sm, const Params& prm, int pt, int total, Fetch fetch_item) {
  constexpr int kKeysPerPass = Threads / 8;
  constexpr int kPasses = TileN / kKeysPerPass;
  static_assert(Threads % 128 == 0 && TileN % kKeysPerPass == 0, "whole warpgroups; a tile's keys in whole passes");
  const int kq = pt / 8;   // keys kq + kKeysPerPass r (r < kPasses) of every tile are this thread's
  const int cc = pt % 8;   // chunk cc of each of their slabs
  uint32_t seq = 0;        // tiles issued by this block: buffer seq % Stages, phase seq / Stages
  for (int k = 0;; ++k) {
    const int item = fetch_item(k);
    if (item >= total) {
      cp_async_wait_all();   // no thread leaves with copies in flight (the consumers still wait on them)
      return;
    }
    KDTREE_SKSTART(k == 0 && pt == 0, 6);
    const ItemCtx cx = Rem ? item_ctx_rem(prm, item) : item_ctx<Rows, TileN>(prm, item);
    // tile t of the item as a one-tile context (a remainder item's cells: rem_tile; empty ones are skipped by both
    // sides alike)
    auto tile = [&](int t, ItemCtx& tc) {
      tc = cx;
      if constexpr (Rem) {
        rem_tile(cx, t, tc.k0, tc.k1);
        tc.ntiles = t < cx.ntiles && tc.k0 < tc.k1 ? 1 : 0;
        return 0;
      }
      return t;
    };
    auto next_cell = [&](int t) {
      ++t;
      if constexpr (Rem) {
        ItemCtx tc;
        while (t < cx.ntiles && (tile(t, tc), tc.ntiles == 0)) ++t;
      }
      return t;
    };
    long long slot[kPasses];
    int t = next_cell(-1);
    {
      ItemCtx tc;
      const int tt = tile(t, tc);
#pragma unroll
      for (int r = 0; r < kPasses; ++r) slot[r] = wg::tile_key_slot<TileN>(prm, tc, tt, kq + r * kKeysPerPass);
    }
    for (; t < cx.ntiles; ++seq) {
      const int b = seq % Stages;
      const int tn = next_cell(t);
      ItemCtx tc, tcn;
      const int tt = tile(t, tc), ttn = tile(tn, tcn);
      long long next[kPasses];   // one tile ahead: their latency hides in the wait and the copies
#pragma unroll
      for (int r = 0; r < kPasses; ++r) next[r] = wg::tile_key_slot<TileN>(prm, tcn, ttn, kq + r * kKeysPerPass);
      mbar_wait(&sm.empty[b], ((seq / Stages) & 1) ^ 1u);   // the buffer's previous tile consumed (none at first)
#pragma unroll
      for (int r = 0; r < kPasses; ++r)
        wg::copy_key_chunks<TileN>(smem_u32(&sm.kv[b][0]), prm, tc, tt, kq + r * kKeysPerPass, cc, slot[r]);
      wg::arrive_when_landed(&sm.full[b]);
      KDTREE_SKSTART(k == 0 && pt == 0 && seq < 2, 7 + (int)seq);
#pragma unroll
      for (int r = 0; r < kPasses; ++r) slot[r] = next[r];
      t = tn;
    }
  }
}

}  // namespace km
}  // namespace kdtree
