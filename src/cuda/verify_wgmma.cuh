// verify_wgmma.cuh: what the sm_90a split passes share (verify_dual.cuh, the default on H100/H200; verify_skinny.cuh,
// calls of few rows per request): their geometry, shared-memory descriptors, the wgmma instructions they issue, the
// copies of q and of the gathered keys, the hand-out of work items, the stores of O (their profiling records are in
// verify_profiling.cuh). Same work items, plan, partials and combine as the mma.sync kernel in verify_mma.cuh, which
// every other architecture (sm_120 included) runs.
//
// - A work item is (request, split, 64-row tile): rows r = n * H + h as in the mma.sync kernel, one wgmma M of 64 rows
//   per item (the skinny kernel: 16 rows as the wgmma N), 32-key tiles.
// - All shared operands use the 128-byte swizzled K-major layout: a matrix of R rows x 576 columns is 9 slabs of 64
//   columns, [slab][row][128 B], 16-byte chunk c of row r stored at c ^ (r % 8).
// - Keys are gathered with cp.async, 16 bytes per copy, straight into that layout; a copier thread follows its copies
//   of a tile with cp.async.mbarrier.arrive.noinc, so a tile announces itself on its mbarrier when it has landed;
//   readers wait on the mbarrier and fence the tile into the async proxy before their wgmma.
// (The other sm_90a schedules measured for these items, one score warpgroup among them, are in docs/performance.md,
// "What was tried and measured slower".)
#pragma once

#include <type_traits>

#include "verify_common.cuh"
#include "verify_item.cuh"
#include "verify_profiling.cuh"
#include "verify_ptx.cuh"
#include "verify_q8.cuh"

namespace kdtree {
namespace wg {

constexpr int kBlockM = 64;                 // one wgmma M: rows per work item (the plan's block_m)
constexpr int kTileN = 32;                  // keys per pipeline tile
static_assert(kTileN == kdtree::kTileN, "scale_mask_max (shared with the mma.sync kernel) takes 32-key tiles");
constexpr int kSlabDims = 64;               // bf16 per 128-byte swizzle row
constexpr int kSlabs = kDimQK / kSlabDims;  // 9
constexpr int kSlabBytes = kTileN * 128;    // 4,096: one 64-column slab of a key tile
constexpr int kTileBytes = kSlabs * kSlabBytes;  // 36,864
constexpr int kQSlabBytes = kBlockM * 128;  // 8,192: one 64-column slab of q
constexpr int kChunksPerKey = kKeyBytes / 16;    // 72
constexpr int kThreadsPerKey = 8;           // copier threads per key: thread i copies chunk i % 8 of each slab
constexpr int kKSteps = kDimQK / 16;        // 36
constexpr int kPvSteps = kTileN / 16;       // 2

static_assert(kKSteps * 16 == kDimQK && kTileN % 16 == 0, "whole k16 steps");
static_assert(kChunksPerKey == kThreadsPerKey * kSlabs, "a copier thread copies one chunk per slab");
static_assert(kSlabBytes % 1024 == 0 && kQSlabBytes % 1024 == 0, "swizzle atoms stay 1 KB aligned");

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

// Shared-memory descriptor of a K-major operand in the 64-byte swizzle (8 rows x 64 B atoms, SBO 512): P of the dual
// kernel (32 keys per row).
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
// than the warp holds is an illegal instruction).
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
// until at most N of the warpgroup's latest committed wgmma groups are in flight
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// D[64 x 32] (+)= A[64 x 16] (shared memory, K-major) * B[16 x 32] (shared memory, K-major), fp32 accumulate.
__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64 x 128] (+)= A[64 x 16] (shared memory, K-major) * B[16 x 128] (shared memory, MN-major), fp32 accumulate:
// half of a value warpgroup's P V (a kernel of 512 or more threads caps ptxas at 128 registers per instruction, and
// one m64n256k16 needs 154; after setmaxnreg the two halves' 128 accumulators fit, verify_dual.cuh).
__device__ __forceinline__ void wgmma_m64n128k16_ss_bt(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1, 0, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b));
}

// D[64 x 32] (+)= A[64 x 32] * B[32 x 32], e4m3, both in shared memory (K-major), fp32 accumulate: a k32 step of the
// dual kernel's S = q K^T over an e4m3 tile (FP8 form), one e4m3 term of q.
__device__ __forceinline__ void wgmma_m64n32k32_e4m3_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64 x 64] += A[64 x 32] (registers) * B[32 x 64] (shared memory, K-major), e4m3, fp32 accumulate: a block of 64
// value dims of the dual kernel's O^T = V^T P^T over an e4m3 tile (FP8 form), one e4m3 term of P.
__device__ __forceinline__ void wgmma_m64n64k32_e4m3_rs(float* d, const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// The A fragment of O^T = V^T P^T over e4m3 values from one ldmatrix.x4.trans (b16) of 32 keys x a warp's 16 value
// bytes (matrices: keys 0-7, 8-15, 16-23, 24-31): thread (g, c) holds keys 2c, 2c + 1 x dims 2g, 2g + 1 of each, and
// two byte permutes a matrix pair give keys 2c, 2c + 1, 8 + 2c, 9 + 2c at dim 2g (0x6420) and at 2g + 1 (0x7531). So the
// fragment's rows g / g + 8 are dims 2g / 2g + 1 of the warp's 16, and its k positions 4c .. 4c + 3 (16 + 4c ..) are
// those keys (+ 16): the order P^T is stored in (sk8::p8_offset; the dual kernel's FP8 form).
__device__ __forceinline__ void e4m3_vt_fragment(const uint32_t (&m)[4], uint32_t (&a)[4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    a[2 * h] = __byte_perm(m[2 * h], m[2 * h + 1], 0x6420);
    a[2 * h + 1] = __byte_perm(m[2 * h], m[2 * h + 1], 0x7531);
  }
}

// q of a work item into shared memory by asynchronous copies (all in flight at once): Rows rows (64, or the
// skinny kernel's 16) x 72 chunks of 16 bytes in the 128-byte swizzled K-major layout (9 slabs of Rows x 128 B),
// zeros for padding rows, thread `tid` of `nthreads` taking every nthreads-th chunk. The caller waits for its copies.
// q8_rows: the rows' e4m3 terms from Params::q8 instead (hi, then lo: 1,152 bytes a row, as 72 chunks; the skinny FP8
// kernel's prefix items, verify_q8.cuh), else q_nope / q_pe.
template <int Rows = kBlockM>
__device__ __forceinline__ void issue_q_copies(const Params& prm, const ItemCtx& cx, int H, unsigned char* q, int tid,
                                               int nthreads, bool q8_rows = false) {
  constexpr int kRowsSlabBytes = Rows * 128;
  for (int i = tid; i < Rows * kChunksPerKey; i += nthreads) {
    const int r = i / kChunksPerKey, ch = i - r * kChunksPerKey;
    const __nv_bfloat16* src = prm.zero_row;   // padding rows: zero-filled, nothing read
    if (r < cx.rows) {
      const int rr = cx.row0 + r;
      const long long t = cx.rp.qo_begin + rr / H, h = rr % H;
      const int d = ch * 8;
      if (q8_rows)
        src = reinterpret_cast<const __nv_bfloat16*>(prm.q8 + (t * H + h) * kQ8RowBytes) + d;   // (2-byte units)
      else
        src = d < kDimNope ? prm.q_nope + t * prm.q_nope_st + h * prm.q_nope_sh + d
                           : prm.q_pe + t * prm.q_pe_st + h * prm.q_pe_sh + (d - kDimNope);
    }
    cp_async_16z(smem_u32(&q[(ch >> 3) * kRowsSlabBytes + r * 128 + (((ch & 7) ^ (r & 7)) << 4)]), src,
                 r < cx.rows ? 16 : 0);
  }
}

// The block's k-th work item (claim_item) from thread `tid` 0 to every thread that calls this, through slot k % 2 of
// `item` and the mbarrier `full` (one arrival per item; release / acquire: with __syncthreads between the store and the
// loads, racecheck reports the pair as a race). The barriers that end an item order a slot's reuse two
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
// m_use (the dual kernel's score warpgroups): the second one's sums (already summed over the
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

// q of a 64-row item by TMA, from one thread: nine boxes (64 rows x one 64-column slab each) of the call's tensor maps
// (q_nope, q_pe as T x H rows; or, q8_rows, q's e4m3 terms) into `q` (9 slabs of 64 x 128 B, 128-byte swizzle),
// completing on `land` with their bytes. Rows past the tensor's last are zeros; rows of the next request are padding
// rows, computed and dropped.
__device__ __forceinline__ void issue_q_tma(const Params& prm, const ItemCtx& cx, int H, unsigned char* q,
                                            unsigned long long* land, bool q8_rows = false) {
  mbar_arrive_expect_tx(land, kSlabs * kBlockM * 128);
  const int y = cx.rp.qo_begin * H + cx.row0;   // the item's first row of the [T x H] rows
#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl) {
    const int map = q8_rows ? 2 : sl == kSlabs - 1;
    tma_load_2d(q + sl * kBlockM * 128, &prm.q_map[map], map == 1 ? 0 : sl * 64, y, land);
  }
}

// Chunk cc (0..7) of each of the 9 slabs of key kt of tile t (TileN keys: 32, or the skinny kernel's 64) into the
// key buffer at shared address `kv`, in the 128-byte swizzled layout, [slab][key][128 B] (zero-fill past the split
// end). Eight threads with cc = 0..7 on one key make a warp's copy a whole 128-byte line per key.
template <int TileN = kTileN>
__device__ __forceinline__ void copy_key_chunks(uint32_t kv, const Params& prm, const ItemCtx& cx, int t, int kt, int cc,
                                                long long slot) {
  const int key = cx.k0 + t * TileN + kt;
  const bool valid = key < cx.k1;
  const __nv_bfloat16* src = key_ptr(prm, cx, key, slot);
  const uint32_t dst = kv + kt * 128 + ((cc ^ (kt & 7)) << 4);
#pragma unroll
  for (int slab = 0; slab < kSlabs; ++slab)
    cp_async_16z(dst + slab * (TileN * 128), src + slab * kSlabDims + cc * 8, valid ? 16 : 0);
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
// i / 8 + (kTileN / Keys) h for h < Keys, into the key buffer at shared address `buf`, then arrives on the buffer's
// mbarrier `full` once they have landed. Past the last tile nothing is issued and nobody arrives. (The dual kernel's
// producer warpgroup: Keys 2, 128 threads.)
template <int Keys>
__device__ __forceinline__ void copy_tile(uint32_t buf, unsigned long long* full, const Params& prm, const ItemCtx& cx,
                                          int t, int i, const long long (&slot)[Keys]) {
  if (t >= cx.ntiles) return;
#pragma unroll
  for (int h = 0; h < Keys; ++h)
    copy_key_chunks<kTileN>(buf, prm, cx, t, i / kThreadsPerKey + (kTileN / Keys) * h, i % kThreadsPerKey, slot[h]);
  arrive_when_landed(full);
}
// The slot ids of copier thread i's keys of tile t, as copy_tile takes them.
template <int Keys>
__device__ __forceinline__ void tile_slots(const Params& prm, const ItemCtx& cx, int t, int i, long long (&slot)[Keys]) {
#pragma unroll
  for (int h = 0; h < Keys; ++h) slot[h] = tile_key_slot(prm, cx, t, i / kThreadsPerKey + (kTileN / Keys) * h);
}

// The block's k-th work item in a kernel whose producer warpgroup runs up to one item ahead of the others (the skinny
// kernel): thread `claimer` claims it into slot[k % 2] once every thread has read that slot's previous item
// (k - 2); every thread waits for it, reads it and gives the slot back. Mbarriers: full[i] 1 arrival (release),
// empty[i] one arrival per thread of the block.
__device__ __forceinline__ int fetch_item_ahead(const Params& prm, int k, int tid, int claimer, int (&slot)[2],
                                                unsigned long long (&full)[2], unsigned long long (&empty)[2]) {
  if (tid == claimer) {
    if (k >= 2) mbar_wait(&empty[k & 1], ((k >> 1) - 1) & 1);
    slot[k & 1] = claim_item(prm, k);
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
// The second half of store_o_rows_staged (and of the FP8 form's O^T store, verify_dual.cuh): once every staging thread
// is past `bar_id`, each warp copies rows wrow / 16, + 4, ... of its warpgroup's 256 columns out, 16 B a lane.
__device__ __forceinline__ void copy_staged_rows_out(const Params& prm, const ItemCtx& cx, int wrow, int lane, int v,
                                                     uint32_t stage, int bar_id, int bar_count) {
  bar_sync(bar_id, bar_count);
  const int wv = (wrow >> 4);   // the warp within its warpgroup: rows wv, wv + 4, ...
  for (int r = wv; r < cx.rows; r += 4) {
    *reinterpret_cast<uint4*>(result_row(prm, cx, r) + 256 * v + 8 * lane) = ld_shared_v4(stage_chunk(stage, r, 32 * v + lane));
  }
}
// End of an item, value side: the thread's two rows of O (value columns [256 v, 256 v + 256)) divided by the rows'
// sums row_l (stored by the score side), into their result rows, through shared memory: `stage` (64 rows x
// 1 KB, free until the item's closing barrier) takes the thread's rows as bf16 by stmatrix, then each warp copies whole
// rows of its warpgroup's 256 columns out, 16 B per lane: 512 contiguous bytes per store instruction. (4-byte stores
// from the accumulators put 8 rows into every instruction, each half a 32-byte sector: 64 KB of partials cost an item
// ~3.6 us before its release, 1.7 us so; -11% at H16 N9 P8192, -3% at P131072, -5% B8 on the H200.)
// Layout: stage_chunk (verify_item.cuh). `bar_id` / `bar_count`: a barrier over the threads that stage (both value
// warpgroups). (Each warp copying out only its own 16 rows after a __syncwarp, with no barrier, is no faster.)
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
  copy_staged_rows_out(prm, cx, wrow, lane, v, stage, bar_id, bar_count);
}

}  // namespace wg

// ---------------------------------------------------------------------------------------------
// Kernels with the keys as the wgmma M (verify_skinny.cuh: 16-row items): S^T = K q^T and
// O^T = V^T P^T as wgmma m64nNk16 with N = the item's rows, so a query row is an accumulator column.
// ---------------------------------------------------------------------------------------------
namespace km {

// D[64 x N] (+)= A[64 x 16] * B[16 x N], fp32 accumulate, both operands in shared memory: B K-major, A K-major
// (TransA 0: S^T, the keys' rows) or MN-major (TransA 1: V^T, the same rows read down their dims). N = 16, the skinny
// kernel's rows.
template <int N, int TransA>
__device__ __forceinline__ void wgmma_m64nNk16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  static_assert(N == 16, "the skinny kernel's item rows");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TransA));
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
    if constexpr (kExpNoScoreMma) {   // profiling aid: one k-step instead of 36
      if (ks > 0) continue;
    }
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
  if constexpr (!kExpNoPvMma) {   // profiling aid: skip O^T += V^T P^T
#pragma unroll
    for (int kk = 0; kk < PvSteps; ++kk)
#pragma unroll
      for (int mb = 0; mb < VBlocks; ++mb)
        wgmma_m64nNk16<N, 1>(o[mb], wg::SmemDesc(kv + mb * SlabBytes, SlabBytes, 1024).at(kk * 16 * 128),
                             pd.at(kk * 32), 1);
  }
  wg::wg_commit();
  wg::wg_wait0();
}

// The producer of a kernel with the keys as the wgmma M: thread pt of Threads (whole warpgroups) gathers its share of
// every tile of the block's items (Rows-row items of TileN-key tiles) into the ring of Stages key buffers sm.kv, eight
// threads per key with one 16-byte chunk of each slab each (a warp's copy is whole 128-byte lines; with two threads
// per key every sector crosses from L2 twice: 74.6 against 61.1 us at H16 N1 P131072, H200); it waits for a buffer's
// release on sm.empty, announces each tile on sm.full once its copies have landed, and runs on into the next item
// (fetch_item) while the others end theirs.
template <int Rows, int TileN, int Stages, int Threads, class SmemT, class Fetch>
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
    const ItemCtx cx = item_ctx<Rows, TileN>(prm, item);
    long long slot[kPasses];
#pragma unroll
    for (int r = 0; r < kPasses; ++r) slot[r] = wg::tile_key_slot<TileN>(prm, cx, 0, kq + r * kKeysPerPass);
    for (int t = 0; t < cx.ntiles; ++t, ++seq) {
      const int b = seq % Stages;
      long long next[kPasses];   // one tile ahead: their latency hides in the wait and the copies
#pragma unroll
      for (int r = 0; r < kPasses; ++r) next[r] = wg::tile_key_slot<TileN>(prm, cx, t + 1, kq + r * kKeysPerPass);
      mbar_wait(&sm.empty[b], ((seq / Stages) & 1) ^ 1u);   // the buffer's previous tile consumed (none at first)
#pragma unroll
      for (int r = 0; r < kPasses; ++r)
        wg::copy_key_chunks<TileN>(smem_u32(&sm.kv[b][0]), prm, cx, t, kq + r * kKeysPerPass, cc, slot[r]);
      wg::arrive_when_landed(&sm.full[b]);
      KDTREE_SKSTART(k == 0 && pt == 0 && seq < 2, 7 + (int)seq);
#pragma unroll
      for (int r = 0; r < kPasses; ++r) slot[r] = next[r];
    }
  }
}

}  // namespace km
}  // namespace kdtree
