// Microbenchmark: the issue rate of SS wgmma (sm_90a) in the shapes the verify kernel uses.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a micro_wgmma.cu -o /tmp/micro_wgmma && /tmp/micro_wgmma
// Every warpgroup of a 1-CTA-per-SM grid runs `iters` rounds of: kS wgmma m64n{NS}k16 into one accumulator
// (both operands in 128-byte-swizzled shared memory, K-major; the S = Q K^T pattern), commit, wait; then
// kPV wgmma m64n256k16 (B MN-major; the P V pattern), commit, wait. Prints clocks per round and per instruction.
// wgmma_ops.inc is generated (the python snippet in benchmarks/micro/README.md).
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#include "micro_common.cuh"
#include "wgmma_ops.inc"


constexpr int kASlab = 64 * 128;   // q: 64 rows x 64 bf16
template <int NS, int KS, int KPV, int BT = 0>
__global__ void __launch_bounds__(256, 1) bench(long long* out, int iters) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* sm = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  // A region: 9 slabs of q (72 KB); B region: 2 slabs of 256 x 128 B (64 KB), shared by all shapes
  for (int i = threadIdx.x; i < (9 * kASlab + 2 * 256 * 128) / 4; i += blockDim.x)
    reinterpret_cast<uint32_t*>(sm)[i] = 0x3c003c00u ^ (i * 2654435761u & 0x00ff00ffu);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const uint32_t abase = smem_u32(sm), bbase = abase + 9 * kASlab;
  float s[NS / 2];
  float o[128];
#pragma unroll
  for (int i = 0; i < NS / 2; ++i) s[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  const long long t0 = clock64();
  for (int r = 0; r < iters; ++r) {
    if (KS > 0) {
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const uint64_t da = desc_sw128(abase + (ks >> 2) % 9 * kASlab + (ks & 3) * 32, 16, 1024);
        const uint64_t db = desc_sw128(bbase + ((ks >> 2) & 1) * (256 * 128) + (ks & 3) * 32, 16, 1024);
        if constexpr (NS == 32) wgmma_ss_n32(s, da, db);
        if constexpr (NS == 64) wgmma_ss_n64(s, da, db);
        if constexpr (NS == 128) wgmma_ss_n128(s, da, db);
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    if (KPV > 0) {
      asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
      for (int k = 0; k < KPV; ++k) {
        const uint64_t da = desc_sw128(abase + (k & 3) * 32, 16, 1024);
        if constexpr (BT == 0) {   // B K-major (as S reads its keys)
          const uint64_t db = desc_sw128(bbase + (k & 7) * 16 * 128, 32768, 1024);
          wgmma_ss_n256(o, da, db);
        } else {   // B MN-major, as the verify kernels read V: 64-column slabs LBO apart, 8-key groups 1 KB apart
          const uint64_t db = desc_sw128(bbase + (k & 1) * 16 * 128, 4096, 1024);
          if constexpr (BT == 1) wgmma_ss_n256_bt(o, da, db);
          if constexpr (BT == 2) {   // two m64n128k16 halves (the dual kernel: 512 threads)
            wgmma_ss_n128_bt(*reinterpret_cast<float(*)[64]>(&o[0]), da, db);
            wgmma_ss_n128_bt(*reinterpret_cast<float(*)[64]>(&o[64]), da, db + ((2 * 4096) >> 4));
          }
        }
      }
      asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
  }
  const long long t1 = clock64();
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < NS / 2; ++i) acc += s[i];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc += o[i];
  if ((threadIdx.x & 127) == 0) out[blockIdx.x * 2 + threadIdx.x / 128] = t1 - t0;
  if (acc == 12345.f) out[0] = -1;   // keep the products alive
}

template <int NS, int KS, int KPV, int BT = 0>
void run(const char* what, int wgs, int sms) {
  const int iters = 200;
  long long* d;
  cudaMalloc(&d, sms * 2 * sizeof(long long));
  const int smem = 9 * kASlab + 2 * 256 * 128 + 1024;
  cudaFuncSetAttribute(bench<NS, KS, KPV, BT>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  bench<NS, KS, KPV, BT><<<sms, 128 * wgs, smem>>>(d, 4);   // warm
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0); cudaEventCreate(&e1);
  cudaEventRecord(e0);
  bench<NS, KS, KPV, BT><<<sms, 128 * wgs, smem>>>(d, iters);
  cudaEventRecord(e1);
  cudaError_t err = cudaDeviceSynchronize();
  float ms = 0; cudaEventElapsedTime(&ms, e0, e1);
  long long h[2]; cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
  const double per_round = (double)h[0] / iters;
  const double flops = 2.0 * 64 * (NS * 16.0 * KS + 256 * 16.0 * KPV) * iters * wgs * sms;
  printf("%-34s WGs %d | %8.0f clk/round | %6.1f clk per S instr-equiv | %6.1f TFLOP/s %s\n", what, wgs, per_round,
         per_round / (KS + KPV * (256.0 / (NS ? NS : 256))), flops / (ms * 1e-3) / 1e12, err ? cudaGetErrorString(err) : "");
  cudaFree(d);
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  run<32, 36, 0>("S m64n32k16 x36", 1, sms);
  run<32, 36, 0>("S m64n32k16 x36", 2, sms);
  run<64, 36, 0>("S m64n64k16 x36", 1, sms);
  run<64, 36, 0>("S m64n64k16 x36", 2, sms);
  run<128, 36, 0>("S m64n128k16 x36", 1, sms);
  run<128, 36, 0>("S m64n128k16 x36", 2, sms);
  run<32, 0, 8>("PV m64n256k16 x8", 1, sms);
  run<32, 0, 8>("PV m64n256k16 x8", 2, sms);
  run<64, 36, 8>("S n64 x36 + PV n256 x8", 1, sms);
  run<64, 36, 8>("S n64 x36 + PV n256 x8", 2, sms);
  run<32, 36, 4>("S n32 x36 + PV n256 x4", 2, sms);
  // session 9: P V as the kernels run it, B MN-major (V read from the key tile)
  run<32, 0, 8, 1>("PV m64n256k16 MN-major x8", 1, sms);
  run<32, 0, 8, 1>("PV m64n256k16 MN-major x8", 2, sms);
  run<32, 0, 8, 2>("PV 2 x m64n128k16 MN-major x8", 1, sms);
  run<32, 0, 8, 2>("PV 2 x m64n128k16 MN-major x8", 2, sms);
  run<32, 36, 4, 1>("S n32 x36 + PV n256 MN-major x4", 1, sms);
  run<32, 36, 4, 1>("S n32 x36 + PV n256 MN-major x4", 2, sms);
  return 0;
}
