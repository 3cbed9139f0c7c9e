// Microbenchmark: can a cluster of 3 SMs that all need every key (the three 64-row items of an H16 N9
// split) get the keys into their shared memory faster than three independent gathers?
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_cluster.cu -o /tmp/micro_cluster
// Persistent 3-CTA clusters (one CTA per SM) walk splits round-robin; each split streams 32-key tiles
// (1152-byte rows, random slots, row-major [key][1152 B]) through a STAGES-deep ring in every CTA of the
// cluster. Per-stage mbarriers only (no cluster barrier per tile): `full` counts the bytes, `empty`
// counts the three CTAs that have consumed the stage (remote arrive), so a producer refills a stage of
// every CTA only when all three are done with it.
// MODE 0: each CTA bulk-copies all 32 rows itself (three L2 reads per key: today's kernel);
//      1: each CTA bulk-copies a third of the rows with .multicast::cluster into all three CTAs;
//      2: each CTA bulk-copies a third of the rows into its own shared memory, then pushes that third
//         to the two peers with shared::cta -> shared::cluster bulk copies (DSMEM).
// Every tile's bytes are checked against the pool on the first split of each cluster.
#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <random>
#include <vector>
#include <cuda_runtime.h>
#include "micro_common.cuh"

constexpr int kTile = 32, kKeyBytes = 1152, kTileBytes = kTile * kKeyBytes, kThreads = 128;
__device__ __forceinline__ uint32_t cluster_id() { uint32_t r; asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r)); return r; }
__device__ __forceinline__ uint32_t nclusters() { uint32_t r; asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r)); return r; }
template <int MODE, int STAGES>
__global__ void __launch_bounds__(kThreads, 1) gather(const unsigned char* pool, const int* slots, int nkeys, int chunk,
                                                     unsigned* sink, int* bad) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) uint64_t full[STAGES], own[STAGES], empty[STAGES];
  const int tid = threadIdx.x;
  const uint32_t rank = cluster_rank();
  const int nsplit = (nkeys + chunk - 1) / chunk;
  // keys of a tile fetched by CTA r (modes 1, 2): [r * 11, min(32, r * 11 + 11))
  const int my0 = rank * 11, my1 = min(kTile, my0 + 11);
  if (tid == 0) {
    for (int b = 0; b < STAGES; ++b) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&full[b])) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&own[b])) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(&empty[b])), "r"(MODE == 0 ? 1 : 3) : "memory");
    }
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  cluster_sync();
  unsigned acc = 0;
  uint32_t full_ph = 0, own_ph = 0, empty_ph = 0;
  long long issued = 0;   // tiles issued into the ring so far (all splits): stage = issued % STAGES
  long long consumed = 0;
  int first = 1;
  for (int split = cluster_id(); split < nsplit; split += nclusters()) {
    const int k0 = split * chunk, k1 = min(nkeys, k0 + chunk);
    const int ntiles = (k1 - k0 + kTile - 1) / kTile;
    // warp 0 issues: lane 0 waits for the stage and posts the byte count, then lane k copies key k of
    // the tile (its slot loaded by that lane: no chain of dependent index loads in one thread)
    const int lane = tid & 31;
    auto issue = [&](int t) {
      const int b = (int)(issued % STAGES);
      if (issued >= STAGES) {   // all three CTAs are done with what stage b held
        wait_cluster(smem_u32(&empty[b]), (empty_ph >> b) & 1u);
        empty_ph ^= 1u << b;
      }
      ++issued;
      unsigned char* buf = ring + b * kTileBytes;
      const uint32_t fb = smem_u32(&full[b]);
      const int mine = my1 - my0;
      const int key = min(k0 + t * kTile + lane, nkeys - 1);
      const long long slot = slots[key];
      const unsigned char* src = pool + slot * kKeyBytes;
      const uint32_t dst = smem_u32(buf + lane * kKeyBytes);
      if (MODE == 0) {
        if (lane == 0)
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(fb), "r"(kTileBytes) : "memory");
        __syncwarp();
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                     ::"r"(dst), "l"(src), "r"(kKeyBytes), "r"(fb) : "memory");
      } else if (MODE == 1) {   // every CTA's full[b] receives all 32 rows (a third from each CTA)
        if (lane == 0)
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(fb), "r"(kTileBytes) : "memory");
        __syncwarp();
        if (lane >= my0 && lane < my1)
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n"
                       ::"r"(dst), "l"(src), "r"(kKeyBytes), "r"(fb), "h"((unsigned short)7) : "memory");
      } else {   // own third -> own[b]; the peers' thirds arrive on full[b] (pushed after they land there)
        const uint32_t ob = smem_u32(&own[b]);
        if (lane == 0) {
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(ob), "r"(mine * kKeyBytes) : "memory");
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(fb), "r"(kTileBytes - mine * kKeyBytes) : "memory");
        }
        __syncwarp();
        if (lane >= my0 && lane < my1)
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                       ::"r"(dst), "l"(src), "r"(kKeyBytes), "r"(ob) : "memory");
      }
    };
    auto push = [&](long long n) {   // mode 2: once our third of ring slot n has landed, copy it to both peers
      const int b = (int)(n % STAGES);
      asm volatile("{\n.reg .pred d;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1;\n@!d bra W_%=;\n}\n"
                   ::"r"(smem_u32(&own[b])), "r"((own_ph >> b) & 1u) : "memory");
      own_ph ^= 1u << b;
      const uint32_t src = smem_u32(ring + b * kTileBytes + my0 * kKeyBytes);
      for (uint32_t peer = 0; peer < 3; ++peer) {
        if (peer == rank) continue;
        asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                     ::"r"(mapa(src, peer)), "r"(src), "r"((my1 - my0) * kKeyBytes), "r"(mapa(smem_u32(&full[b]), peer))
                     : "memory");
      }
    };
    // mode 2 pushes tile t+1 at the end of iteration t (its own third was issued STAGES-1 tiles
    // earlier, so thread 0 rarely waits for it), and tile 0 in the prologue
    const long long base = issued;   // ring slot of tile 0 of this split
    const int lead = min(STAGES, ntiles);
    if (tid < 32) {
      for (int t = 0; t < lead; ++t) issue(t);
      if (MODE == 2 && lane == 0) push(base);
    }
    for (int t = 0; t < ntiles; ++t) {
      const int b = (int)(consumed % STAGES);
      asm volatile("{\n.reg .pred d;\nW_%=:\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 d, [%0], %1;\n@!d bra W_%=;\n}\n"
                   ::"r"(smem_u32(&full[b])), "r"((full_ph >> b) & 1u) : "memory");
      full_ph ^= 1u << b;
      if (MODE == 2 && tid != 0) {   // (thread 0 waited on own[] when it pushed)
        asm volatile("{\n.reg .pred d;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1;\n@!d bra W_%=;\n}\n"
                     ::"r"(smem_u32(&own[b])), "r"((own_ph >> b) & 1u) : "memory");
        own_ph ^= 1u << b;
      }
      const unsigned char* buf = ring + b * kTileBytes;
      acc ^= reinterpret_cast<const unsigned*>(buf)[tid * 9];
      if (first && t == 0) {   // check the first tile of the first split: every row where it belongs
        for (int i = tid; i < kTile * 72; i += kThreads) {
          const int k = i / 72, c = i % 72;
          if (*reinterpret_cast<const unsigned*>(pool + (long long)slots[k0 + k] * kKeyBytes + c * 16) !=
              *reinterpret_cast<const unsigned*>(buf + k * kKeyBytes + c * 16))
            atomicAdd(bad, 1);
        }
      }
      __syncthreads();   // every thread of this CTA is done with stage b
      ++consumed;
      if (tid < 32 && lane == 0) {
        if (MODE == 0) {   // independent gathers: only our own producer waits for us
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(&empty[b])) : "memory");
        } else {           // the stage is written by all three: tell all three producers
          for (uint32_t peer = 0; peer < 3; ++peer)
            asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n"
                         ::"r"(mapa(smem_u32(&empty[b]), peer)) : "memory");
        }
      }
      if (tid < 32) {
        __syncwarp();
        if (t + STAGES < ntiles) issue(t + STAGES);
        if (MODE == 2 && lane == 0 && t + 1 < ntiles) push(base + t + 1);
      }
    }
    first = 0;
  }
  cluster_sync();   // no CTA leaves while a peer may still write into it or arrive on its barriers
  if (acc == 0x12345678u) sink[0] = acc;
}

template <int MODE, int STAGES>
void run(const unsigned char* pool, const int* slots, int nkeys, int chunk, int sms) {
  int* bad; unsigned* sink;
  cudaMalloc(&sink, 4); cudaMalloc(&bad, 4); cudaMemset(bad, 0, 4);
  const int smem = STAGES * kTileBytes;
  auto kern = gather<MODE, STAGES>;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaLaunchAttribute attr;
  // as many clusters as are co-resident (GPCs of 16-18 SMs leave some SMs out of 3-CTA clusters);
  // a persistent grid larger than that would run its last clusters in a second wave
  cudaLaunchConfig_t cfg = launch_config(sms / 3 * 3, kThreads, smem, 3, attr);
  int clusters = 0;
  cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg);
  cfg.gridDim = dim3(3 * std::min(clusters, sms / 3));
  const float best = best_ms([&] { cudaLaunchKernelEx(&cfg, kern, pool, slots, nkeys, chunk, sink, bad); });
  int hbad = 0; cudaMemcpy(&hbad, bad, 4, cudaMemcpyDeviceToHost);
  const double unique = (double)nkeys * kKeyBytes;
  static const char* names[] = {"3 gathers", "multicast thirds", "DSMEM push thirds"};
  printf("%-18s %2d clusters stages %d chunk %5d | %7.1f us | into SMs %5.2f TB/s | unique %5.2f TB/s | misplaced %d | %s\n", names[MODE],
         (int)cfg.gridDim.x / 3, STAGES, chunk, best * 1e3, 3 * unique / (best * 1e-3) / 1e12, unique / (best * 1e-3) / 1e12, hbad,
         cudaGetErrorString(cudaGetLastError()));
  cudaFree(sink); cudaFree(bad);
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int nrows = 1 << 21, nkeys = 131072;
  unsigned char* pool = filled_pool(nrows, kKeyBytes);
  int* slots = device_slots(shuffled_slots(nrows), nkeys);
  for (int chunk : {1536, 512}) {
    run<0, 4>(pool, slots, nkeys, chunk, sms);
    run<1, 4>(pool, slots, nkeys, chunk, sms);
    run<2, 4>(pool, slots, nkeys, chunk, sms);
    run<0, 6>(pool, slots, nkeys, chunk, sms);
    run<1, 6>(pool, slots, nkeys, chunk, sms);
    run<2, 6>(pool, slots, nkeys, chunk, sms);
  }
  return 0;
}
