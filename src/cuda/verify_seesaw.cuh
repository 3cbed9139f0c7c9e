// verify_seesaw.cuh: an sm_90a split pass of two warpgroups that each hold half of O and take turns at S
// (KDTREE_SPLIT_KERNEL=seesaw, session 24; opt-in). The same work items (64-row tiles of the plan's 32-key tiles),
// plan, partials and combine as the dual kernel (verify_dual.cuh).
//
// Why: the dual kernel's four warpgroups (512 threads) cap every instruction at 128 registers, so its S runs as
// m64n32k16 (2 KB of q and 1 KB of keys from shared memory per 16-clock wgmma: S is bound by shared memory) and its
// P V as two m64n128k16 halves; the trace of session 23 puts its period (~2,070 clocks per 32 keys) on the value
// warpgroups' chain (P, P V behind S, 9 copies per thread). Here 256 threads may hold up to 255 registers each:
// - Steps of 64 keys (two of the plan's tiles) in a ring of two 72 KB buffers beside q (72 KB). Warpgroup w owns the
//   steps u = w, w + 2, ... (buffer w): S_u = Q K_u^T as 36 wgmma m64n64k16 (half of m64n32k16's q reads per key;
//   q's rope slab, the last 4 k-steps, from registers), the running maxima (m_{u-1} comes with P_{u-1} from the other
//   warpgroup), and P_u (64 x 64 bf16) into its P buffer for both warpgroups.
// - Each warpgroup holds O for value columns [256 w, 256 w + 256) (128 fp32 per thread) and, for every step in
//   order, O = alpha_u O + P_u V_u as 4 wgmma m64n256k16.
// - Each warpgroup copies the V slabs it reads (4 of the 9 slabs) of every step, and the owner the rope slab, once
//   its own P V of the step before in that buffer is done: no warpgroup waits for the other's P V before a refill
//   (in the dual kernel the same per-warpgroup refill, KDTREE_DUAL_OWN_SLABS, was 1-9% slower: history 149).
// - P buffers: buffer 0 in its own 8 KB, buffer 1 where q's rope slab was (that slab goes to registers at the item's
//   start); shared memory holds nothing else of size.
// Predicted (arithmetic): ~152 KB of shared-memory traffic per 32 keys against the dual kernel's ~180, and a
// buffer's chain S -> softmax -> P V -> refill -> flight of ~4,300-4,800 clocks per two steps (~1,100-1,200 per 32
// keys). Measured (H200, session 24, PERF_LOG history 150-153): correct (kernel tests, racecheck split / many,
// memcheck and synccheck split clean) and 23.5% fewer shared-memory wavefronts than the dual kernel (ncu), but 0.7-2.0%
// slower at H16 N9 P131072 (126.2 against 123.7 us) and up to 7% elsewhere: the trace's period is ~4,120 clocks per
// 64-key step (~2,060 per 32 keys, the dual kernel's), a chain through both warpgroups: P (u - 1) published ->
// P V (u - 1) issued (~760) -> S (u) issued (~1,600, behind the P V on the tensor pipe) and done (~1,020) -> softmax
// (~640) -> P (u). So it is never chosen unless asked for.
#pragma once

#include "verify_wgmma.cuh"

namespace kdtree {
namespace seesaw {

using wg::SmemDesc;
using wg::kBlockM;
using wg::kSlabs;
using wg::kSlabDims;
using wg::kKSteps;

constexpr int kThreads = 256;                      // two warpgroups
constexpr int kStepN = 64;                         // keys per step (two plan tiles)
constexpr int kSlabBytes = kStepN * 128;           // 8,192: one 64-column slab of a step's keys
constexpr int kStepBytes = kSlabs * kSlabBytes;    // 73,728
constexpr int kQSlabBytes = kBlockM * 128;         // 8,192
constexpr int kPBytes = kBlockM * kStepN * 2;      // 8,192: P of a step, [row][64 keys], 128-byte swizzle
constexpr int kQRegSteps = 4;                      // S's last 4 k-steps (q's rope slab) from registers
constexpr int kPvSteps = kStepN / 16;              // 4
static_assert(kPBytes == kQSlabBytes, "P buffer 1 takes the place of q's rope slab");
static_assert(kQRegSteps * 16 == kSlabDims, "the register k-steps are exactly q's last slab");

// A warpgroup's step u: its refill, the other warpgroup's P V (u - 1), S (u), softmax (u), P V (u), so S (u) waits
// behind P (u - 1). Measured and removed (session 24, calls 3-5, PERF_LOG history 151-153): S (u) as soon as its keys
// land, with the other's P V (u - 1) after the softmax (u) (+11 to +16%), beside the softmax (+2 to +11%), or beside S
// (u) (+1 to +6%). (ptxas serialises every wgmma of the kernel when a wait for the other's P V sits behind a test
// other than the one that issued it, C7514, or when O is rescaled while S is in flight without a wait in that path.)

// Named barriers (0 is __syncthreads).
constexpr int kBarStage = 1;   // the item's rows staged for the store (store_o_rows_staged), all 256 threads
constexpr int kBarWg = 2;      // + w: warpgroup w's four warps (its P written; its P V of a buffer done)

struct Smem {
  unsigned char q[kSlabs * kQSlabBytes];   // 73,728: q of the item; slab 8 is P buffer 1 once q's rope is in registers
  unsigned char kv[2][kStepBytes];         // 147,456: steps u = 0, 1 (mod 2)
  unsigned char p0[kPBytes];               // P buffer 0 (warpgroup 0's steps)
  float alpha[2][kBlockM];                 // warpgroup w's latest step: its rescale factors
  float m[2][kBlockM];                     // ... and the running row maxima after it
  float xl[kBlockM], xmu[kBlockM];         // warpgroup 1's row sums at the end of an item, their reference
  float row_l[kBlockM];                    // the item's row sums
  unsigned long long full[2];     // step landed: 256 arrivals (each thread's copies into the buffer)
  unsigned long long p_full[2];   // P / alpha / m of warpgroup w's latest step: 128 arrivals (release)
  unsigned long long q_land;      // q landed by TMA: 1 arrival + its 72 KB
  // (the item index and the row sums go from thread to thread on mbarriers: racecheck reported those store / load pairs
  // across __syncthreads, as history 53's and the dual kernel's item index)
  unsigned long long l_full;      // warpgroup 1's row sums stored: 128 arrivals
  unsigned long long r_full;      // warpgroup 0's merged row sums (row_l) stored: 128 arrivals
  unsigned long long item_full;   // the block's next work item stored: 1 arrival
  int item[2];
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;   // + room to align the base to 1 KB
static_assert(kSmemBytes <= 232448, "sm_90 gives a block at most 227 KB of shared memory");
static_assert(2 * kStepBytes >= kBlockM * 1024, "the ring holds an item's 64 rows of 512 bf16 for the store");

__device__ __forceinline__ unsigned char* p_buf(Smem& sm, int w) { return w ? &sm.q[(kSlabs - 1) * kQSlabBytes] : sm.p0; }

// D[64 x 64] (+)= A[64 x 16] (registers: warp w of the warpgroup rows 16 w .. 16 w + 15, mma.m16n8k16's A fragment)
// * B[16 x 64] (shared memory, K-major), fp32 accumulate.
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b,
                                                   int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, "
      "%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// The slot ids of thread i's (0..127 of its warpgroup) keys i / 8 + 16 h (h < 4) of step u.
__device__ __forceinline__ void step_slots(const Params& prm, const ItemCtx& cx, int u, int i, long long (&slot)[4]) {
#pragma unroll
  for (int h = 0; h < 4; ++h) slot[h] = wg::tile_key_slot<kStepN>(prm, cx, u, (i >> 3) + 16 * h);
}

// Thread i of warpgroup w copies chunk i % 8 of V slabs 4 w .. 4 w + 3 of its four keys of step u (and, with `rope`,
// of their rope slab) into buffer u % 2 in the 128-byte swizzled layout [slab][key][128 B] (zero-fill past the split
// end), then arrives on the buffer's mbarrier once they have landed. Nothing past the item's last step.
__device__ __forceinline__ void copy_step(Smem& sm, const Params& prm, const ItemCtx& cx, int u, int nu, int w, int i,
                                          const long long (&slot)[4], bool rope) {
  if (u >= nu) return;
  const uint32_t stage = smem_u32(&sm.kv[u & 1][0]);
  const int cc = i & 7;
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    const int kt = (i >> 3) + 16 * h;
    const int key = cx.k0 + u * kStepN + kt;
    const int bytes = key < cx.k1 ? 16 : 0;
    const __nv_bfloat16* src = key_ptr(prm, cx, key, slot[h]) + cc * 8;
    const uint32_t dst = stage + kt * 128 + ((cc ^ (kt & 7)) << 4);
#pragma unroll
    for (int j = 0; j < 4; ++j) cp_async_16z(dst + (4 * w + j) * kSlabBytes, src + (4 * w + j) * kSlabDims, bytes);
    if (rope) cp_async_16z(dst + (kSlabs - 1) * kSlabBytes, src + (kSlabs - 1) * kSlabDims, bytes);
  }
  wg::arrive_when_landed(&sm.full[u & 1]);
}

#ifdef KDTREE_EXP_TRACE   // profiling aid: block 0's stamps per 64-key step u, by the owner's first warp (wg::trace,
// printed after the call): 0 step start, 1 own refill issued, 2 the other's P V (u - 1) issued, 3 keys landed, 4 S
// issued, 5 P V (u - 1) done and the other's refill issued, 6 S done, 7 P published, 8 P written by all four warps,
// 9 P V (u) issued
#define KDTREE_STRACE(e)                                                                                \
  do {                                                                                                  \
    if (blockIdx.x == 0 && (tid & 127) == 0 && k < wg::trace::kItems && u < wg::trace::kTiles)          \
      wg::trace::g_tile[0][k][u][e] = (unsigned)(clock64() - t_item);                                   \
  } while (0)
#else
#define KDTREE_STRACE(e) do { } while (0)
#endif

__global__ void __launch_bounds__(kThreads, 1) kdtree_verify_split_seesaw_kernel(const __grid_constant__ Params prm) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem& sm = wg::smem_1k<Smem>(smem_raw);
  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int c = lane & 3;
  const int w = warp >> 2;            // warpgroup: value columns [256 w, 256 w + 256), steps u = w (mod 2)
  const int i = tid & 127;            // thread within the warpgroup
  const int wrow = (warp & 3) * 16;   // rows of this warp within the tile
  grid_dependency_wait();   // the plan kernel's counter and plan
  grid_dependency_launch_dependents();
  const int total = prm.counter[1];
  const int H = prm.heads;
  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      mbar_init(&sm.full[b], kThreads);
      mbar_init(&sm.p_full[b], 128);
    }
    mbar_init(&sm.q_land, 1);
    mbar_init(&sm.l_full, 128);
    mbar_init(&sm.r_full, 128);
    mbar_init(&sm.item_full, 1);
    fence_proxy_async();
  }
  __syncthreads();

  uint32_t full_bits = 0u, pf_bits = 0u;
  const SmemDesc qd(smem_u32(&sm.q[0]), 16, 1024);
  for (int k = 0;; ++k) {
    const int item = wg::fetch_item(prm, k, tid, sm.item, &sm.item_full);
    if (item >= total) return;
    const ItemCtx cx = item_ctx<kBlockM, wg::kTileN>(prm, item);
    const int nu = (cx.ntiles + 1) / 2;   // 64-key steps
#ifdef KDTREE_EXP_TRACE
    const long long t_item = clock64();
#endif

    // q: nine TMA boxes from one thread, or 16-byte copies over all threads
    if (prm.q_tma) {
      if (tid == 0) wg::issue_q_tma(prm, cx, H, sm.q, &sm.q_land);
    } else {
      wg::issue_q_copies(prm, cx, H, sm.q, tid, kThreads);
      cp_async_commit();
    }
    // steps 0 and 1: this warpgroup's V slabs of both, the rope slab of its own
    long long slot[4];
    step_slots(prm, cx, 0, i, slot);
    copy_step(sm, prm, cx, 0, nu, w, i, slot, w == 0);
    step_slots(prm, cx, 1, i, slot);
    copy_step(sm, prm, cx, 1, nu, w, i, slot, w == 1);
    step_slots(prm, cx, 2, i, slot);   // the next refill's (steps are refilled in order)
    if (prm.q_tma) {
      mbar_wait(&sm.q_land, k & 1);
    } else {
      cp_async_wait_group<0>();   // this thread's q copies (its steps' copies are in no group: still in flight)
      fence_proxy_async();
      __syncthreads();
    }
    // q's rope slab (k-steps 32..35) into registers; then that slab is P buffer 1
    uint32_t qa[kQRegSteps][4];
    wg::load_q_regs(qa, sm.q, wrow, lane);
    __syncthreads();   // every thread's rope of q read: P buffer 1 may be written

    float o[128];
#pragma unroll
    for (int j = 0; j < 128; ++j) o[j] = 0.f;
    float m_prev[2] = {-INFINITY, -INFINITY};   // m of the step before this warpgroup's next
    float mu[2] = {-INFINITY, -INFINITY};       // m_use of this warpgroup's latest step (its sums' reference)
    float l_own[2] = {0.f, 0.f};
    float sc[32];

    // O += P V of step v (this warpgroup's 256 value columns of buffer v % 2, P from `p`), issued and committed
    auto pv = [&](int v, const unsigned char* p) {
      const uint64_t pd = SmemDesc(smem_u32(p), 16, 1024).at(0);
      const SmemDesc vd(smem_u32(&sm.kv[v & 1][0]) + (4 * w) * kSlabBytes, kSlabBytes, 1024);
      wg::wg_fence();
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) wg::wgmma_m64n256k16_ss_bt(o, pd + ((kk * 32) >> 4), vd.at(kk * 16 * 128), 1);
      wg::wg_commit();
    };
    // P V of the other warpgroup's step v (its P, alpha and m, published on p_full), after this warpgroup's previous
    // P V
    auto pv_other = [&](int v) {
      mbar_wait(&sm.p_full[1 - w], (pf_bits >> (1 - w)) & 1u);
      pf_bits ^= 1u << (1 - w);
      m_prev[0] = sm.m[1 - w][wrow + g];
      m_prev[1] = sm.m[1 - w][wrow + g + 8];
      const float a0 = sm.alpha[1 - w][wrow + g], a1 = sm.alpha[1 - w][wrow + g + 8];
      wg::wg_wait0();   // this warpgroup's P V of the step before (O is its accumulator)
      wg::rescale_o(o, a0, a1);
      pv(v, p_buf(sm, 1 - w));
    };

    for (int u = w; u < nu; u += 2) {
      const int b = u & 1;   // == w
      KDTREE_STRACE(0);
      // 1. this warpgroup's parts of its own buffer for step u, once its P V of step u - 2 is done (steps 0, 1 came
      //    with the prologue)
      if (u >= 2) {
        wg::wg_wait0();
        bar_sync(kBarWg + w, 128);   // all four warps' P V (u - 2) done
        copy_step(sm, prm, cx, u, nu, w, i, slot, true);
        step_slots(prm, cx, u + 1, i, slot);
      }
      KDTREE_STRACE(1);
      // 2. P V of the other warpgroup's step u - 1 (its P came while this one waited for its tile)
      if (u >= 1) pv_other(u - 1);
      KDTREE_STRACE(2);
      // 3. S (u)
      mbar_wait_buffer(sm.full, full_bits, b);
      KDTREE_STRACE(3);
      fence_proxy_async();   // cp.async wrote the step (generic proxy); wgmma reads it (async proxy)
      {
        const SmemDesc kd(smem_u32(&sm.kv[b][0]), 16, 1024);
        wg::wg_fence();
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks) {
          const uint64_t db = kd.at((ks >> 2) * kSlabBytes + (ks & 3) * 32);
          if (ks >= kKSteps - kQRegSteps)
            wgmma_m64n64k16_rs(sc, qa[ks - (kKSteps - kQRegSteps)], db, 1);
          else
            wg::wgmma_m64n64k16_ss(sc, qd.at((ks >> 2) * kQSlabBytes + (ks & 3) * 32), db, ks > 0);
        }
        wg::wg_commit();
      }
      KDTREE_STRACE(4);
      // 4. the other's buffer: this warpgroup's V slabs of step u + 1, once its P V (u - 1) is done
      if (u >= 1) {
        wg::wg_wait_group<1>();   // all but S (u)
        bar_sync(kBarWg + w, 128);
        if (u + 1 < nu) {
          copy_step(sm, prm, cx, u + 1, nu, w, i, slot, false);
          step_slots(prm, cx, u + 2, i, slot);
        }
      }
      KDTREE_STRACE(5);
      wg::wg_wait0();   // S (u)
      KDTREE_STRACE(6);
      // 5. softmax (u): P (u) into this warpgroup's P buffer, alpha and m beside it
      float tmax[2];
      scale_mask_max<kStepN / 8>(prm, cx, H, cx.k0 + u * kStepN, wrow + g, c, sc, tmax);
      float m_run[2] = {m_prev[0], m_prev[1]};
      float m_use[2], alpha[2];
      softmax_advance(tmax, m_run, m_use, alpha);
      float lfac[2];
      move_sums_reference(mu, m_use, lfac);
      unsigned char* const pb = p_buf(sm, w);
      softmax_p_pairs<kStepN / 8>(sc, m_use, lfac, l_own, [&](int j, int half, uint32_t pair) {
        const int row = wrow + g + half * 8;
        *reinterpret_cast<uint32_t*>(&pb[row * 128 + ((j ^ (row & 7)) << 4) + 4 * c]) = pair;
      });
      if (c == 0) {
        sm.alpha[w][wrow + g] = alpha[0];
        sm.alpha[w][wrow + g + 8] = alpha[1];
        sm.m[w][wrow + g] = m_run[0];
        sm.m[w][wrow + g + 8] = m_run[1];
      }
      fence_proxy_async();   // P is read next by wgmma (the async proxy); alpha and m by plain loads
      mbar_arrive(&sm.p_full[w]);
      KDTREE_STRACE(7);
      bar_sync(kBarWg + w, 128);   // this warpgroup's P written (its own P V reads all 64 rows)
      KDTREE_STRACE(8);
      // 6. P V (u), this warpgroup's half
      wg::rescale_o(o, alpha[0], alpha[1]);
      pv(u, pb);
      KDTREE_STRACE(9);
    }
    // the other warpgroup's last step, if it has the item's last
    if (((nu - 1) & 1) != w) pv_other(nu - 1);
    wg::wg_wait0();

    // end of the item: the rows' sums (each warpgroup's relative to its latest m_use), merged by warpgroup 0
    quad_sum_rows(l_own);
    if (w == 1) {
      wg::put_row_sums(sm.xl, sm.xmu, wrow, g, c, l_own, mu);
      mbar_arrive(&sm.l_full);
    }
    __syncthreads();   // (also: every P V is done, no copy is in flight: the ring may take the staged rows)
    if (w == 0) {
      mbar_wait(&sm.l_full, k & 1);
      float m_fin[2], l_fin[2];
      wg::merge_row_sums(sm.xl, sm.xmu, wrow, g, c, l_own, mu, m_fin, l_fin, sm.row_l);
      write_partial_lse_rows(prm, cx, H, wrow + g, c, m_fin, l_fin);
      mbar_arrive(&sm.r_full);
    } else {
      mbar_wait(&sm.r_full, k & 1);
    }
    __syncwarp();   // (warpgroup 0: its own lanes' row_l)
    wg::store_o_rows_staged(prm, cx, wrow, lane, w, o, sm.row_l, smem_u32(&sm.kv[0][0]), kBarStage, kThreads);
    __syncthreads();   // every partial of the item stored; the item's shared memory consumed
    if (tid == 0) signal_item_done(prm, cx);
#ifdef KDTREE_EXP_TRACE
    if (tid == 0 && blockIdx.x == 0 && k < wg::trace::kItems) {   // (printed after the call: wg::trace)
      wg::trace::g_item[0][k] = {item, nu, clock64() - t_item};
      wg::trace::g_items[0] = k + 1;
    }
#endif
  }
#else
  __trap();   // built without sm_90a: the launcher never selects this kernel
#endif
}

}  // namespace seesaw
}  // namespace kdtree
