// verify_mask.cuh: the tree mask packed from SGLang's flat custom_mask into [T, words] 64-bit rows: bit j of a
// verify token's row says it sees draft j of its request. Run by its own kernel (kdtree_pack_tree_mask) or by the
// plan kernel's extra blocks when a verify call packs its own mask.
#pragma once

#include "verify_common.cuh"
#include "verify_profiling.cuh"
#include "verify_ptx.cuh"

namespace kdtree {

// Tree-mask packing from SGLang's flat custom_mask: word idx = t * words + w of the packed mask, by one thread (the pack
// kernel's, or the plan kernel's blocks 1.. when a verify call packs its own mask).
__device__ __forceinline__ void pack_tree_mask_word(const uint8_t* custom_mask, const int64_t* mask_indptr,
                                                    const void* qo_indptr, int qo64, const int32_t* kv_indptr,
                                                    int batch, int num_tokens, uint64_t* out, int words, long long idx) {
  if (idx >= (long long)num_tokens * words) return;
  const int t = (int)(idx / words);
  const int w = (int)(idx - (long long)t * words);
  const int lo = owning_request(batch, t, [&](int b) { return load_index(qo_indptr, qo64, b); });
  const long long qb = load_index(qo_indptr, qo64, lo);
  const long long qe = load_index(qo_indptr, qo64, lo + 1);
  uint64_t bits = 0;
  if (t >= qb && t < qe) {
    const long long n_tok = qe - qb;
    const long long p = kv_indptr[lo + 1] - kv_indptr[lo];
    const long long i = t - qb;
    const uint8_t* row = custom_mask + mask_indptr[lo] + i * (p + n_tok) + p;
    const int j0 = w * 64;
    const int j1 = (int)(n_tok < j0 + 64 ? n_tok : j0 + 64);
    for (int j = j0; j < j1; ++j) bits |= (uint64_t)(row[j] != 0) << (j - j0);
  }
  out[idx] = bits;
}

// ---------------------------------------------------------------------------------------------
// Tree-mask packing from SGLang's flat custom_mask: one thread per (verify token, 64-bit word).
// ---------------------------------------------------------------------------------------------
__global__ void kdtree_pack_tree_mask_kernel(const uint8_t* custom_mask, const int64_t* mask_indptr,
                                             const void* qo_indptr, int qo64, const int32_t* kv_indptr,
                                             int batch, int num_tokens, uint64_t* out, int words) {
  KDTREE_TIMELINE(0, 0);
  grid_dependency_launch_dependents();
  grid_dependency_wait();   // custom_mask and the indptr arrays come from earlier work on the stream
  KDTREE_TIMELINE(0, 1);
  KDTREE_TIMELINE(0, 2);   // (the start of the last block to run: its few loads and store follow)
  pack_tree_mask_word(custom_mask, mask_indptr, qo_indptr, qo64, kv_indptr, batch, num_tokens, out, words,
                      (long long)blockIdx.x * blockDim.x + threadIdx.x);
}

}  // namespace kdtree
