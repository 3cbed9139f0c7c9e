// The split kernel's per-tile work as the microbenchmarks repeat it (micro_contention.cu, micro_intake.cu): the
// shared-memory layout (q: 9 slabs of 8 KB, a 4-stage key ring of 9 slabs of 4 KB per 32-key tile, P: 8 KB), one
// round of S or P V issued by a warpgroup, and one tile's gather by the 256 threads of two warpgroups.
#pragma once
#include "micro_common.cuh"
#include "wgmma_ops.inc"

constexpr int kQ = 9 * 8192, kTile = 9 * 4096, kRing = 4 * kTile, kP = 8192;

// The block's shared memory on a 1 KB boundary, filled with a bf16-ish pattern and made visible to wgmma.
__device__ __forceinline__ unsigned char* split_smem(unsigned char* raw, int nthreads) {
  unsigned char* sm = raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u);
  for (int i = threadIdx.x; i < (kQ + kRing + kP) / 4; i += nthreads) reinterpret_cast<uint32_t*>(sm)[i] = 0x3c003c00u ^ (i & 0xff);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  return sm;
}

// Whether `flag` is set, as one answer for the whole warpgroup `wg`: wgmma (.sync.aligned) needs all four warps of
// a warpgroup on the same path, and warps polling a flag on their own may see it change at different rounds (one
// warp leaving its loop while the others issue the next wgmma: "illegal instruction", session 11). The
// warpgroup's first thread reads it into slots[2 wg + round % 2]; named barrier 8 + wg hands it on (two slots, so
// that a round's write never meets the previous round's reads).
__device__ __forceinline__ bool wg_flag(const int* flag, int* slots, int wg, long long round) {
  int* slot = &slots[2 * wg + (int)(round & 1)];
  if (threadIdx.x % 128 == 0) *slot = *(const volatile int*)flag;
  asm volatile("bar.sync %0, 128;\n" ::"r"(8 + wg) : "memory");
  return *(volatile int*)slot != 0;
}

// One round of a warpgroup's wgmma: fence, the issues (`issue`), commit, wait for them all.
template <typename Issue>
__device__ __forceinline__ void wgmma_round(Issue issue) {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  issue();
  asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// The descriptors of k-step ks (16 columns) of q (qb: 64-column slabs of 8 KB) and of a 32-key tile (slabs of
// 4 KB), in the kernel's 128-byte swizzle.
__device__ __forceinline__ uint64_t q_desc(uint32_t qb, int ks) {
  return desc_sw128(qb + (ks >> 2) * 8192 + (ks & 3) * 32, 16, 1024);
}
__device__ __forceinline__ uint64_t k_desc(uint32_t kbase, int ks) {
  return desc_sw128(kbase + (ks >> 2) * 4096 + (ks & 3) * 32, 16, 1024);
}

// S of one 32-key tile: 36 wgmma m64n32k16, q (qb) and the keys (kbase) in shared memory.
__device__ __forceinline__ void s_round_n32(float (&s)[16], uint32_t qb, uint32_t kbase) {
  wgmma_round([&] {
#pragma unroll
    for (int ks = 0; ks < 36; ++ks) wgmma_ss_n32(s, q_desc(qb, ks), k_desc(kbase, ks));
  });
}

// S of one 32-key tile with q from registers (wgmma RS): no q bytes from shared memory. The kernel would hold 36
// fragments (144 registers); 9 repeated stand in for them here (the operands' source, not their values, matters).
__device__ __forceinline__ void s_round_n32_rs(float (&s)[16], const uint32_t (&qa)[9][4], uint32_t kbase) {
  wgmma_round([&] {
#pragma unroll
    for (int ks = 0; ks < 36; ++ks) wgmma_rs_n32(s, qa[ks % 9], k_desc(kbase, ks));
  });
}

// The same FLOPs as N = 64: 18 wgmma m64n64k16 (64 rows x 128 B of keys per k-step; the access pattern, not
// the data, matters).
__device__ __forceinline__ void s_round_n64(float (&s)[32], uint32_t qb, uint32_t kbase) {
  wgmma_round([&] {
#pragma unroll
    for (int ks = 0; ks < 18; ++ks) wgmma_ss_n64(s, q_desc(qb, ks), k_desc(kbase, ks));
  });
}

// P V of one tile for 256 value columns: 2 wgmma m64n256k16, P (pb) K-major, V (vbase) MN-major.
__device__ __forceinline__ void pv_round(float (&o)[128], uint32_t pb, uint32_t vbase) {
  wgmma_round([&] {
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
      wgmma_ss_n256_bt(o, desc_sw128(pb + kk * 32, 16, 1024), desc_sw128(vbase + kk * 2048, 4096, 1024));
  });
}

// Gather thread vt (0..255) copies chunk vt % 8 of every slab of key vt / 8 of one 32-key tile (the kernel's
// split: 9 cp.async of 16 B) from pool row `slot` into the ring tile at `tile`; returns with at most kInFlight
// tiles of this thread's copies outstanding.
// (gather_tile_copies: the copies alone, for a caller that tracks them on an mbarrier.)
__device__ __forceinline__ void gather_tile_copies(const unsigned char* pool, int slot, int vt, uint32_t tile) {
  const int key = vt / 8, cc = vt % 8;
  const unsigned char* src = pool + (long long)slot * 1152 + cc * 16;
  const uint32_t dst = tile + key * 128 + ((cc ^ (key & 7)) << 4);
#pragma unroll
  for (int slab = 0; slab < 9; ++slab)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + slab * 4096), "l"(src + slab * 128) : "memory");
}
template <int kInFlight = 4>
__device__ __forceinline__ void gather_tile_async(const unsigned char* pool, int slot, int vt, uint32_t tile) {
  gather_tile_copies(pool, slot, vt, tile);
  asm volatile("cp.async.commit_group;\ncp.async.wait_group %0;\n" ::"n"(kInFlight - 1) : "memory");
}
