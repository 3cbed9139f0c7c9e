// verify_pingpong.cuh: the sm_90a split pass with two symmetric warpgroups ("ping-pong"): the same work
// items (64-row tiles, 32-key tiles), plan, partials and combine as the wgmma kernel in verify_wgmma.cuh.
//
// Why (docs/PERF_LOG.md, sessions 2-5): in the wgmma kernel one score warpgroup issues all 36 wgmma of
// S per tile plus the softmax, while two value warpgroups wait for P a third of the time; that serial
// stream sets the period (~4,400 clocks per 32 keys against ~1,500 of tensor work). Here both
// warpgroups do both jobs, on alternate tiles, so the softmax of one overlaps the products of the other:
// - WG w (w = 0, 1) owns tiles t = w, w + 2, ...: it gathers them (128 threads, 18 cp.async each),
//   computes S_t = Q K_t^T (36 wgmma m64n32k16, both operands in shared memory) and the softmax of
//   tile t. Every tile's P V is shared: WG w keeps O for value columns [256 w, 256 w + 256) of all 64
//   rows (128 fp32 per thread) and runs O = alpha_t O + P_t V_t for every tile t, its own P from
//   registers (RS wgmma), the other warpgroup's P from shared memory.
// - The online softmax runs in tile order across the two: the owner of tile t needs m_{t-1}, the
//   running row maxima after tile t-1, which the other warpgroup published with P_{t-1}. Each keeps its
//   own partial row sum (rescaled by every tile's alpha); at the end of the item the two are exchanged
//   through shared memory on the l_full mbarriers (an exchange across a named barrier or __syncthreads
//   drew RAW reports from racecheck, history 53; publishing the sums with every P cost ~5% at N65).
// - Hand-offs per tile, from the owner w to the other: m_t and P_t (p_full[w], an mbarrier with the
//   release / acquire; named barrier kBarP + w only wakes the waiting warpgroup up), and back: P_t and
//   V_t consumed (p_empty[w], one arrival per thread of the other warpgroup after its wgmma completed),
//   which also frees tile t's key buffer: the owner gathers tile t + 4 into it after that wait.
// - 4 key buffers: while the owner of tile t runs its softmax, tiles t - 1 .. t + 2 are in the ring.
#pragma once

#include "verify_wgmma.cuh"

namespace kdtree {
namespace pp {

using wg::SmemDesc;
using wg::desc_sw64;
using wg::kBlockM;
using wg::kTileN;
using wg::kSlabs;
using wg::kSlabBytes;
using wg::kTileBytes;
using wg::kQSlabBytes;
using wg::kChunksPerKey;
using wg::kKSteps;
using wg::kPvSteps;

constexpr int kStages = 4;
constexpr int kThreads = 256;                  // 2 warpgroups
constexpr int kGatherThreads = 128;            // a tile's owner gathers it
constexpr int kPRowBytes = kTileN * 2;         // 64: P rows in the 64-byte swizzle (K-major A)
constexpr int kPBytes = kBlockM * kPRowBytes;  // 4,096

// Named barriers (0 is __syncthreads).
constexpr int kBarP = 1;     // + w: the owner w arrives after publishing P, the other warpgroup syncs

struct Smem {
  unsigned char q[kSlabs * kQSlabBytes];   // 73,728: q of the item (the struct sits on a 1 KB boundary)
  unsigned char kv[kStages][kTileBytes];   // 147,456 (also read as q's rows 16-63 with KDTREE_WG_Q16)
  unsigned char p[2][kPBytes];             // P of warpgroup w's latest tile
  float m[2][kBlockM];                     // the running row maxima after warpgroup w's latest tile
  float l[2][kBlockM];                     // warpgroup w's row sums at the end of an item
  unsigned long long full[kStages];        // tile landed: 128 arrivals, one per gather thread of its owner
  unsigned long long p_full[2];            // P / m of warpgroup w published: 128 arrivals (release)
  unsigned long long p_empty[2];           // consumed by the other warpgroup: 128 arrivals (release)
  unsigned long long l_full[2];            // warpgroup w's row sums of the item stored: 128 arrivals (release)
  int item;
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;   // + room to align the base to 1 KB
static_assert(kSmemBytes <= 232448, "sm_90 gives a block at most 227 KB of shared memory");
static_assert(kPBytes % 512 == 0, "64-byte swizzle atoms (8 rows x 64 B) stay 512 B aligned");
static_assert(kChunksPerKey * kTileN == 18 * kGatherThreads, "a gather thread copies 18 chunks per tile");

__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

// D[64 x 256] (+)= A[64 x 16] (registers) * B[16 x 256] (shared memory, MN-major), fp32 accumulate.
__device__ __forceinline__ void wgmma_m64n256k16_rs_bt(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
  asm volatile(
      "{\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// Gather thread gt (0..127) of the owner: chunk gt % 8 of each slab of keys gt / 8 and gt / 8 + 16 of tile t into
// buffer b (wg::copy_tile, two keys per thread).
__device__ __forceinline__ void gather_tile(Smem& sm, const Params& prm, const ItemCtx& cx, int t, int b, int gt,
                                            const long long (&slot)[2]) {
  wg::copy_tile<2>(smem_u32(&sm.kv[b][0]), &sm.full[b], prm, cx, t, gt, slot);
}

__global__ void __launch_bounds__(kThreads, 1) kdtree_verify_split_pingpong_kernel(Params prm) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem& sm = wg::smem_1k<Smem>(smem_raw);
  const int tid = threadIdx.x;
  const int w = tid >> 7;               // warpgroup: owns tiles t % 2 == w and value columns [256 w, 256 w + 256)
  const int gt = tid & 127;             // thread within the warpgroup
  const int wrow = ((tid >> 5) & 3) * 16;   // rows of this warp within the tile
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int c = lane & 3;
  grid_dependency_wait();   // the plan kernel's counter and plan
  grid_dependency_launch_dependents();   // after the wait: the combine reads the plan as soon as it starts
  const int total = prm.counter[1];
  const int H = prm.heads;

  if (tid == 0) {
    for (int b = 0; b < kStages; ++b) mbar_init(&sm.full[b], kGatherThreads);
    for (int i = 0; i < 2; ++i) {
      mbar_init(&sm.p_full[i], 128);
      mbar_init(&sm.p_empty[i], 128);
      mbar_init(&sm.l_full[i], 128);
    }
    fence_proxy_async();
  }
  __syncthreads();

  uint32_t full_bits = 0u;            // parity of the next wait per key buffer
  uint32_t pf_parity = 0u;            // p_full[1 - w]: the other warpgroup's P
  uint32_t pe_parity = 0u;            // p_empty[w]: own P consumed
  uint32_t lf_parity = 0u;            // l_full[1 - w]: once per item
  const SmemDesc qd(smem_u32(&sm.q[0]), 16, 1024);
  for (int k = 0;; ++k) {
    if (tid == 0) sm.item = claim_item(prm, k);
    __syncthreads();
    const int item = sm.item;
    if (item >= total) return;
    const ItemCtx cx = item_ctx<wg::kItemRows, kTileN>(prm, item);
    const int nt = cx.ntiles;

    // q of the item (swizzled K-major, zeros for padding rows): 64 rows x 72 chunks over 256 threads,
    // one cp.async group; then the owner's first two tiles, their slot ids loaded together first
    wg::issue_q_copies(prm, cx, H, sm.q, tid, kThreads);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    long long s0[2], s1[2], pend[2];
    wg::tile_slots<2>(prm, cx, w, gt, s0);
    wg::tile_slots<2>(prm, cx, w + 2, gt, s1);
    wg::tile_slots<2>(prm, cx, w + 4, gt, pend);
    gather_tile(sm, prm, cx, w, w, gt, s0);
    gather_tile(sm, prm, cx, w + 2, w + 2, gt, s1);
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");   // this thread's q copies (the gathers are uncommitted)
    fence_proxy_async();
    __syncthreads();   // all of q in shared memory

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY};   // the running maxima after the latest tile seen
    float l_run[2] = {0.f, 0.f};               // this warpgroup's partial row sums, relative to m_run
    float s[16];
    uint32_t pa[8];                            // own P of the latest tile as RS A fragments (2 k-steps)

    auto wait_full = [&](int t) { mbar_wait_buffer(sm.full, full_bits, t % kStages); };
    auto v_desc = [&](int t, int kk) {   // B of P V: V_t, value columns of this warpgroup, k-step kk
      return SmemDesc(smem_u32(&sm.kv[t % kStages][0]) + (4 * w) * kSlabBytes, kSlabBytes, 1024).at(kk * 16 * 128);
    };
    // P V of the other warpgroup's tile u (after its P and m are published): alpha_u from the maxima
    // before / after u; this warpgroup's earlier products complete before O is rescaled (wait<0>, which
    // also waits for S of the own tile: ptxas does not follow wait<1> across the loop's back edge and
    // serialises every wgmma otherwise, C7514)
    auto other_pv = [&](int u) {
      bar_sync(kBarP + (1 - w), kThreads);
      mbar_wait(&sm.p_full[1 - w], pf_parity);
      pf_parity ^= 1u;
      wait_full(u);
      float a[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float m_new = sm.m[1 - w][wrow + g + half * 8];
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        a[half] = fast_exp2(m_run[half] - m_use);
        m_run[half] = m_new;
        l_run[half] *= a[half];
      }
      wg::wg_wait0();
      wg::rescale_o(o, a[0], a[1]);
      fence_proxy_async();
      wg::wg_fence();
      const uint64_t pdesc = desc_sw64(smem_u32(&sm.p[1 - w][0]));
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) wg::wgmma_m64n256k16_ss_bt(o, pdesc + ((kk * 32) >> 4), v_desc(u, kk), 1);
      wg::wg_commit();
    };

    int t = w;
    for (; t < nt; t += 2) {
      // 1. S_t
      wait_full(t);
      fence_proxy_async();   // cp.async wrote the tile (generic proxy); wgmma reads it (async proxy)
      {
        const SmemDesc kd(smem_u32(&sm.kv[t % kStages][0]), 16, 1024);
        wg::wg_fence();
#pragma unroll
        for (int ks = 0; ks < kKSteps; ++ks)
          wg::wgmma_m64n32k16_ss(s, qd.at((ks >> 2) * kQSlabBytes + (ks & 3) * 32),
                                 kd.at((ks >> 2) * kSlabBytes + (ks & 3) * 32), ks > 0);
        wg::wg_commit();
      }
      // 2. P V of the other warpgroup's tile t - 1
      if (t > 0) other_pv(t - 1);
      // 3. softmax of tile t once S_t is done (other_pv waited for it; P V (t - 1) may still run; ptxas
      //    wants the wait<1> before the scores are read all the same, C7514 otherwise)
      if (t > 0) wg_wait1(); else wg::wg_wait0();
      float tmax[2], m_use[2], alpha[2];
      scale_mask_max(prm, cx, H, cx.k0 + t * kTileN, wrow + g, c, s, tmax);
      softmax_advance(tmax, m_run, m_use, alpha);
      softmax_p_pairs(s, m_use, alpha, l_run, [&](int j, int half, uint32_t pair) {
        // A fragment of k-step j / 2: a0 / a1 rows g / g + 8 keys 2c.., a2 / a3 the same 8 keys later
        pa[4 * (j >> 1) + 2 * (j & 1) + half] = pair;
      });
      // 4. publish P_t and m_t once the other warpgroup is done with this warpgroup's previous tile
      //    (the first own tile of an item waits on the phase before: complete); that also frees the
      //    key buffer of tile t - 2: gather tile t + 2 into it
      if (t >= 2) {
        mbar_wait(&sm.p_empty[w], pe_parity);
        pe_parity ^= 1u;
      }
#pragma unroll
      for (int j = 0; j < kTileN / 8; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = wrow + g + half * 8;
          *reinterpret_cast<uint32_t*>(&sm.p[w][row * kPRowBytes + ((j ^ ((row >> 1) & 3)) << 4) + 4 * c]) =
              pa[4 * (j >> 1) + 2 * (j & 1) + half];
        }
      }
      if (c == 0) {
        sm.m[w][wrow + g] = m_run[0];
        sm.m[w][wrow + g + 8] = m_run[1];
      }
      fence_proxy_async();   // P is read next by wgmma (the async proxy); m by plain loads
      mbar_arrive(&sm.p_full[w]);
      bar_arrive(kBarP + w, kThreads);
      if (t >= 2) {
        gather_tile(sm, prm, cx, t + 2, (t + 2) % kStages, gt, pend);
        wg::tile_slots<2>(prm, cx, t + 4, gt, pend);
      }
      // 5. P V of tile t: the other tile's product done (then release its P and key buffer), O rescaled
      wg::wg_wait0();
      if (t > 0 && t + 1 < nt) mbar_arrive(&sm.p_empty[1 - w]);   // not after the other's last tile
      wg::rescale_o(o, alpha[0], alpha[1]);
      wg::wg_fence();
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) {
        const uint32_t(&a)[4] = *reinterpret_cast<const uint32_t(*)[4]>(&pa[4 * kk]);
        wgmma_m64n256k16_rs_bt(o, a, v_desc(t, kk));
      }
      wg::wg_commit();
    }
    // the other warpgroup's last tile, if the item ends on it
    if ((nt - 1) % 2 != w) {
      other_pv(nt - 1);
    }
    wg::wg_wait0();

    // end of the item: both warpgroups' row sums (each relative to the final maxima: every tile's were
    // seen) exchanged on the l_full mbarriers and added, O normalised into its row
    quad_sum_rows(l_run);
    if (c == 0) {
      sm.l[w][wrow + g] = l_run[0];
      sm.l[w][wrow + g + 8] = l_run[1];
    }
    mbar_arrive(&sm.l_full[w]);
    mbar_wait(&sm.l_full[1 - w], lf_parity);
    lf_parity ^= 1u;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wrow + g + half * 8;
      if (r < cx.rows) {
        const float l = l_run[half] + sm.l[1 - w][r];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        if (w == 0 && c == 0 && cx.rp.nsplit > 1) write_partial_lse(prm, cx, H, r, m_run[half], l);
        wg::store_o_row(prm, cx, r, w, o, half, c, inv);
      }
    }
    __syncthreads();   // the item's shared memory is consumed before the next item starts
    if (tid == 32) signal_item_done(prm, cx);   // every partial of the item is stored (not the claimer)
  }
#else
  __trap();   // built without sm_90a: the launcher never selects this kernel
#endif
}

}  // namespace pp
}  // namespace kdtree
