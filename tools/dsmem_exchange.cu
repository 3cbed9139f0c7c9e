// dsmem_exchange.cu: what exchanging a 64-key tile's fp32 partial S^T between the two CTAs of a cluster costs beside
// the tile's products, on sm_90a. It answers the first question of the two-CTA item split by dims (docs/performance.md,
// "What would move the rest"): each CTA computes S^T of a 64-key tile for 144 rows over half of the 576 key dims (18
// wgmma m64n144k16), then adds the other CTA's partial, 64 x 144 fp32 = 36 KB, received through distributed shared
// memory. If the exchange adds ~1,000 SM clocks or more to a score warpgroup's tile, that design's projection fails.
//
// Both CTAs of 2-CTA clusters on every SM run `tiles` tiles over a resident key tile and q (no DRAM: the products'
// shared-memory reads and the exchange only; the 18 k-steps wrap around three resident 64-dim slabs, the same bytes a
// step as 4.5 distinct ones). Warpgroup w takes tiles w, w + WG, ...; its partial goes to the same warpgroup of the
// peer CTA, one receive buffer each, full / empty mbarriers at cluster scope. Variants: products alone, products and
// exchange, exchange alone; one or two warpgroups a CTA (two: one's exchange beside the other's products); the
// partial sent by remote stores or by one bulk copy. Prints SM clocks a tile (median over CTAs) and checks the
// exchange: both CTAs hold the same data, so every sum received doubles the CTA's own.
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Isrc/cuda tools/dsmem_exchange.cu -o /tmp/dsmem_xchg
//   /tmp/dsmem_xchg [tiles]   (512 by default)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "verify_wgmma.cuh"

using kdtree::smem_u32;
using kdtree::wg::SmemDesc;

namespace {

constexpr int kKeys = 64, kRows = 144, kDims = 288, kKSteps = kDims / 16;   // 18 k16 steps: half of 576 dims
constexpr int kSlabs = 3;   // resident slabs of 64 dims; the 18 k-steps wrap around them (the same bytes a step)
constexpr int kAccum = kKeys * kRows / 128;                                 // 72 fp32 a thread
constexpr int kVec = kAccum / 4;                                            // 18 16-byte chunks a thread

// How a warpgroup's partial reaches the peer: not at all, by its threads' remote 16-byte stores (each then arrives on
// the peer's mbarrier, release at cluster scope), or by local stores and one bulk copy shared::cta -> shared::cluster
// that completes on the peer's mbarrier (complete_tx).
enum class Mode { kNone, kStore, kBulk };

template <int WG, Mode M>
struct Smem {
  unsigned char keys[kSlabs][kKeys * 128];   // A: 64 keys, K-major, 128-byte swizzle
  unsigned char q[kSlabs][kRows * 128];      // B: 144 rows, K-major, 128-byte swizzle
  float4 recv[WG][kVec][128];   // the peer's partial of each warpgroup's tile: thread t's chunk i at [i][t]
  float4 send[M == Mode::kBulk ? WG : 1][kVec][128];   // the bulk copy's source
  unsigned long long full[WG], empty[WG];
};

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t peer_address(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void st_cluster_v4(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}
__device__ __forceinline__ void arrive_cluster(uint32_t bar) {   // bar: a shared::cluster address (the peer's)
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void wait_cluster(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_copy_to_peer(uint32_t dst_peer, uint32_t src, int bytes, uint32_t bar_peer) {
  asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dst_peer), "r"(src), "r"(bytes), "r"(bar_peer)
               : "memory");
}

// D[64 x 144] (+)= A[64 x 16] * B[16 x 144], both shared memory, K-major, bf16, fp32 accumulate.
__device__ __forceinline__ void wgmma_m64n144k16(float (&d)[kAccum], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %74, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n144k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71}, %72, %73, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

template <int WG, bool kProducts, Mode M>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(WG * 128, 1)
    exchange_kernel(int tiles, float* sink, long long* clocks) {
  extern __shared__ unsigned char raw[];
  Smem<WG, M>& sm = kdtree::wg::smem_1k<Smem<WG, M>>(raw);
  const int tid = threadIdx.x, w = tid / 128, t = tid % 128;
  const uint32_t peer = cluster_rank() ^ 1u;
  // the same small values in both CTAs: keys and q in [-1, 1) by a hash of the byte offset (exact in bf16)
  for (int i = tid; i < (int)(sizeof(sm.keys) + sizeof(sm.q)) / 2; i += WG * 128) {
    const unsigned h = (unsigned)i * 2654435761u;
    reinterpret_cast<__nv_bfloat16*>(&sm.keys[0][0])[i] = __float2bfloat16((float)((h >> 24) & 0xff) / 128.f - 1.f);
  }
  if (tid == 0) {
    for (int g = 0; g < WG; ++g) {
      kdtree::mbar_init(&sm.full[g], M == Mode::kBulk ? 1 : 128);
      kdtree::mbar_init(&sm.empty[g], 128);
      if (M == Mode::kBulk) kdtree::mbar_arrive_expect_tx(&sm.full[g], (int)sizeof(sm.recv[0]));   // phase 0's bytes
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  kdtree::fence_proxy_async();
  __syncthreads();
  cluster_sync();

  const SmemDesc kd(smem_u32(&sm.keys[0][0]), 16, 1024), qd(smem_u32(&sm.q[0][0]), 16, 1024);
  const uint32_t recv_peer = peer_address(smem_u32(&sm.recv[w][0][t]), peer);
  const uint32_t full_peer = peer_address(smem_u32(&sm.full[w]), peer);
  const uint32_t empty_peer = peer_address(smem_u32(&sm.empty[w]), peer);
  float acc[kAccum];
  float total = 0.f;
  const long long c0 = clock64();
  int j = 0;   // this warpgroup's tiles so far
  for (int i = w; i < tiles; i += WG, ++j) {
    if constexpr (kProducts) {
      kdtree::wg::wg_fence();
#pragma unroll
      for (int s = 0; s < kKSteps; ++s)
        wgmma_m64n144k16(acc, kd.at((s / 4 % kSlabs) * kKeys * 128 + (s % 4) * 32),
                         qd.at((s / 4 % kSlabs) * kRows * 128 + (s % 4) * 32), s > 0);
      kdtree::wg::wg_commit();
      kdtree::wg::wg_wait0();
    } else {
#pragma unroll
      for (int a = 0; a < kAccum; ++a) acc[a] = (float)((i + a) & 7);
    }
    if constexpr (M != Mode::kNone) {
      if (j > 0) wait_cluster(smem_u32(&sm.empty[w]), (j - 1) & 1);   // the peer has read our previous partial
      if constexpr (M == Mode::kStore) {
#pragma unroll
        for (int v = 0; v < kVec; ++v)
          st_cluster_v4(recv_peer + v * 128 * 16, acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]);
        arrive_cluster(full_peer);
      } else {
#pragma unroll
        for (int v = 0; v < kVec; ++v)
          sm.send[w][v][t] = make_float4(acc[4 * v], acc[4 * v + 1], acc[4 * v + 2], acc[4 * v + 3]);
        kdtree::fence_proxy_async();   // the stores, before the bulk copy (async proxy) reads them
        kdtree::bar_sync(1 + w, 128);
        if (t == 0)
          bulk_copy_to_peer(peer_address(smem_u32(&sm.recv[w][0][0]), peer), smem_u32(&sm.send[w][0][0]),
                            (int)sizeof(sm.recv[0]), full_peer);
      }
      wait_cluster(smem_u32(&sm.full[w]), j & 1);
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const float4 r = sm.recv[w][v][t];
        acc[4 * v] += r.x;
        acc[4 * v + 1] += r.y;
        acc[4 * v + 2] += r.z;
        acc[4 * v + 3] += r.w;
      }
      if (M == Mode::kBulk && t == 0) kdtree::mbar_arrive_expect_tx(&sm.full[w], (int)sizeof(sm.recv[0]));   // next
      arrive_cluster(empty_peer);
    }
#pragma unroll
    for (int a = 0; a < kAccum; ++a) total += acc[a];
  }
  const long long c1 = clock64();
  __syncthreads();
  cluster_sync();   // no CTA leaves while its peer may still write into it
  sink[blockIdx.x * blockDim.x + tid] = total;
  if (tid == 0) clocks[blockIdx.x] = c1 - c0;
}

struct Result {
  double clocks_per_tile;
  std::vector<float> sink;
};

template <int WG, bool kProducts, Mode M>
Result run(int blocks, int tiles) {
  auto kernel = exchange_kernel<WG, kProducts, M>;
  const int smem = (int)sizeof(Smem<WG, M>) + 1024;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  float* sink;
  long long* clocks;
  cudaMalloc(&sink, sizeof(float) * blocks * WG * 128);
  cudaMalloc(&clocks, sizeof(long long) * blocks);
  for (int rep = 0; rep < 3; ++rep) kernel<<<blocks, WG * 128, smem>>>(tiles, sink, clocks);   // the last one counts
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::fprintf(stderr, "WG=%d products=%d mode=%d: %s\n", WG, kProducts, (int)M, cudaGetErrorString(err));
    std::exit(1);
  }
  std::vector<long long> c(blocks);
  Result r;
  r.sink.resize((size_t)blocks * WG * 128);
  cudaMemcpy(c.data(), clocks, sizeof(long long) * blocks, cudaMemcpyDeviceToHost);
  cudaMemcpy(r.sink.data(), sink, sizeof(float) * r.sink.size(), cudaMemcpyDeviceToHost);
  cudaFree(sink);
  cudaFree(clocks);
  std::sort(c.begin(), c.end());
  r.clocks_per_tile = (double)c[c.size() / 2] / tiles;
  return r;
}

template <int WG, Mode M>
void report(int blocks, int tiles, const Result& p) {
  const Result px = run<WG, true, M>(blocks, tiles);
  const Result x = run<WG, false, M>(blocks, tiles);
  double worst = 0.0;   // products + exchange must be twice products alone, thread by thread
  for (size_t i = 0; i < p.sink.size(); ++i)
    worst = std::max(worst, (double)std::abs(px.sink[i] - 2.f * p.sink[i]) /
                                std::max(1.0, (double)std::abs(p.sink[i])));
  std::printf("| %d | %d | %s | %.0f | %.0f | %.0f | %+.0f | %.1e |\n", WG, blocks,
              M == Mode::kStore ? "remote stores" : "bulk copy", p.clocks_per_tile, px.clocks_per_tile,
              x.clocks_per_tile, px.clocks_per_tile - p.clocks_per_tile, worst);
}

template <int WG>
void report_all(int blocks, int tiles) {
  const Result p = run<WG, true, Mode::kNone>(blocks, tiles);
  report<WG, Mode::kStore>(blocks, tiles, p);
  report<WG, Mode::kBulk>(blocks, tiles, p);
}

}  // namespace

int main(int argc, char** argv) {
  const int tiles = argc > 1 ? std::atoi(argv[1]) : 512;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, %d SMs, %d tiles a CTA, SM clocks a tile (median over CTAs)\n\n", prop.name, sms, tiles);
  std::printf("| warpgroups a CTA | CTAs | exchange by | products | products + exchange | exchange | exchange adds "
              "| check |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  report_all<1>(sms / 2 * 2, tiles);
  report_all<2>(sms / 2 * 2, tiles);
  report_all<1>(2, tiles);
  report_all<2>(2, tiles);
  return 0;
}
