// Microbenchmark: the split kernel's per-tile chain with ONE score warpgroup that holds q in registers (wgmma RS),
// so that the 72 KB of q leave shared memory to two more key buffers (docs/PERF_LOG.md, next step 0; session 17,
// written without device time; its first run, in session 18, hung: see the register pool below).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_pipe.cu -o /tmp/micro_pipe
// Why: the dual kernel (two score warpgroups, q in shared memory, four 32-key buffers) takes ~2,620 clocks per tile
// at H16 N9 P131072; a tile lands ~2,400 clocks after its copies are issued at that rate, however many are in flight
// (micro_flight, history 115), and then waits inside the SM. Registers allow q in registers for one score warpgroup
// only (144 of its 192 registers, beside two value warpgroups at 160): session 8's one-score-warpgroup layout, which
// lost to two score warpgroups because its softmax waited behind its own wgmma. (The registers of a 384-thread CTA are
// 64,512, not 65,536: the score warpgroup gets 184 beside two value warpgroups at 160, and q's 144 leave it 40; QK 32
// keeps q_pe's 8 KB in shared memory and 56 registers free, at one key buffer less.) Does that layout, with S reading no q
// from shared memory and a ring of six buffers, beat ~2,620 clocks per tile, and the dual layout in the same frame?
// 1 CTA per SM, 384 threads (SWG 1), the kernel's protocol without masks, items or results:
// - warpgroup 0 (score, setmaxnreg 184): per tile t, waits for its keys (full[t % RING]), S = q K^T (36 wgmma
//   m64n32k16: RS with q's 36 fragments in registers, or SS with q in shared memory), the online softmax of its 64 x
//   32 scores (row maxima over the quad, exp2, running sums), P as bf16 into p[t % 2] (64-byte swizzle, as the dual
//   kernel) and alpha into shared memory once the value warpgroups are done with P (t - 2), then p_full[t % 2];
// - warpgroups 1-2 (value, setmaxnreg 160): wait for P (t), rescale O (64 rows x 256 columns each), P V (2 x 2 wgmma
//   m64n128k16, V MN-major from the tile's buffer), release P, and once both are done with the buffer refill it with
//   tile t + RING (9 cp.async of 16 B per thread, cp.async.mbarrier.arrive.noinc on full[b]).
// SWG 2 is the dual kernel's layout in the same frame (the baseline): two score warpgroups at 88 registers with q in
// shared memory take alternate tiles and hand each other the running row maxima (m of tile t - 1 before tile t's
// softmax, as verify_dual.cuh), two value warpgroups at 168, a ring of 4.
// Keys: random 1152-byte rows from a 2.4 GB pool, each key range read by `reuse` consecutive CTAs (3: the three 64-row
// items of an H16 N9 split). GATHER false: the keys stay in place (the chain alone, no copies).
// Reports the median SM's clocks per tile (the value side's P V of tiles kSkip .. kTiles - 1) and the keys' rate into
// the SMs. Compare the lines within one run (micro numbers vary 5-20% between runs).
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#include "micro_split.cuh"

constexpr int kTiles = 600, kSkip = 100;
constexpr int kPBytes = 64 * 64;   // P of one tile: 64 rows x 32 keys bf16, 64-byte rows

// K-major operand in the 64-byte swizzle (8-row atoms of 512 B), as the kernels' P (src/cuda/verify_wgmma.cuh).
__device__ __forceinline__ uint64_t desc_sw64(uint32_t saddr) {
  return ((uint64_t)((512u >> 4) | (2u << 30)) << 32) | (((saddr & 0x3FFFF) >> 4) | (1u << 16));
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(a), "f"(b));
  return r;
}
// mbar_wait with a bound: a protocol error traps after ~2 s instead of holding the device until the run's timeout.
// (SWG 2's score warpgroups at 88 registers spill with it: there, the plain wait.)
template <bool Bounded>
__device__ __forceinline__ void mbar_wait_b(uint64_t* b, uint32_t parity) {
  if constexpr (!Bounded) {
    mbar_wait(b, parity);
    return;
  }
  uint32_t done;
  const long long t0 = clock64();
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(smem_u32(b)), "r"(parity) : "memory");
    if (!done && clock64() - t0 > 4000000000ll) __trap();
  } while (!done);
}
template <int SWG, int QK, int RING, bool GATHER>
__global__ void __launch_bounds__(128 * (SWG + 2), 1) pipe(const unsigned char* pool, const int* slots, int nslots,
                                                           int reuse, const uint32_t* qsrc, long long* out) {
  static_assert(SWG == 1 || QK == 0, "q in registers fits one score warpgroup only");
  static_assert(QK % 4 == 0 && QK <= 36, "q's k-steps from registers: whole 64-column slabs");
  constexpr bool QREG = QK > 0;
  constexpr int kThreads = 128 * (SWG + 2), kLaunchRegs = SWG == 1 ? 168 : 128;
  // setmaxnreg moves registers between the warpgroups of a CTA only: the launch's 384 x 168 (SWG 1) or 512 x 128
  // are the pool. (Session 17's 192 + 2 x 160 = 65,536 for SWG 1 exceeded 64,512, and setmaxnreg.inc waited forever.)
  constexpr int kScoreRegs = SWG == 1 ? 184 : 88, kValueRegs = SWG == 1 ? 160 : 168;
  static_assert(128 * SWG * kScoreRegs + 256 * kValueRegs <= kThreads * kLaunchRegs, "register pool");
  extern __shared__ __align__(1024) unsigned char raw[];
  unsigned char* sm = raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u);
  constexpr int kQBytes = (36 - QK) / 4 * 8192;   // the k-steps S reads from shared memory
  const uint32_t qb = smem_u32(sm), kb = qb + kQBytes, pb = kb + RING * kTile;
  __shared__ uint64_t full[RING], p_full[2], p_empty[2], m_full[2];
  __shared__ float alpha[2][64], m_x[2][64];   // m_x[s]: score warpgroup s's running maxima after its latest tile
  __shared__ long long t_first, t_last;
  for (int i = threadIdx.x; i < (kQBytes + RING * kTile + 2 * kPBytes) / 4; i += kThreads)
    reinterpret_cast<uint32_t*>(sm)[i] = 0x3c003c00u ^ (i & 0xff);   // (GATHER: the ring is overwritten)
  if (threadIdx.x == 0) {
    for (int b = 0; b < RING; ++b) mbar_init(&full[b], 256);
    for (int i = 0; i < 2; ++i) {
      mbar_init(&p_full[i], 128);
      mbar_init(&p_empty[i], 256);
      mbar_init(&m_full[i], 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int r0 = (warp & 3) * 16 + g;   // the thread's two rows r0, r0 + 8 (wgmma accumulator layout)
  if (warp < 4 * SWG) {
    // =========================== score warpgroup(s) ===========================
    set_max_regs<kScoreRegs, kLaunchRegs>();
    const int sw = warp / 4;   // takes tiles t % SWG == sw
    uint32_t qa[QREG ? QK : 1][4];   // q's A fragments: loaded once from global memory, so that they are registers
#pragma unroll
    for (int k = 0; k < (QREG ? QK : 1); ++k)
#pragma unroll
      for (int j = 0; j < 4; ++j) qa[k][j] = qsrc[(k * 4 + j) * 128 + threadIdx.x];
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    for (int t = sw; t < kTiles; t += SWG) {
      const int b = t % RING, pi = t & 1;   // (SWG 2: pi == sw, each score warpgroup's own P)
      if (GATHER) {
        mbar_wait_b<SWG == 1>(&full[b], (t / RING) & 1);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // cp.async wrote them, wgmma reads them
      }
      float s[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) s[i] = 0.f;
      wgmma_round([&] {
#pragma unroll
        for (int ks = 0; ks < 36; ++ks) {
          if (ks < QK) wgmma_rs_n32(s, qa[ks < QK ? ks : 0], k_desc(kb + b * kTile, ks));
          else wgmma_ss_n32(s, q_desc(qb, ks - QK), k_desc(kb + b * kTile, ks));
        }
      });
      // the online softmax: the tile's row maxima (a row's 32 scores are on the 4 threads of a quad), rescale
      // factors, P = 2^(s - m), running sums (per thread; the quad sum would come at the item's end)
      float m_use[2], al[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (SWG == 2 && h == 0 && t > 0) {   // the other warpgroup's maxima after tile t - 1
          mbar_wait_b<SWG == 1>(&m_full[1 - sw], ((t - 1) >> 1) & 1);
          m_run[0] = m_x[1 - sw][r0];
          m_run[1] = m_x[1 - sw][r0 + 8];
        }
        const float m_new = fmaxf(m_run[h], mx * 1e-3f);   // (scaled: the pattern's scores stay finite)
        al[h] = ex2(m_run[h] - m_new);
        m_use[h] = m_new;
        m_run[h] = m_new;
      }
      if (SWG == 2 && t + 1 < kTiles) {   // published before P (read by the other warpgroup's tile t + 1)
        if (c == 0) {
          m_x[sw][r0] = m_run[0];
          m_x[sw][r0 + 8] = m_run[1];
        }
        mbar_arrive(&m_full[sw]);
      }
      if (t >= 2) mbar_wait_b<SWG == 1>(&p_empty[pi], ((t >> 1) - 1) & 1);   // the value warpgroups are done with P (t - 2)
      unsigned char* p = sm + kQBytes + RING * kTile + pi * kPBytes;
      float ps[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float p0 = ex2(s[4 * j + 2 * h] * 1e-3f - m_use[h]), p1 = ex2(s[4 * j + 2 * h + 1] * 1e-3f - m_use[h]);
          ps[h] += p0 + p1;
          const int row = r0 + 8 * h;
          *reinterpret_cast<uint32_t*>(&p[row * 64 + ((j ^ ((row >> 1) & 3)) << 4) + 4 * c]) = pack_bf16(p0, p1);
        }
#pragma unroll
      for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * al[h] + ps[h];
      if (c == 0) {
        alpha[pi][r0] = al[0];
        alpha[pi][r0 + 8] = al[1];
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // P is read by wgmma next
      mbar_arrive(&p_full[pi]);
    }
    if (l_run[0] + l_run[1] == 1234.5f) out[0] = 0;   // keeps the softmax
  } else {
    // =========================== value warpgroups ===========================
    set_max_regs<kValueRegs, kLaunchRegs>();
    const int vt = threadIdx.x - 128 * SWG, v = vt >> 7;
    unsigned seed = (blockIdx.x / reuse) * 977u + vt / 8;
    auto refill = [&](int t) {   // tile t into buffer t % RING, announced on full[t % RING] once landed
      seed = seed * 1664525u + 1013904223u;
      gather_tile_copies(pool, slots[seed % nslots], vt, kb + (t % RING) * kTile);
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(&full[t % RING])) : "memory");
    };
    if (GATHER)
      for (int t = 0; t < RING; ++t) refill(t);
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    for (int t = 0; t < kTiles; ++t) {
      const int b = t % RING, pi = t & 1;
      mbar_wait_b<SWG == 1>(&p_full[pi], (t >> 1) & 1);
      if (GATHER) mbar_wait_b<SWG == 1>(&full[b], (t / RING) & 1);   // complete by now (its score warpgroup saw it): acquires V
      const float a0 = alpha[pi][r0], a1 = alpha[pi][r0 + 8];
      if (!__all_sync(0xffffffffu, a0 == 1.f && a1 == 1.f)) {   // accumulator i is row r0 + 8 ((i >> 1) & 1)
#pragma unroll
        for (int i = 0; i < 128; ++i) o[i] *= (i & 2) ? a1 : a0;
      }
      const uint64_t pd = desc_sw64(pb + pi * kPBytes);
      const uint32_t vbase = kb + b * kTile + (4 * v) * 4096;
      // as the dual kernel: each k-step as two m64n128k16 halves (no instruction needs more than 128 registers, which
      // a 512-thread launch allows; history 73)
      float(&o_lo)[64] = *reinterpret_cast<float(*)[64]>(&o[0]);
      float(&o_hi)[64] = *reinterpret_cast<float(*)[64]>(&o[64]);
      wgmma_round([&] {
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          wgmma_ss_n128_bt(o_lo, pd + ((kk * 32) >> 4), desc_sw128(vbase + kk * 2048, 4096, 1024));
          wgmma_ss_n128_bt(o_hi, pd + ((kk * 32) >> 4), desc_sw128(vbase + 2 * 4096 + kk * 2048, 4096, 1024));
        }
      });
      mbar_arrive(&p_empty[pi]);
      if (vt == 0 && t == kSkip) t_first = clock64();   // (the period: P V of tiles kSkip .. kTiles - 1)
      if (GATHER) {
        asm volatile("bar.sync 1, 256;\n" ::: "memory");   // both value warpgroups are done with buffer b
        if (t + RING < kTiles) refill(t + RING);
      }
    }
    if (vt == 0) t_last = clock64();
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) acc += o[i];
    if (acc == 1234.5f) out[1] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = (t_last - t_first) / (kTiles - 1 - kSkip);
}

template <int SWG, int QK, int RING, bool GATHER>
void run(const char* what, const KeyPool& k, const uint32_t* qsrc, int reuse) {
  const int sms = k.sms;
  const int smem = (36 - QK) / 4 * 8192 + RING * kTile + 2 * kPBytes + 1024;
  long long* d;
  cudaMalloc(&d, sms * 8);
  auto kernel = pipe<SWG, QK, RING, GATHER>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const float ms = best_ms([&] { kernel<<<sms, 128 * (SWG + 2), smem>>>(k.pool, k.slots, k.rows, reuse, qsrc, d); });
  const cudaError_t e = cudaDeviceSynchronize();
  std::vector<long long> h(sms);
  cudaMemcpy(h.data(), d, sms * 8, cudaMemcpyDeviceToHost);
  std::sort(h.begin(), h.end());
  const double bytes = GATHER ? (double)sms * kTiles * kTile : 0.0;
  printf("%-44s reuse %d | %6lld clk/tile (median SM; p10 %lld, p90 %lld) | keys into the SMs %5.2f TB/s | %s\n", what,
         reuse, h[sms / 2], h[sms / 10], h[9 * sms / 10], bytes / (ms * 1e-3) / 1e12, cudaGetErrorString(e));
  cudaFree(d);
}

int main() {
  setvbuf(stdout, nullptr, _IONBF, 0);   // each line as it is measured (session 17's run lost its buffer to a hang)
  const KeyPool k = key_pool();
  uint32_t* qsrc;   // q's fragments: any bf16 pattern (the operands' source, not their values, matters)
  cudaMalloc(&qsrc, 36 * 4 * 128 * 4);
  fill<<<64, 256>>>(qsrc, 36 * 4 * 128);
  // QK: q's k-steps held in registers (36: all of q, 144 registers; 32: the 512 nope columns, q_pe's 8 KB in smem)
  run<2, 0, 4, false>("2 score WGs, SS (the dual kernel), no gather", k, qsrc, 3);
  run<1, 0, 4, false>("1 score WG, q in smem (SS), no gather", k, qsrc, 3);
  run<1, 36, 4, false>("1 score WG, q in registers (RS), no gather", k, qsrc, 3);
  run<2, 0, 4, true>("2 score WGs, SS, ring 4 (the dual kernel)", k, qsrc, 3);
  run<1, 0, 4, true>("1 score WG, SS, ring 4 (session 8's layout)", k, qsrc, 3);
  run<1, 36, 4, true>("1 score WG, RS, ring 4", k, qsrc, 3);
  run<1, 36, 6, true>("1 score WG, RS, ring 6 (q's 72 KB as 2 buffers)", k, qsrc, 3);
  run<1, 32, 5, true>("1 score WG, RS nope + SS pe, ring 5", k, qsrc, 3);
  run<2, 0, 4, true>("2 score WGs, SS, ring 4, keys read once", k, qsrc, 1);
  run<1, 36, 6, true>("1 score WG, RS, ring 6, keys read once", k, qsrc, 1);
  return 0;
}
