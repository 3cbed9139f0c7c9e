// gather_rate.cu: the rate at which a block lands gathered key rows in shared memory, with nothing computed on them:
// the delivery ceiling of the skinny kernels' producer (verify_skinny.cuh, verify_skinny_fp8.cuh), which lands each
// key of a 64-key tile by one bulk copy into a 4-stage ring.
//
// Every block takes an equal share of the key list (all rows of a 302 MB pool, each once, so the rows come from DRAM;
// or, "L2", slots folded into 4,096 rows that stay in L2) and walks it in 64-key tiles. The producer's copy i of a
// tile (one bulk copy of `run` rows from its first key's slot onward) is issued by lane i % spread of producer warp
// i / spread after the stage's release; optionally the tile's last keys go by 16-byte cp.async from all producer
// threads instead, completing on the stage's mbarrier (cp.async.mbarrier.arrive.noinc). One consumer warp waits for
// each tile, checks the first and last word of every row landed against the pool's pattern, and releases the stage.
// Slot orders: page 1 (every slot shuffled) or page 64 (runs of 64 consecutive slots, the pages shuffled; SGLang's
// DSA pools). Row pitch in shared memory: the row plus 16 bytes for one copy a key (the kernels' pitch), the row for
// longer runs. Prints TB/s of rows landed (bytes read) and SM clocks a tile a block at the GPU's top clock, beside a
// 1 GiB device copy (bytes read + written, and read).
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Isrc/cuda tools/gather_rate.cu -o /tmp/gather_rate
//   /tmp/gather_rate
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include "verify_ptx.cuh"

using kdtree::bulk_copy_g2s;
using kdtree::fence_proxy_async;
using kdtree::mbar_arrive;
using kdtree::mbar_arrive_expect_tx;
using kdtree::mbar_init;
using kdtree::mbar_wait;

namespace {

constexpr int kTile = 64, kMaxStages = 4, kProducer = 256, kThreads = kProducer + 32;
constexpr size_t kPoolBytes = 302ull << 20;

#define CHECK(x)                                                                               \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));      \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

// keys[k] is the slot of key k; block b lands keys [b * per, (b + 1) * per) in tiles of kTile.
__global__ void __launch_bounds__(kThreads) gather_kernel(const unsigned char* pool, const int* keys, int per,
                                                          int row, int pitch, int run, int stages, int lsu_keys,
                                                          int spread, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ unsigned long long full[kMaxStages], empty[kMaxStages];
  const int tid = threadIdx.x;
  if (tid == 0)
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], lsu_keys ? 1 + kProducer : 1);
      mbar_init(&empty[s], 1);
    }
  __syncthreads();
  const int* mine = keys + (size_t)blockIdx.x * per;
  const int tiles = per / kTile, copies = (kTile - lsu_keys) / run;
  const int chunks = row / 16, lsu_chunks = lsu_keys * chunks;
  const size_t stage_bytes = (size_t)kTile * pitch;
  if (tid < kProducer) {
    // copy ci of a tile is issued by lane ci % spread of producer warp ci / spread (the others issue none)
    const int ci = tid % 32 < spread ? tid / 32 * spread + tid % 32 : kTile;
    for (int t = 0; t < tiles; ++t) {
      const int b = t % stages;
      if (ci < copies || lsu_keys) {
        mbar_wait(&empty[b], ((t / stages) & 1) ^ 1u);
        if (tid == 0) mbar_arrive_expect_tx(&full[b], (kTile - lsu_keys) * row);
      }
      if (ci < copies) {
        const int slot = mine[t * kTile + ci * run];
        fence_proxy_async();
        bulk_copy_g2s(smem + b * stage_bytes + (size_t)ci * run * pitch, pool + (size_t)slot * row, run * row,
                      &full[b]);
      }
      if (lsu_keys) {   // keys copies .. 63 by 16-byte cp.async, their chunks spread over the producer's threads
        for (int c = tid; c < lsu_chunks; c += kProducer) {
          const int key = copies + c / chunks, part = c % chunks;
          const int slot = mine[t * kTile + key];
          kdtree::cp_async_16z(kdtree::smem_u32(smem + b * stage_bytes + (size_t)key * pitch + part * 16),
                               pool + (size_t)slot * row + part * 16, 16);
        }
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(kdtree::smem_u32(&full[b]))
                     : "memory");
      }
    }
  } else {
    unsigned bad = 0;
    const int lane = tid - kProducer, words = row / 4;
    for (int t = 0; t < tiles; ++t) {
      const int b = t % stages;
      mbar_wait(&full[b], (t / stages) & 1);
      for (int key = lane; key < kTile; key += 32) {   // each landed row's first and last word
        const unsigned slot = (unsigned)mine[t * kTile + key];
        const unsigned* r = reinterpret_cast<const unsigned*>(smem + b * stage_bytes + (size_t)key * pitch);
        bad += (r[0] != slot * 1000003u) + (r[words - 1] != slot * 1000003u + words - 1);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[b]);
    }
    if (bad) atomicAdd(sink, bad);
  }
}

// Word w of slot s's row holds s * 1000003 + w.
__global__ void fill_kernel(unsigned* pool, size_t n, int words) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    pool[i] = (unsigned)(i / words) * 1000003u + (unsigned)(i % words);
}

struct Case {
  const char* name;
  int row, page, run, l2, blocks_per_sm, stages, lsu_keys, spread;
};

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  unsigned char* pool;
  unsigned* sink;
  CHECK(cudaMalloc(&pool, kPoolBytes));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaFuncSetAttribute(gather_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  auto time_us = [&](auto&& launch) {
    launch();
    CHECK(cudaDeviceSynchronize());
    std::vector<float> ts;
    for (int r = 0; r < 15; ++r) {
      CHECK(cudaEventRecord(e0));
      launch();
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms * 1e3f);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };

  {   // the copy ceiling: a 1 GiB device-to-device copy
    const size_t n = 1ull << 30;
    unsigned char *a, *b;
    CHECK(cudaMalloc(&a, n));
    CHECK(cudaMalloc(&b, n));
    const float us = time_us([&] { CHECK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice)); });
    printf("%s, %d SMs\n1 GiB copy: %.2f TB/s read + written, %.2f TB/s read\n", prop.name, sms, 2e-6 * n / us,
           1e-6 * n / us);
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
  }

  const Case cases[] = {
      {"576 B, page 1, a copy a key", 576, 1, 1, 0, 1, 4, 0, 32},
      {"576 B, page 1, a copy a key, 2 stages", 576, 1, 1, 0, 1, 2, 0, 32},
      {"576 B, page 1, a copy a key, 2 blocks an SM", 576, 1, 1, 0, 2, 2, 0, 32},
      {"576 B, page 1, a copy a key, 16 lanes of 4 warps", 576, 1, 1, 0, 1, 4, 0, 16},
      {"576 B, page 1, a copy a key, 8 lanes of 8 warps", 576, 1, 1, 0, 1, 4, 0, 8},
      {"576 B, page 1, a copy a key, 2 blocks, 16 x 4", 576, 1, 1, 0, 2, 2, 0, 16},
      {"576 B, page 1, 16 of 64 keys by cp.async", 576, 1, 1, 0, 1, 4, 16, 32},
      {"576 B, page 1, every key by cp.async", 576, 1, 1, 0, 1, 4, 64, 32},
      {"576 B, page 64, a copy a key", 576, 64, 1, 0, 1, 4, 0, 32},
      {"576 B, page 64, a copy per 8 keys", 576, 64, 8, 0, 1, 4, 0, 32},
      {"576 B, page 64, a copy per 64 keys", 576, 64, 64, 0, 1, 4, 0, 32},
      {"576 B, L2, a copy a key", 576, 1, 1, 1, 1, 4, 0, 32},
      {"576 B, L2 page 64, a copy per 64 keys", 576, 64, 64, 1, 1, 4, 0, 32},
      {"576 B, L2, a copy a key, 16 lanes of 4 warps", 576, 1, 1, 1, 1, 4, 0, 16},
      {"1152 B, page 1, a copy a key", 1152, 1, 1, 0, 1, 2, 0, 32},
      {"1152 B, page 1, a copy a key, 16 lanes of 4 warps", 1152, 1, 1, 0, 1, 2, 0, 16},
      {"1152 B, page 64, a copy a key", 1152, 64, 1, 0, 1, 2, 0, 32},
      {"1152 B, page 64, a copy per 64 keys", 1152, 64, 64, 0, 1, 2, 0, 32},
      {"1152 B, L2, a copy a key", 1152, 1, 1, 1, 1, 2, 0, 32},
  };
  std::mt19937 rng(1234);
  printf("%-48s %10s %8s %12s\n", "rows", "us", "TB/s", "clk/tile/blk");
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  for (const Case& c : cases) {
    const int slots = (int)(kPoolBytes / c.row);
    const int l2_slots = 4096;
    const int blocks = sms * c.blocks_per_sm;
    const int used = c.l2 ? slots / 2 : slots;   // keys landed in one launch
    const int per = used / blocks / kTile * kTile;
    // slot order: pages of c.page consecutive slots, the pages shuffled
    const int span = c.l2 ? l2_slots : slots;
    std::vector<int> pages(span / c.page);
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    std::vector<int> keys((size_t)per * blocks);
    for (size_t k = 0; k < keys.size(); ++k) {
      const size_t p = (k / c.page) % pages.size();
      keys[k] = pages[p] * c.page + (int)(k % c.page);
    }
    fill_kernel<<<sms * 8, 256>>>(reinterpret_cast<unsigned*>(pool), (size_t)slots * c.row / 4, c.row / 4);
    CHECK(cudaMemset(sink, 0, 4));
    int* dkeys;
    CHECK(cudaMalloc(&dkeys, keys.size() * sizeof(int)));
    CHECK(cudaMemcpy(dkeys, keys.data(), keys.size() * sizeof(int), cudaMemcpyHostToDevice));
    const int pitch = c.run == 1 ? c.row + 16 : c.row;
    const size_t smem = (size_t)c.stages * kTile * pitch;
    const float us = time_us([&] {
      gather_kernel<<<blocks, kThreads, smem>>>(pool, dkeys, per, c.row, pitch, c.run, c.stages,
                                                      c.lsu_keys, c.spread, sink);
      CHECK(cudaGetLastError());
    });
    unsigned bad = 0;
    CHECK(cudaMemcpy(&bad, sink, 4, cudaMemcpyDeviceToHost));
    if (bad) {
      fprintf(stderr, "%s: %u rows landed wrong\n", c.name, bad);
      return 1;
    }
    const double bytes = (double)keys.size() * c.row;
    const double tiles_per_blk = (double)per / kTile;
    printf("%-48s %10.1f %8.2f %12.0f\n", c.name, us, 1e-6 * bytes / us, us * 1e-3 * clock_khz / tiles_per_blk);
    CHECK(cudaFree(dkeys));
  }
  return 0;
}
