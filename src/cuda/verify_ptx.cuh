// verify_ptx.cuh: thin wrappers of the PTX the kernels use (programmatic dependent launch, ldmatrix / stmatrix,
// cp.async, mma.sync, mbarriers, bulk and tensor copies, named barriers, the SFU exp2). One instruction each, no
// policy: the kernels decide when to call them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace kdtree {

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

// ---------------------------------------------------------------------------------------------
// mma.sync / ldmatrix / cp.async helpers
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3]) : "memory");
}

// ldmatrix of four 8x8 b16 matrices (.trans: transposed) from a shared-window address, or a generic pointer into it.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) { ldmatrix_x4(r, smem_u32(p)); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) { ldmatrix_x4_trans(r, smem_u32(p)); }

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

// D += A(16x32, row) * B(32x8, col), e4m3 in, fp32 accumulate: the FP8 kernel's one MMA primitive. Where the build
// targets the sm_120 family's arch-specific code (sm_120a / sm_121a) it is the block-scaled form (kind::mxf8f6f4, ue8m0
// scale 0x7f = 2^0 for every row and column: callers apply their scales in fp32), which runs at twice the rate of the
// plain form on consumer Blackwell; elsewhere it is the plain e4m3 mma.sync (sm_89+), whose fragments are the same:
// the stand-in that runs the sm_120 code path on an H100/H200. With unit scales both compute the same sums.
#if defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && __CUDA_ARCH_FAMILY_SPECIFIC__ >= 1200 && __CUDA_ARCH_FAMILY_SPECIFIC__ < 1300
#define KDTREE_E4M3_NATIVE 1   // device code of this compilation runs e4m3 mma.sync natively (and block-scaled)
#else
#define KDTREE_E4M3_NATIVE 0
#endif
__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if KDTREE_E4M3_NATIVE
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.e4m3.f32.ue8m0 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3}, %10, {0, 0}, %10, {0, 0};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0x7f7f7f7fu));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Two floats to two e4m3 (round to nearest even, saturating at +-448): lo in bits 0-7, hi in bits 8-15.
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ __half2 as_half2(uint32_t x) {
  __half2 h;
  memcpy(&h, &x, sizeof(h));
  return h;
}
__device__ __forceinline__ float2 f16x2_to_float2(uint32_t x) { return __half22float2(as_half2(x)); }
// Two e4m3 (bits 0-7, 8-15 of x) to an f16x2, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x) {
  uint32_t r;
  asm("{\n .reg .b16 lo;\n cvt.u16.u32 lo, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(r) : "r"(x));
  return r;
}
// Two floats as two e4m3, packed as cvt_e4m3x2 packs them, into `packed`; returns the values they stand for (the dual
// kernel's one-term P, verify_dual_fp8.cuh).
__device__ __forceinline__ float2 round_e4m3x2(float x0, float x1, uint32_t& packed) {
  packed = cvt_e4m3x2(x0, x1);
  return f16x2_to_float2(e4m3x2_to_f16x2(packed));
}
// Two floats as two e4m3 terms each, hi = e4m3(x) and lo = e4m3(x - hi), each pair packed as cvt_e4m3x2 packs it;
// returns the values hi + lo stand for (q's split, verify_q8.cuh; P's, verify_skinny_fp8.cuh).
__device__ __forceinline__ float2 split_e4m3x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const float2 h = round_e4m3x2(x0, x1, hi);
  const float2 l = round_e4m3x2(x0 - h.x, x1 - h.y, lo);
  return make_float2(h.x + l.x, h.y + l.y);
}
// Four e4m3 (a 32-bit word) to four bf16 (two words), exactly: e4m3 -> f16 (cvt) -> f32, whose upper halves are the
// bf16 values (an e4m3 value has 4 significant bits: no rounding), taken by one byte permute a pair.
__device__ __forceinline__ uint2 e4m3x4_to_bf16x4(uint32_t w) {
  const float2 lo = f16x2_to_float2(e4m3x2_to_f16x2(w)), hi = f16x2_to_float2(e4m3x2_to_f16x2(w >> 16));
  return make_uint2(__byte_perm(__float_as_uint(lo.x), __float_as_uint(lo.y), 0x7632),
                    __byte_perm(__float_as_uint(hi.x), __float_as_uint(hi.y), 0x7632));
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
// different instructions is undefined; compute-sanitizer's synccheck reports it as "Divergent thread(s) in block".)
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

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 x;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "r"(addr) : "memory");
  return x;
}

}  // namespace kdtree
