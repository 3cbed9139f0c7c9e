// Microbenchmark (session 38, not yet run on a GPU): what does it cost two CTAs of a cluster to trade their fp32 partial
// scores every key tile through distributed shared memory, beside the products they would run? The question of
// docs/PERF_LOG.md next step 0-s38 (a split pass with every row of a request in each CTA of a pair, the CTAs split by
// dims, the partial S^T exchanged): at H16 N9 each CTA of a pair computes, per 64-key tile,
//   S^T  = 18 wgmma m64n144k16 (A: the tile's 64 keys x 288 dims, K-major; B: q, 144 rows x 288 dims)  ~1,296 clocks
//   O^T += 16 wgmma m64n144k16 (A: V^T, 4 blocks of 64 dims read MN-major from the tile; B: P^T, 144 rows x 64 keys)
//          ~1,152 clocks, and sends its 64 x 144 fp32 partial S^T (36,864 B) into the other CTA's shared memory, which
//   adds it to its own before the softmax.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_exchange.cu -o /tmp/micro_exchange
// One block of 3 warpgroups per SM (the layout that fits that design's registers: setmaxnreg 152 for the score
// warpgroup, 176 for two value warpgroups with 144 accumulators each; the pool is 384 x 168 = 504 a thread slot),
// persistent 2-CTA clusters, as many as are co-resident (printed: how many two-CTA clusters the GPU holds). Operands
// stay in shared memory (random bf16, no gather): only the products and the exchange run. Clocks per tile, per
// warpgroup, averaged over every CTA, for MODE bit 0 = the score warpgroup exchanges its partial after each S^T
// (st.async of 16-byte pieces into the peer's buffer, completing on the peer's mbarrier; the peer adds it and gives
// the buffer back with a remote arrive), bit 1 = the value warpgroups run their O^T products at the same time:
//   MODE 0: S^T alone; 1: S^T + exchange; 2: S^T beside O^T; 3: all three.
// Reading: the pair design's tile period is bounded by ~2,450 tensor clocks and ~2,800 of shared memory (item_shapes.py);
// if MODE 3's score loop stays near MODE 2's, the exchange hides; if it adds ~1,000+ clocks a tile, the design's
// projection (71 us at H16 N9 P131072) does not hold.
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
#include "micro_split.cuh"   // micro_common.cuh, wgmma_ops.inc, wgmma_round

constexpr int kRows = 144;                 // H16 N9: every row of the request, the wgmma N
constexpr int kKeys = 64;                  // a key tile: the wgmma M of S^T
constexpr int kSlabs = 5;                  // 320 dims in 128-byte swizzle rows (CTA 1 of a pair gathers [256, 576))
constexpr int kSSteps = 18;                // S^T over 288 dims
constexpr int kPvSteps = kKeys / 16;       // 4 k-steps of O^T; 256 value dims are 4 m64 blocks, 2 per value warpgroup
constexpr int kQSlab = kRows * 128;        // 18,432
constexpr int kKSlab = kKeys * 128;        // 8,192
constexpr int kXBytes = kKeys * kRows * 4; // 36,864: one partial S^T
constexpr int kThreads = 384;
constexpr int kLaunchRegs = 168, kScoreRegs = 152, kValueRegs = 176;
static_assert(kScoreRegs + 2 * kValueRegs <= 3 * kLaunchRegs, "setmaxnreg takes from the block's launch pool");

struct Smem {
  unsigned char q[kSlabs * kQSlab];        // 92,160
  unsigned char kv[kSlabs * kKSlab];       // 40,960
  unsigned char pt[kRows * 128];           // 18,432: P^T, [row][64 keys]
  float x[kXBytes / 4];                    // 36,864: the peer's partial S^T
  uint64_t xfull, xempty;                  // the peer's partial landed (tx bytes); my partial consumed by the peer
};
constexpr int kSmemBytes = sizeof(Smem) + 1024;

__device__ __forceinline__ void st_async_v4(uint32_t raddr, const float* v, uint32_t rbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
               ::"r"(raddr), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "r"(rbar) : "memory");
}
__device__ __forceinline__ void arrive_remote(uint32_t rbar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(rbar) : "memory");
}
__device__ __forceinline__ void arrive_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// clocks per tile of each warpgroup of each CTA: out[3 * block + wg]; sink keeps the products alive
template <int MODE>
__global__ void __launch_bounds__(kThreads, 1) exchange(int tiles, float* out, float* sink) {
  extern __shared__ __align__(1024) unsigned char raw[];
  Smem& sm = *reinterpret_cast<Smem*>(raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u));
  const int tid = threadIdx.x, wg = tid >> 7, t128 = tid & 127;
  const uint32_t peer = cluster_rank() ^ 1u;
  // operands: random bf16 in (-1, 1), the same in every CTA (timing only)
  for (int i = tid; i < (int)(offsetof(Smem, x) / 4); i += kThreads) {
    const unsigned h = (unsigned)i * 2654435761u;
    const unsigned lo = 0x3c00u | (h & 0x7fu) | ((h >> 9) & 0x8000u), hi = 0x3c00u | ((h >> 12) & 0x7fu) | ((h >> 1) & 0x8000u);
    reinterpret_cast<unsigned*>(&sm)[i] = lo | (hi << 16);
  }
  if (tid == 0) {
    mbar_init(&sm.xfull, 1);      // my arrival with the expected bytes; the peer's st.async complete them
    mbar_init(&sm.xempty, 1);     // the peer's thread 0, once it has read my partial
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // the operands, read next by wgmma
  cluster_sync();
  if (wg == 0) {
    // ============ score warpgroup: S^T, then (MODE & 1) the exchange ============
    set_max_regs<kScoreRegs, kLaunchRegs>();
    float s[72];
    const uint32_t rx = mapa(smem_u32(&sm.x[0]), peer) + t128 * 288;   // this thread's 288 B of the peer's buffer
    const uint32_t rfull = mapa(smem_u32(&sm.xfull), peer), rempty = mapa(smem_u32(&sm.xempty), peer);
    float keep = 0.f;
    const long long c0 = clock64();
    for (int t = 0; t < tiles; ++t) {
#pragma unroll
      for (int i = 0; i < 72; ++i) s[i] = 0.f;   // (before the round's fence: wgmma accumulates into them)
      wgmma_round([&] {
#pragma unroll
        for (int ks = 0; ks < kSSteps; ++ks)
          wgmma_ss_n144(s, desc_sw128(smem_u32(sm.kv) + (ks >> 2) * kKSlab + (ks & 3) * 32, 16, 1024),
                        desc_sw128(smem_u32(sm.q) + (ks >> 2) * kQSlab + (ks & 3) * 32, 16, 1024));
      });
      if constexpr (MODE & 1) {
        if (t > 0) wait_cluster(smem_u32(&sm.xempty), (t - 1) & 1);   // the peer has read my previous partial
#pragma unroll
        for (int i = 0; i < 18; ++i) st_async_v4(rx + 16 * i, &s[4 * i], rfull);
        if (t128 == 0) arrive_expect_tx(&sm.xfull, kXBytes);
        wait_cluster(smem_u32(&sm.xfull), t & 1);                       // the peer's partial has landed here
        const float4* mine = reinterpret_cast<const float4*>(&sm.x[t128 * 72]);
#pragma unroll
        for (int i = 0; i < 18; ++i) {
          const float4 v = mine[i];
          s[4 * i] += v.x; s[4 * i + 1] += v.y; s[4 * i + 2] += v.z; s[4 * i + 3] += v.w;
        }
        asm volatile("bar.sync 1, 128;\n" ::: "memory");     // every thread of the warpgroup has read it
        if (t128 == 0) arrive_remote(rempty);
      }
#pragma unroll
      for (int i = 0; i < 72; ++i) keep += s[i];
    }
    const long long c1 = clock64();
    if (t128 == 0) out[3 * blockIdx.x] = (float)(c1 - c0) / tiles;
    if (keep == 12345.f) sink[tid] = keep;
  } else {
    // ============ value warpgroups: O^T += V^T P^T over 2 blocks of 64 value dims each (MODE & 2) ============
    set_max_regs<kValueRegs, kLaunchRegs>();
    float o[2][72];
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int i = 0; i < 72; ++i) o[b][i] = 0.f;
    const int mb0 = 2 * (wg - 1);
    const long long c0 = clock64();
    if constexpr (MODE & 2) {
      for (int t = 0; t < tiles; ++t) {
        wgmma_round([&] {
#pragma unroll
          for (int kk = 0; kk < kPvSteps; ++kk)
#pragma unroll
            for (int b = 0; b < 2; ++b)
              wgmma_ss_n144_at(o[b], desc_sw128(smem_u32(sm.kv) + (mb0 + b) * kKSlab + kk * 16 * 128, kKSlab, 1024),
                               desc_sw128(smem_u32(sm.pt) + kk * 32, 16, 1024));
        });
      }
    }
    const long long c1 = clock64();
    float keep = 0.f;
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int i = 0; i < 72; ++i) keep += o[b][i];
    if (t128 == 0) out[3 * blockIdx.x + wg] = (float)(c1 - c0) / tiles;
    if (keep == 12345.f) sink[tid] = keep;
  }
  cluster_sync();   // neither CTA leaves while the other may still write into it
}

template <int MODE>
void run(int clusters, int tiles, float* out, float* sink, float* host) {
  cudaFuncSetAttribute(exchange<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = launch_config(2 * clusters, kThreads, kSmemBytes, 2, attr);
  for (int rep = 0; rep < 2; ++rep) cudaLaunchKernelEx(&cfg, exchange<MODE>, tiles, out, sink);   // the second is kept
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("MODE %d: %s\n", MODE, cudaGetErrorString(e)); return; }
  cudaMemcpy(host, out, 3 * 2 * clusters * sizeof(float), cudaMemcpyDeviceToHost);
  double s[3] = {0, 0, 0}, mx = 0;
  for (int b = 0; b < 2 * clusters; ++b)
    for (int w = 0; w < 3; ++w) { s[w] += host[3 * b + w]; if (w == 0) mx = std::max(mx, (double)host[3 * b]); }
  static const char* names[4] = {"S^T alone", "S^T + exchange", "S^T beside O^T", "S^T + exchange beside O^T"};
  printf("MODE %d %-28s clocks per 64-key tile: score %7.0f (max %7.0f), value %7.0f %7.0f\n", MODE, names[MODE],
         s[0] / (2 * clusters), mx, s[1] / (2 * clusters), s[2] / (2 * clusters));
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(exchange<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = launch_config(2, kThreads, kSmemBytes, 2, attr);
  int clusters = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, exchange<3>, &cfg);
  printf("%d SMs; two-CTA clusters co-resident at %d B of shared memory and %d threads a CTA: %d (%s)\n", sms,
         kSmemBytes, kThreads, clusters, cudaGetErrorString(e));
  if (clusters < 1) return 1;
  const int tiles = 512;
  float *out, *sink;
  cudaMalloc(&out, 3 * 2 * clusters * sizeof(float));
  cudaMalloc(&sink, kThreads * sizeof(float));
  std::vector<float> host(3 * 2 * clusters);
  run<0>(clusters, tiles, out, sink, host.data());
  run<1>(clusters, tiles, out, sink, host.data());
  run<2>(clusters, tiles, out, sink, host.data());
  run<3>(clusters, tiles, out, sink, host.data());
  return 0;
}
