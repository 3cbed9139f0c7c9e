// verify_launch.cu: the extern "C" entry points: validate -> plan -> split pass -> combine -> status.
// Nothing here allocates, synchronises with the host, throws or prints.
#include <cuda.h>   // CUtensorMap and its encoder's types (the encoder itself comes through the runtime: no -lcuda)
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>   // snprintf into the KDTREE_ERR_ENV message (nothing is printed)
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <utility>

#include "kdtree_verify.h"
#include "verify_combine.cuh"
#include "verify_mask.cuh"
#include "verify_mma.cuh"
#include "verify_mma_fp8.cuh"
#include "verify_plan.cuh"
#include "verify_dual.cuh"
#include "verify_skinny.cuh"
#include "verify_skinny_fp8.cuh"

#ifndef KDTREE_CUDA_ARCHS_STR
#define KDTREE_CUDA_ARCHS_STR ""
#endif

namespace {

using kdtree::Params;
using kdtree::ReqPlan;

constexpr size_t kAlign = 256;
constexpr int kMaxDevices = 64;
// A long request becomes ~KDTREE_SPLITS_PER_SM work items per SM (one CTA per SM). 1: against 2 (twice the partials
// and item starts) it is faster on every benchmark shape on the H200, 8% at H16 N9 P131072 and 16% at B8, and on the
// H100 for the skinny FP8 form, 5-8% at H16 N1 P131072 / P185000 (docs/performance.md).
#ifndef KDTREE_SPLITS_PER_SM
#define KDTREE_SPLITS_PER_SM 1
#endif
constexpr int kSplitsPerSm = KDTREE_SPLITS_PER_SM;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct Layout {
  size_t header, zero_row, plan, lse, partial, tile_done, tile_seen, q8, q_scale, total;
  long long max_partial_rows;
};

// A request with nsplit > 1 has nsplit <= split_target / mtiles, or one more where the split rule balances its items
// (verify_split_rule.h), and one more again where its drafts stand apart, so it owns at most split_target * block_m
// partial rows (block_m of whichever split kernel runs, at most 64) plus twice its own rows; a row needs at most
// split_target + 1 partials (mtiles >= 2 where a split is added for balance).
constexpr int kMaxBlockM = kdtree::kBlockM > kdtree::wg::kBlockM ? kdtree::kBlockM : kdtree::wg::kBlockM;
static_assert(kdtree::sk::kRows <= kMaxBlockM, "every split kernel's items fit the partials' sizing");
Layout workspace_layout(int batch, int num_tokens, int heads, int split_target) {
  Layout l;
  const long long by_batch = (long long)batch * split_target * kMaxBlockM + 2ll * num_tokens * heads;
  const long long by_rows = (long long)num_tokens * heads * (split_target + 1);
  l.max_partial_rows = by_batch < by_rows ? by_batch : by_rows;
  l.header = 0;
  l.zero_row = align_up(3 * sizeof(int));   // the counters
  l.plan = l.zero_row + align_up(kdtree::kDimQK * sizeof(__nv_bfloat16));
  l.lse = l.plan + align_up((size_t)batch * sizeof(ReqPlan));
  l.partial = l.lse + align_up((size_t)l.max_partial_rows * sizeof(float));
  l.tile_done = l.partial + align_up((size_t)l.max_partial_rows * kdtree::kDimNope * sizeof(__nv_bfloat16));
  l.tile_seen = l.tile_done + align_up((size_t)l.max_partial_rows * sizeof(int));
  l.q8 = l.tile_seen + align_up((size_t)l.max_partial_rows * sizeof(int));   // an FP8 call's q terms (verify_q8.cuh)
  l.q_scale = l.q8 + align_up((size_t)num_tokens * heads * kdtree::kQ8RowBytes);
  l.total = l.q_scale + align_up((size_t)num_tokens * heads * sizeof(float));
  return l;
}

// A split kernel with its block size and dynamic shared memory (what both the one-time configuration and every
// launch need), and the shape of its work items, which the plan cuts them to (Params::block_m, tile_n).
struct SplitLaunch {
  void (*kernel)(kdtree::Params);
  int threads;
  size_t smem;
  int block_m;   // rows per work item
  int tile_n;    // keys per pipeline tile: splits are whole tiles
  // Params::done_arrivals: 1 (signal_item_done once per item, the combine merges each row tile as soon as it is
  // done), 0 (the split kernel signals nothing and the combine waits for the whole pass): the skinny kernel of small
  // calls, whose combine blocks fit beside it, so that it lets them start before its wait for the plan (~2 us faster
  // at H16 N1 P131072, H200)
  int done_arrivals = 1;
  int min_chunk = kdtree::kMinChunk;   // Params::min_chunk: the split rule's shortest split, in keys
};
// Kernel selection lives here and in device_info / call_kernel below: one entry per kdtree_split_kernel_id.
// KDTREE_KERNEL_MMA_SCALED is the mma.sync kernel with the drafts apart at `stages` key stages (the device's).
SplitLaunch split_launch(int kernel, int stages = 2) {
  using kdtree::kTileN;
  switch (kernel) {
    case KDTREE_KERNEL_MMA_SCALED:
      if (stages == 2)
        return {kdtree::kdtree_verify_split_kernel<2, kdtree::MmaWide, true>, kdtree::MmaWide::kThreads,
                sizeof(kdtree::SharedStorage<2>), kdtree::MmaWide::kBlockM, kTileN};
      return {kdtree::kdtree_verify_split_kernel<kdtree::kMaxStages, kdtree::MmaWide, true>, kdtree::MmaWide::kThreads,
              sizeof(kdtree::SharedStorage<kdtree::kMaxStages>), kdtree::MmaWide::kBlockM, kTileN};
    case KDTREE_KERNEL_DUAL:
      return {kdtree::dual::kdtree_verify_split_dual_kernel<false>, kdtree::dual::kThreads<false>,
              kdtree::dual::kSmemBytes, kdtree::wg::kBlockM, kdtree::wg::kTileN};
    case KDTREE_KERNEL_DUAL_FP8:
      return {kdtree::dual::kdtree_verify_split_dual_kernel<true>, kdtree::dual::kThreads<true>,
              kdtree::dual::kSmemBytesFp8, kdtree::wg::kBlockM, kdtree::wg::kTileN};
    case KDTREE_KERNEL_SKINNY:
      return {kdtree::sk::kdtree_verify_split_skinny_kernel, kdtree::sk::kThreads, kdtree::sk::kSmemBytes,
              kdtree::sk::kRows, kdtree::sk::kTileN, 0, kdtree::sk::kMinChunk};
    case KDTREE_KERNEL_SKINNY_FP8:
      return {kdtree::sk8::kdtree_verify_split_skinny_fp8_kernel<1>, kdtree::sk8::kThreads<1>,
              kdtree::sk8::kSmemBytes<1>, kdtree::sk::kRows, kdtree::sk::kTileN, 0, kdtree::sk::kMinChunk};
    case KDTREE_KERNEL_SKINNY_FP8_32ROW:
      return {kdtree::sk8::kdtree_verify_split_skinny_fp8_kernel<2>, kdtree::sk8::kThreads<2>,
              kdtree::sk8::kSmemBytes<2>, 2 * kdtree::sk::kRows, kdtree::sk::kTileN, 0, kdtree::sk::kMinChunk};
    case KDTREE_KERNEL_MMA_2STAGE:
      return {kdtree::kdtree_verify_split_kernel<2>, kdtree::MmaWide::kThreads, sizeof(kdtree::SharedStorage<2>),
              kdtree::MmaWide::kBlockM, kTileN};
    case KDTREE_KERNEL_MMA_32ROW:
      return {kdtree::kdtree_verify_split_kernel<2, kdtree::MmaHalves>, kdtree::MmaHalves::kThreads,
              sizeof(kdtree::SharedStorage<2, kdtree::MmaHalves::kBlockM, kdtree::MmaHalves::kKeyHalves>),
              kdtree::MmaHalves::kBlockM, kTileN};
    case KDTREE_KERNEL_MMA_FP8:
      return {kdtree::kdtree_verify_split_fp8_kernel, kdtree::MmaWide::kThreads, sizeof(kdtree::SharedStorageFp8),
              kdtree::MmaWide::kBlockM, kTileN};
    default:   // KDTREE_KERNEL_MMA_3STAGE
      return {kdtree::kdtree_verify_split_kernel<kdtree::kMaxStages>, kdtree::MmaWide::kThreads,
              sizeof(kdtree::SharedStorage<kdtree::kMaxStages>), kdtree::MmaWide::kBlockM, kTileN};
  }
}

// Opts the split kernel into its dynamic shared memory and reports how many of its blocks fit on one SM.
cudaError_t configure(const SplitLaunch& k, int* blocks) {
  cudaError_t e = cudaFuncSetAttribute(k.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)k.smem);
  if (e != cudaSuccess) return e;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, k.kernel, k.threads, k.smem);
}
struct DeviceInfo {
  int sms;
  int kernel;        // kdtree_split_kernel_id of calls of many rows per request
  bool pdl;          // programmatic dependent launch between the kernels of a call (sm_90+)
  int small_kernel;  // the kernel of calls whose requests cannot exceed small_rows rows (SKINNY, MMA_32ROW), or 0
  int small_rows;
  bool early_combine;   // the combine waits per row tile (Params::done_arrivals); KDTREE_EARLY_COMBINE=0: for the pass
  bool q_tma;           // the dual kernel loads q by TMA where the call's q allows it; KDTREE_Q_TMA=0: by cp.async
  int mma_stages;       // key stages of the mma.sync kernels here (3 where a block may take 227 KB, else 2)
  int fp8_kernel;       // the kernel of calls over an e4m3 pool: the FP8 form of the device's (DUAL_FP8 of DUAL,
                        // SKINNY_FP8 of SKINNY), else MMA_FP8
  int fp8_status;       // KDTREE_OK where that kernel fits a block on an SM here, else why not
  int scaled_status;    // the same for the scaled bf16 kernel
  int fp8_small_kernel; // the kernel of e4m3 calls whose requests cannot exceed small_rows rows (SKINNY_FP8), or 0
  int fp8_pair_kernel;  // the kernel of e4m3 calls whose requests cannot exceed 2 x small_rows rows (SKINNY_FP8_32ROW,
                        // beside SKINNY_FP8), or 0
};

bool env_is(const char* name, const char* value) {
  const char* v = getenv(name);
  return v && strcmp(v, value) == 0;
}

// Per device, once (benign race: idempotent values): SM count and the split kernel that runs there (the dual-score
// wgmma kernel on compute capability 9.0 when the build carries sm_90a code, else the mma.sync kernel with 3 stages
// where a block may take that much shared memory, 2 otherwise: sm_120), its small-call companion, and the switches.
DeviceInfo device_info(int dev, int* status) {
  static DeviceInfo info[kMaxDevices];
  static bool configured[kMaxDevices];
  if (dev < 0 || dev >= kMaxDevices) { *status = KDTREE_ERR_NO_DEVICE; return {}; }
  if (!configured[dev]) {
    int n = 0, optin = 0, major = 0, minor = 0;
    cudaError_t e = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (e != cudaSuccess) { *status = (int)e; return {}; }
    const int mma_stages = (size_t)optin >= sizeof(kdtree::SharedStorage<kdtree::kMaxStages>) ? kdtree::kMaxStages : 2;
    int kernel = mma_stages == 2 ? KDTREE_KERNEL_MMA_2STAGE : KDTREE_KERNEL_MMA_3STAGE;
#ifdef KDTREE_HAVE_SM90A
    if (major == 9 && minor == 0 && (size_t)optin >= kdtree::dual::kSmemBytes && (size_t)optin >= kdtree::sk::kSmemBytes)
      kernel = KDTREE_KERNEL_DUAL;
#endif
    if (kernel == KDTREE_KERNEL_DUAL) {
      if (env_is("KDTREE_SPLIT_KERNEL", "mma")) kernel = KDTREE_KERNEL_MMA_3STAGE;
      if (env_is("KDTREE_SPLIT_KERNEL", "skinny")) kernel = KDTREE_KERNEL_SKINNY;
    }
    if (env_is("KDTREE_SPLIT_STAGES", "2")) kernel = KDTREE_KERNEL_MMA_2STAGE;   // the sm_120 pipeline, wherever it runs
    // registers and shared memory must admit one block per SM (a build with a different register
    // cap would otherwise fail at every launch with a bare "too many resources")
    int blocks = 0;
    e = configure(split_launch(kernel), &blocks);
    if (e == cudaErrorInvalidDeviceFunction || e == cudaErrorNoKernelImageForDevice) {
      cudaGetLastError();
      *status = KDTREE_ERR_ARCH;
      return {};
    }
    if (e != cudaSuccess) { *status = (int)e; return {}; }
    if (blocks < 1) { *status = KDTREE_ERR_RESOURCES; return {}; }
    // the small-call kernel beside the device's (not fatal when it cannot be configured: the device's serves every call)
    int small_kernel = 0, small_rows = 0;
#ifdef KDTREE_HAVE_SM90A
    if (kernel == KDTREE_KERNEL_DUAL && !env_is("KDTREE_SKINNY", "0")) {
      small_kernel = KDTREE_KERNEL_SKINNY;
      small_rows = kdtree::sk::kRows;
    }
#endif
    if (kernel == KDTREE_KERNEL_MMA_2STAGE && !env_is("KDTREE_MMA_HALVES", "0")) {
      small_kernel = KDTREE_KERNEL_MMA_32ROW;
      small_rows = kdtree::MmaHalves::kBlockM;
    }
    if (small_kernel) {
      int sblocks = 0;
      e = configure(split_launch(small_kernel), &sblocks);
      if (e != cudaSuccess) cudaGetLastError();
      if (e != cudaSuccess || sblocks < 1) small_kernel = small_rows = 0;
    }
    // the FP8 and scaled kernels, for the calls that need them (a failure is reported by those calls only)
    auto status_of = [](const SplitLaunch& k) {
      int b = 0;
      const cudaError_t err = configure(k, &b);
      if (err != cudaSuccess) {
        cudaGetLastError();
        return err == cudaErrorInvalidDeviceFunction || err == cudaErrorNoKernelImageForDevice ? KDTREE_ERR_ARCH
                                                                                                : (int)err;
      }
      return b < 1 ? KDTREE_ERR_RESOURCES : KDTREE_OK;
    };
    int fp8_kernel = kernel == KDTREE_KERNEL_DUAL     ? KDTREE_KERNEL_DUAL_FP8
                     : kernel == KDTREE_KERNEL_SKINNY ? KDTREE_KERNEL_SKINNY_FP8
                                                      : KDTREE_KERNEL_MMA_FP8;
    int fp8_status = status_of(split_launch(fp8_kernel));
    if (fp8_status != KDTREE_OK && fp8_kernel != KDTREE_KERNEL_MMA_FP8) {   // (the sm_120 code path serves it too)
      fp8_kernel = KDTREE_KERNEL_MMA_FP8;
      fp8_status = status_of(split_launch(fp8_kernel));
    }
    const int scaled_status = status_of(split_launch(KDTREE_KERNEL_MMA_SCALED, mma_stages));
    // the skinny kernel's FP8 forms beside it, for e4m3 calls of few rows: 16-row items, and 32-row ones
    const int fp8_small_kernel =
        small_kernel == KDTREE_KERNEL_SKINNY && status_of(split_launch(KDTREE_KERNEL_SKINNY_FP8)) == KDTREE_OK
            ? KDTREE_KERNEL_SKINNY_FP8
            : 0;
    const int fp8_pair_kernel =
        fp8_small_kernel && status_of(split_launch(KDTREE_KERNEL_SKINNY_FP8_32ROW)) == KDTREE_OK
            ? KDTREE_KERNEL_SKINNY_FP8_32ROW
            : 0;
    // KDTREE_PDL=0 launches every kernel plainly (to measure what overlapping the launches saves)
    info[dev] = DeviceInfo{n, kernel, major >= 9 && !env_is("KDTREE_PDL", "0"), small_kernel, small_rows,
                           !env_is("KDTREE_EARLY_COMBINE", "0"), !env_is("KDTREE_Q_TMA", "0"), mma_stages,
                           fp8_kernel, fp8_status, scaled_status, fp8_small_kernel, fp8_pair_kernel};
    configured[dev] = true;
  }
  *status = KDTREE_OK;
  return info[dev];
}

// The split kernel of a call: the device's, or its small-call kernel where the call's requests have at most
// small_rows rows. The host knows only T, B and H, so it takes every request to have T / B verify tokens, as in
// SGLang's verify batches: then the choice is the same for a request alone and in any batch of requests with its
// token count, and its result bit for bit (batch invariance). A call whose T is not a multiple of B runs the
// device's kernel. Either kernel is correct for any batch; in a batch of mixed token counts whose T is a multiple
// of B, a request may run on the other kernel than alone (results equal to bf16 rounding, not bit for bit). (A bound
// of H x (T - B + 1) instead would move with the batch size: H8 N2 alone would run one kernel and in a batch of three
// N2 requests the other.)
// Calls over an e4m3 pool run the device's FP8 kernel or, by the same rule, its small-call FP8 kernels (up to
// small_rows rows, then up to twice that: the 32-row form, against the dual kernel's FP8 form at H8 N4 22.7 against
// 31.2 us at P8192 and the same at P131072 on an H100, docs/performance.md); scaled bf16 calls the scaled one,
// whatever their rows.
int call_kernel(const DeviceInfo& dev, int batch, int num_tokens, int heads, int kv_dtype, bool kv_scaled) {
  const bool fp8 = kv_dtype == KDTREE_KV_E4M3;
  if (!fp8 && kv_scaled) return KDTREE_KERNEL_MMA_SCALED;
  const int kernel = fp8 ? dev.fp8_kernel : dev.kernel, small = fp8 ? dev.fp8_small_kernel : dev.small_kernel;
  if (!small || num_tokens % batch != 0) return kernel;
  const long long rows = (long long)heads * (num_tokens / batch);
  if (rows <= dev.small_rows) return small;
  return fp8 && dev.fp8_pair_kernel && rows <= 2LL * dev.small_rows ? dev.fp8_pair_kernel : kernel;
}

// The environment switches this library reads and the values each takes besides unset or empty (the default). Any
// other value is KDTREE_ERR_ENV, so that a switch value this build does not have never runs the default silently;
// switches that builds no longer have (kRetiredSwitches) are refused by name for the same reason. Checked once per
// process, before the device: the message names the variable (kdtree_status_string).
struct EnvSwitch {
  const char* name;
  const char* values;   // the values it takes, ", "-separated, as the message lists them
};
constexpr EnvSwitch kEnvSwitches[] = {
    {"KDTREE_SPLIT_KERNEL", "mma, skinny"}, {"KDTREE_SPLIT_STAGES", "2"},    {"KDTREE_SKINNY", "0, 1"},
    {"KDTREE_MMA_HALVES", "0, 1"},          {"KDTREE_PDL", "0, 1"},           {"KDTREE_EARLY_COMBINE", "0, 1"},
    {"KDTREE_Q_TMA", "0, 1"},
};
// KDTREE_MIXED ran a last row tile of <= 16 rows as skinny items beside the dual kernel (3-16% slower than the dual
// kernel alone on every shape, H200); KDTREE_MIXED_SMS set how many SMs those took.
constexpr const char* kRetiredSwitches[] = {"KDTREE_MIXED", "KDTREE_MIXED_SMS"};
char g_env_message[256];   // the message of KDTREE_ERR_ENV (written once, before the status is first returned)
bool env_value_listed(const char* value, const char* values) {
  const size_t n = strlen(value);
  for (const char* v = values; *v;) {
    const char* end = strchr(v, ',');
    const size_t len = end ? (size_t)(end - v) : strlen(v);
    if (len == n && strncmp(v, value, n) == 0) return true;
    if (!end) break;
    v = end + 1;
    while (*v == ' ') ++v;
  }
  return false;
}
int check_env() {
  static int status = 1;   // 1: not checked yet (benign race: every thread computes the same)
  if (status == 1) {
    int s = KDTREE_OK;
    for (const EnvSwitch& sw : kEnvSwitches) {
      const char* v = getenv(sw.name);
      if (v && *v && !env_value_listed(v, sw.values)) {
        snprintf(g_env_message, sizeof(g_env_message), "%s=%.64s is not a value this build takes (unset, %s)", sw.name,
                 v, sw.values);
        s = KDTREE_ERR_ENV;
        break;
      }
    }
    for (const char* name : kRetiredSwitches) {
      const char* v = getenv(name);
      if (s == KDTREE_OK && v && *v) {
        snprintf(g_env_message, sizeof(g_env_message), "%s=%.64s is not a switch this build has (unset it)", name, v);
        s = KDTREE_ERR_ENV;
      }
    }
    status = s;
  }
  return status;
}

DeviceInfo current_device(int* status) {
  if ((*status = check_env()) != KDTREE_OK) return {};
  int dev = -1;
  const cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error so later calls report afresh
    *status = e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ? KDTREE_ERR_NO_DEVICE : (int)e;
    return {};
  }
  return device_info(dev, status);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

int validate(const kdtree_verify_params* p) {
  if (!p->q_nope || !p->q_pe || !p->kv_cache || !p->kv_indices || !p->kv_indptr || !p->k_new ||
      !p->qo_indptr || !p->out || !p->workspace)
    return KDTREE_ERR_NULL_POINTER;
  if (p->batch_size < 1) return KDTREE_ERR_BATCH;
  if (p->num_tokens < 1) return KDTREE_ERR_NUM_TOKENS;
  if (p->num_heads < 1 || p->num_heads > KDTREE_MAX_HEADS) return KDTREE_ERR_NUM_HEADS;
  if (p->num_slots < 1) return KDTREE_ERR_NUM_SLOTS;
  if (p->kv_indices_dtype != KDTREE_INDEX_INT32 && p->kv_indices_dtype != KDTREE_INDEX_INT64) return KDTREE_ERR_INDEX_DTYPE;
  if (p->qo_indptr_dtype != KDTREE_INDEX_INT32 && p->qo_indptr_dtype != KDTREE_INDEX_INT64) return KDTREE_ERR_INDEX_DTYPE;
  if (p->tree_mask && (p->tree_mask_words < 1 || p->tree_mask_words > KDTREE_MAX_MASK_WORDS)) return KDTREE_ERR_MASK_WORDS;
  if (!(p->sm_scale > 0.f) || !isfinite(p->sm_scale) || !(p->k_scale > 0.f) || !isfinite(p->k_scale) ||
      !(p->v_scale > 0.f) || !isfinite(p->v_scale))
    return KDTREE_ERR_SCALE;
  if (p->kv_dtype != KDTREE_KV_BF16 && p->kv_dtype != KDTREE_KV_E4M3) return KDTREE_ERR_KV_DTYPE;
  if (p->reuse_plan != 0 && p->reuse_plan != 1) return KDTREE_ERR_REUSE_PLAN;
  if (p->pack_custom_mask && (!p->pack_mask_indptr || !p->tree_mask)) return KDTREE_ERR_NULL_POINTER;
  // strides: a head / token step must not overlap the row it spans (heads may alias only if H == 1)
  if (p->q_nope_stride_h < (p->num_heads > 1 ? KDTREE_HEAD_DIM_NOPE : 0) ||
      p->q_nope_stride_t < (long long)(p->num_heads - 1) * p->q_nope_stride_h + KDTREE_HEAD_DIM_NOPE ||
      p->q_pe_stride_h < (p->num_heads > 1 ? KDTREE_HEAD_DIM_PE : 0) ||
      p->q_pe_stride_t < (long long)(p->num_heads - 1) * p->q_pe_stride_h + KDTREE_HEAD_DIM_PE ||
      p->kv_stride_s < KDTREE_HEAD_DIM_QK || p->k_new_stride_t < KDTREE_HEAD_DIM_QK ||
      p->out_stride_h < (p->num_heads > 1 ? KDTREE_HEAD_DIM_V : 0) ||
      p->out_stride_t < (long long)(p->num_heads - 1) * p->out_stride_h + KDTREE_HEAD_DIM_V)
    return KDTREE_ERR_STRIDE;
  // 16-byte vectors (cp.async, uint4, bulk copies) on every row: pointers and element strides (bf16: multiples of 8;
  // an e4m3 pool's rows: multiples of 16)
  if (!aligned16(p->q_nope) || !aligned16(p->q_pe) || !aligned16(p->kv_cache) || !aligned16(p->k_new) ||
      !aligned16(p->out) || (reinterpret_cast<uintptr_t>(p->workspace) & (kAlign - 1)) != 0 ||
      (p->q_nope_stride_t | p->q_nope_stride_h | p->q_pe_stride_t | p->q_pe_stride_h | p->kv_stride_s |
       p->k_new_stride_t | p->out_stride_t | p->out_stride_h) % 8 != 0 ||
      (p->kv_dtype == KDTREE_KV_E4M3 && p->kv_stride_s % 16 != 0))
    return KDTREE_ERR_ALIGNMENT;
  // rows r = n * H + h of one request and global rows t * H + h are int32 in the kernels, and the combine's works
  // (rows x column slices, strided by its grid) 32-bit: 2^27 rows, 128 GiB of output, is far beyond any GPU
  if ((long long)p->num_tokens * p->num_heads * kdtree::kCombineMaxSlices >= (1ll << 30)) return KDTREE_ERR_OVERFLOW;
  return KDTREE_OK;
}

// Launches `kernel` on `stream`; with `pdl`, as a programmatic dependent of the previous kernel in
// the stream: its blocks may be scheduled before that kernel completes, and wait in
// grid_dependency_wait() (verify_ptx.cuh) before reading anything. CUDA graphs capture the edge.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), unsigned blocks, int threads, size_t smem, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks, 1, 1);
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// The pack kernel over num_tokens x words mask words, 128 threads a block (kdtree_pack_tree_mask, and a verify call
// that packs its own mask but runs no plan kernel).
cudaError_t launch_pack(const uint8_t* custom_mask, const int64_t* mask_indptr, const void* qo_indptr, int qo64,
                        const int32_t* kv_indptr, int batch, int num_tokens, uint64_t* out, int words,
                        cudaStream_t stream, bool pdl) {
  const int threads = 128;
  const long long blocks = ((long long)num_tokens * words + threads - 1) / threads;
  return launch_kernel(kdtree::kdtree_pack_tree_mask_kernel, (unsigned)blocks, threads, 0, stream, pdl, custom_mask,
                       mask_indptr, qo_indptr, qo64, kv_indptr, batch, num_tokens, out, words);
}

#define KDTREE_TRY(expr)                 \
  do {                                   \
    const cudaError_t e_ = (expr);       \
    if (e_ != cudaSuccess) return (int)e_; \
  } while (0)

// The dual kernel's q tensor maps (Params::q_map): q_nope and q_pe as 2-D bf16 tensors of T x H rows (512 and 64
// columns) with 64 x 64 boxes in the q slabs' 128-byte swizzle, and for its FP8 form also q's e4m3 terms in the
// workspace (q8: 1,152 bytes a row, mapped as 576 2-byte columns). Built where every row of q is one stride after the
// previous (a token's stride H head strides, or one head, or one token); otherwise, or without the driver's encoder,
// q_tma stays 0 and the kernel copies q with cp.async. Encoding is host work on the call's own values: no device call,
// no synchronisation.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled tensor_map_encoder() {
  static EncodeTiled fn = nullptr;   // (benign race: the same pointer from every thread)
  static bool looked = false;
  if (!looked) {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeTiled>(f);
    else
      cudaGetLastError();
    looked = true;
  }
  return fn;
}
static_assert(sizeof(Params::TmaMap) == sizeof(CUtensorMap), "a TMA descriptor is 128 bytes");
// (validate has made base and row_stride 16-byte multiples and rows < 2^30, as TMA needs)
bool encode_q_map(EncodeTiled enc, Params::TmaMap* map, const void* base, long long rows, int cols,
                  long long row_stride) {
  const cuuint64_t dim[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  const cuuint64_t stride[1] = {(cuuint64_t)row_stride * 2};   // bytes from one row to the next
  const cuuint32_t box[2] = {64, (cuuint32_t)kdtree::dual::kBlockM};
  const cuuint32_t elem[2] = {1, 1};
  return enc(reinterpret_cast<CUtensorMap*>(map), CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dim,
             stride, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
// One row stride for all T x H rows of q, or 0 when there is none.
long long uniform_row_stride(long long st, long long sh, int tokens, int heads) {
  if (heads == 1) return st;
  if (tokens == 1 || st == heads * sh) return sh;
  return 0;
}
bool build_q_maps(Params& prm, const kdtree_verify_params* p, bool q8) {
  const EncodeTiled enc = tensor_map_encoder();
  if (!enc) return false;
  const long long rows = (long long)p->num_tokens * p->num_heads;
  const long long sn = uniform_row_stride(p->q_nope_stride_t, p->q_nope_stride_h, p->num_tokens, p->num_heads);
  const long long sp = uniform_row_stride(p->q_pe_stride_t, p->q_pe_stride_h, p->num_tokens, p->num_heads);
  return sn > 0 && sp > 0 && encode_q_map(enc, &prm.q_map[0], p->q_nope, rows, KDTREE_HEAD_DIM_NOPE, sn) &&
         encode_q_map(enc, &prm.q_map[1], p->q_pe, rows, KDTREE_HEAD_DIM_PE, sp) &&
         (!q8 || encode_q_map(enc, &prm.q_map[2], prm.q8, rows, kdtree::kDimQK, kdtree::kQ8RowBytes / 2));
}

}  // namespace

extern "C" {

size_t kdtree_verify_workspace_size(int batch_size, int num_tokens, int num_heads) {
  if (batch_size < 1 || num_tokens < 1 || num_heads < 1 || num_heads > KDTREE_MAX_HEADS) return 0;
  int status = KDTREE_OK;
  const DeviceInfo dev = current_device(&status);
  if (status != KDTREE_OK) return 0;
  return workspace_layout(batch_size, num_tokens, num_heads, kSplitsPerSm * dev.sms).total;
}

int kdtree_verify_split_kernel(int* kernel) {
  if (!kernel) return KDTREE_ERR_NULL_POINTER;
  int status = KDTREE_OK;
  const DeviceInfo dev = current_device(&status);
  if (status == KDTREE_OK) *kernel = dev.kernel;
  return status;
}

int kdtree_verify_call_kernel(int batch_size, int num_tokens, int num_heads, int kv_dtype, int kv_scaled,
                              int* kernel) {
  if (!kernel) return KDTREE_ERR_NULL_POINTER;
  if (batch_size < 1) return KDTREE_ERR_BATCH;
  if (num_tokens < 1) return KDTREE_ERR_NUM_TOKENS;
  if (num_heads < 1 || num_heads > KDTREE_MAX_HEADS) return KDTREE_ERR_NUM_HEADS;
  if (kv_dtype != KDTREE_KV_BF16 && kv_dtype != KDTREE_KV_E4M3) return KDTREE_ERR_KV_DTYPE;
  int status = KDTREE_OK;
  const DeviceInfo dev = current_device(&status);
  if (status == KDTREE_OK) *kernel = call_kernel(dev, batch_size, num_tokens, num_heads, kv_dtype, kv_scaled != 0);
  return status;
}

int kdtree_verify_launch(const kdtree_verify_params* p, void* stream_ptr) {
  if (!p) return KDTREE_ERR_NULL_POINTER;
  int status = validate(p);
  if (status != KDTREE_OK) return status;
  const DeviceInfo dev = current_device(&status);
  if (status != KDTREE_OK) return status;
  const int sms = dev.sms;
  const int split_target = kSplitsPerSm * sms;
  const Layout lay = workspace_layout(p->batch_size, p->num_tokens, p->num_heads, split_target);
  if (p->workspace_bytes < lay.total) return KDTREE_ERR_WORKSPACE;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  Params prm;
  prm.q_nope = static_cast<const __nv_bfloat16*>(p->q_nope);
  prm.q_nope_st = p->q_nope_stride_t;
  prm.q_nope_sh = p->q_nope_stride_h;
  prm.q_pe = static_cast<const __nv_bfloat16*>(p->q_pe);
  prm.q_pe_st = p->q_pe_stride_t;
  prm.q_pe_sh = p->q_pe_stride_h;
  prm.kv = static_cast<const __nv_bfloat16*>(p->kv_cache);
  prm.kv_ss = p->kv_stride_s;
  prm.kv_indices = p->kv_indices;
  prm.kv_indices_64 = p->kv_indices_dtype == KDTREE_INDEX_INT64;
  prm.kv_indptr = p->kv_indptr;
  prm.k_new = static_cast<const __nv_bfloat16*>(p->k_new);
  prm.k_new_st = p->k_new_stride_t;
  prm.qo_indptr = p->qo_indptr;
  prm.qo_indptr_64 = p->qo_indptr_dtype == KDTREE_INDEX_INT64;
  prm.tree_mask = p->tree_mask;
  prm.mask_words = p->tree_mask ? p->tree_mask_words : 0;
  prm.out = static_cast<__nv_bfloat16*>(p->out);
  prm.out_st = p->out_stride_t;
  prm.out_sh = p->out_stride_h;
  prm.batch = p->batch_size;
  prm.num_tokens = p->num_tokens;
  prm.heads = p->num_heads;
  prm.scale_log2 = p->sm_scale * 1.4426950408889634f;
  prm.split_target = split_target;
  const bool kv_scaled = p->k_scale != 1.f || p->v_scale != 1.f;
  const int call = call_kernel(dev, p->batch_size, p->num_tokens, p->num_heads, p->kv_dtype, kv_scaled);
  if (p->kv_dtype == KDTREE_KV_E4M3 && dev.fp8_status != KDTREE_OK) return dev.fp8_status;
  if (call == KDTREE_KERNEL_MMA_SCALED && dev.scaled_status != KDTREE_OK) return dev.scaled_status;
  const SplitLaunch split = split_launch(call, dev.mma_stages);
  prm.block_m = split.block_m;
  prm.tile_n = split.tile_n;
  prm.min_chunk = split.min_chunk;
  prm.max_partial_rows = lay.max_partial_rows;
  unsigned char* ws = static_cast<unsigned char*>(p->workspace);
  prm.counter = reinterpret_cast<int*>(ws + lay.header);
  prm.zero_row = reinterpret_cast<const __nv_bfloat16*>(ws + lay.zero_row);
  prm.plan = reinterpret_cast<ReqPlan*>(ws + lay.plan);
  prm.partial_lse = reinterpret_cast<float*>(ws + lay.lse);
  prm.partial_o = reinterpret_cast<__nv_bfloat16*>(ws + lay.partial);
  prm.tile_done = reinterpret_cast<int*>(ws + lay.tile_done);
  prm.tile_seen = reinterpret_cast<int*>(ws + lay.tile_seen);
  prm.q8 = ws + lay.q8;
  prm.q_scale = reinterpret_cast<float*>(ws + lay.q_scale);
  prm.done_arrivals = dev.early_combine ? split.done_arrivals : 0;
  prm.pack_mask = p->pack_custom_mask;
  prm.pack_mask_indptr = p->pack_mask_indptr;
  // (the FP8 form loads every item's q by TMA or none: its q mbarrier's parity counts the items)
  prm.q_tma = dev.q_tma && (call == KDTREE_KERNEL_DUAL || call == KDTREE_KERNEL_DUAL_FP8) &&
              build_q_maps(prm, p, call == KDTREE_KERNEL_DUAL_FP8);
  // every e4m3 call runs an FP8 kernel, and all of them, like the scaled one, take the drafts apart
  prm.drafts_apart = p->kv_dtype == KDTREE_KV_E4M3 || call == KDTREE_KERNEL_MMA_SCALED;
  prm.k_scale = p->k_scale;
  prm.v_scale = p->v_scale;

  const bool pdl = dev.pdl;
  // The prep kernel: the plan (unless reused), the tree mask this call packs (one kernel and one dependency wait fewer
  // than kdtree_pack_tree_mask before the call) and an FP8 call's q terms, each in blocks of its own.
  const long long pack_words = p->pack_custom_mask ? (long long)p->num_tokens * p->tree_mask_words : 0;
  prm.plan_blocks = p->reuse_plan ? 0 : 1;
  prm.pack_blocks = (int)((pack_words + kdtree::kPlanThreads - 1) / kdtree::kPlanThreads);
  const long long rows = (long long)p->num_tokens * p->num_heads;
  // (every e4m3 call runs an FP8 kernel, and every FP8 kernel reads q's e4m3 terms)
  const int q_blocks =
      p->kv_dtype == KDTREE_KV_E4M3 ? (int)((rows + kdtree::kQ8RowsPerBlock - 1) / kdtree::kQ8RowsPerBlock) : 0;
  const unsigned prep_blocks = (unsigned)(prm.plan_blocks + prm.pack_blocks + q_blocks);
  if (prep_blocks)
    KDTREE_TRY(launch_kernel(kdtree::kdtree_verify_plan_kernel, prep_blocks, kdtree::kPlanThreads, 0, stream, pdl, prm));
  KDTREE_TRY(launch_kernel(split.kernel, sms, split.threads, split.smem, stream, pdl, prm));
  // combine blocks stride over (column slice, row) pairs, rows x (the largest slice count of any row,
  // which only the plan kernel knows): one block per row at least, up to a wave of them when the
  // rows are few (and may need more slices)
  const long long combine_rows = (long long)p->num_tokens * p->num_heads;
  // (kExpCombineBlocksDiv: 1 but in a profiling build, verify_profiling.cuh)
  const long long combine_blocks = std::max(
      1ll, std::max(combine_rows, std::min(combine_rows * kdtree::kCombineMaxSlices, 4ll * sms)) / kdtree::kExpCombineBlocksDiv);
  KDTREE_TRY(launch_kernel(kdtree::kdtree_verify_combine_kernel, (unsigned)combine_blocks, kdtree::kCombineThreads,
                           0, stream, pdl, prm));
#ifdef KDTREE_EXP_TRACE   // the wgmma kernels' stamps, printed (a plain launch: after the combine has finished)
  KDTREE_TRY(launch_kernel(kdtree::kdtree_trace_dump_kernel, 1, 1, 0, stream, false));
#endif
  return KDTREE_OK;
}

int kdtree_pack_tree_mask(const uint8_t* custom_mask, const int64_t* mask_indptr, const void* qo_indptr,
                          int qo_indptr_dtype, const int32_t* kv_indptr, int batch_size, int num_tokens,
                          uint64_t* out, int out_words, void* stream_ptr) {
  if (!custom_mask || !mask_indptr || !qo_indptr || !kv_indptr || !out) return KDTREE_ERR_NULL_POINTER;
  if (batch_size < 1) return KDTREE_ERR_BATCH;
  if (num_tokens < 1) return KDTREE_ERR_NUM_TOKENS;
  if (out_words < 1 || out_words > KDTREE_MAX_MASK_WORDS) return KDTREE_ERR_MASK_WORDS;
  if (qo_indptr_dtype != KDTREE_INDEX_INT32 && qo_indptr_dtype != KDTREE_INDEX_INT64) return KDTREE_ERR_INDEX_DTYPE;
  int status = KDTREE_OK;
  const DeviceInfo dev = current_device(&status);
  if (status != KDTREE_OK) return status;
  KDTREE_TRY(launch_pack(custom_mask, mask_indptr, qo_indptr, qo_indptr_dtype == KDTREE_INDEX_INT64 ? 1 : 0, kv_indptr,
                         batch_size, num_tokens, out, out_words, static_cast<cudaStream_t>(stream_ptr), dev.pdl));
  return KDTREE_OK;
}

const char* kdtree_status_string(int status) {
  switch (status) {
    case KDTREE_OK: return "ok";
    case KDTREE_ERR_NULL_POINTER: return "a required pointer is NULL";
    case KDTREE_ERR_BATCH: return "batch_size must be >= 1";
    case KDTREE_ERR_NUM_TOKENS: return "num_tokens must be >= 1";
    case KDTREE_ERR_NUM_HEADS: return "num_heads must be in [1, 128]";
    case KDTREE_ERR_STRIDE: return "a stride is negative or smaller than the row it spans";
    case KDTREE_ERR_ALIGNMENT: return "a pointer or row stride is not 16-byte aligned (bf16 strides must be multiples of 8)";
    case KDTREE_ERR_MASK_WORDS: return "tree_mask_words must be in [1, 8] (at most 512 verify tokens per request)";
    case KDTREE_ERR_INDEX_DTYPE: return "an index dtype code is neither KDTREE_INDEX_INT32 nor KDTREE_INDEX_INT64";
    case KDTREE_ERR_WORKSPACE: return "workspace is smaller than kdtree_verify_workspace_size()";
    case KDTREE_ERR_OVERFLOW: return "num_tokens * num_heads is too large for 32-bit row indexing";
    case KDTREE_ERR_SCALE: return "sm_scale, k_scale and v_scale must be finite and > 0";
    case KDTREE_ERR_KV_DTYPE: return "kv_dtype must be KDTREE_KV_BF16 or KDTREE_KV_E4M3";
    case KDTREE_ERR_NO_DEVICE: return "no usable CUDA device";
    case KDTREE_ERR_ARCH: return "this build has no kernel image for the current GPU (rebuild with its architecture)";
    case KDTREE_ERR_NUM_SLOTS: return "num_slots must be >= 1";
    case KDTREE_ERR_RESOURCES: return "the split kernel does not fit one block per SM on this GPU (registers/shared memory)";
    case KDTREE_ERR_REUSE_PLAN: return "reuse_plan must be 0 or 1";
    case KDTREE_ERR_ENV:
      return g_env_message[0] ? g_env_message : "a KDTREE_* environment switch has a value this build does not take";
    default: break;
  }
  if (status > 0) return cudaGetErrorString(static_cast<cudaError_t>(status));
  return "unknown kdtree status";
}

const char* kdtree_compiled_archs(void) { return KDTREE_CUDA_ARCHS_STR; }

}  // extern "C"
