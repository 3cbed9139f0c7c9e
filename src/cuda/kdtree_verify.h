/*
 * kdtree_verify.h: the one header the bindings see. Plain C (compiles as C99), no torch types.
 *
 * Paged tree-verify attention for MLA (DeepSeek-style latent attention, absorbed path):
 * for every request b of a speculative-decoding TARGET_VERIFY batch,
 *   rows      r = (n, h), n in [0, N_b) verify tokens, h in [0, H) heads   (R_b = N_b * H rows)
 *   keys      the P_b committed prefix rows of the KV pool, read through slot indices (any page size: a slot
 *             id is a token's row), then the N_b new latent rows of this request (the drafts, read from k_new)
 *   score     s = sm_scale * (q_nope . key[:512] + q_pe . key[512:576]), a prefix key counting as
 *             k_scale * its pool row, a draft as its k_new row
 *   visible   every prefix key; draft key j iff tree_mask bit (n, j) is set,
 *             or j <= n when tree_mask is NULL (causal chain)
 *   output    out[t, h, :] = softmax over the visible keys of s, applied to the values: v_scale * pool row[:512]
 *             for a prefix key, k_new row[:512] for a draft
 * A row that sees no key at all (P_b == 0 and an all-False tree row) gets zeros.
 *
 * Every stride is in elements (not bytes) and int64; the innermost dimension of every
 * tensor must be contiguous (stride 1). All pointers are device pointers.
 * The launch is asynchronous on `stream`, allocates nothing, never synchronises with the
 * host and reads no device value on the host: it can be captured in a CUDA graph.
 */
#ifndef KDTREE_VERIFY_H_
#define KDTREE_VERIFY_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* MLA geometry served by this library. */
#define KDTREE_HEAD_DIM_NOPE 512 /* latent ("nope") part of q and key; also the value width */
#define KDTREE_HEAD_DIM_PE 64    /* rope part */
#define KDTREE_HEAD_DIM_QK 576   /* KDTREE_HEAD_DIM_NOPE + KDTREE_HEAD_DIM_PE */
#define KDTREE_HEAD_DIM_V 512

#define KDTREE_MAX_HEADS 128     /* heads per rank */
#define KDTREE_MAX_MASK_WORDS 8  /* tree_mask words per row: verify tokens per request <= 512 */

/* Element types of the KV pool (kdtree_verify_params.kv_dtype). */
#define KDTREE_KV_BF16 0   /* 576 bfloat16 per row */
#define KDTREE_KV_E4M3 1   /* 576 float8_e4m3fn per row (SGLang's fp8_e4m3 KV cache) */

/* Index dtypes accepted for qo_indptr / kv_indices. */
#define KDTREE_INDEX_INT32 0
#define KDTREE_INDEX_INT64 1

/* Status codes: 0 ok, > 0 a cudaError_t value, < 0 a kdtree code below. */
#define KDTREE_OK 0
#define KDTREE_ERR_NULL_POINTER (-1)   /* a required pointer is NULL */
#define KDTREE_ERR_BATCH (-2)          /* batch_size < 1 */
#define KDTREE_ERR_NUM_TOKENS (-3)     /* num_tokens < 1 */
#define KDTREE_ERR_NUM_HEADS (-4)      /* num_heads outside [1, KDTREE_MAX_HEADS] */
#define KDTREE_ERR_STRIDE (-5)         /* a stride is smaller than the row it spans, or negative */
#define KDTREE_ERR_ALIGNMENT (-6)      /* a pointer or row stride is not 16-byte aligned */
#define KDTREE_ERR_MASK_WORDS (-7)     /* tree_mask_words outside [1, KDTREE_MAX_MASK_WORDS] */
#define KDTREE_ERR_INDEX_DTYPE (-8)    /* an index dtype code is not KDTREE_INDEX_INT32/INT64 */
#define KDTREE_ERR_WORKSPACE (-9)      /* workspace is smaller than kdtree_verify_workspace_size */
#define KDTREE_ERR_OVERFLOW (-10)      /* a size would overflow the kernel's 32-bit row indexing */
#define KDTREE_ERR_SCALE (-11)         /* sm_scale, k_scale or v_scale is not finite and positive */
#define KDTREE_ERR_NO_DEVICE (-12)     /* no CUDA device usable by this build */
#define KDTREE_ERR_ARCH (-13)          /* the current device has no kernel image in this build */
#define KDTREE_ERR_NUM_SLOTS (-14)     /* num_slots < 1 */
#define KDTREE_ERR_RESOURCES (-15)     /* the split kernel cannot fit one block on an SM of this GPU */
#define KDTREE_ERR_REUSE_PLAN (-16)    /* reuse_plan is neither 0 nor 1 */
#define KDTREE_ERR_ENV (-17)           /* a KDTREE_* environment switch has a value this build does not take */
#define KDTREE_ERR_KV_DTYPE (-18)      /* kv_dtype is neither KDTREE_KV_BF16 nor KDTREE_KV_E4M3 */

typedef struct kdtree_verify_params {
  /* ---- queries, T = num_tokens verify tokens of all requests, H = num_heads ---- */
  const void* q_nope;           /* [T, H, 512] bf16, strides (q_nope_stride_t, q_nope_stride_h, 1) */
  int64_t q_nope_stride_t;
  int64_t q_nope_stride_h;
  const void* q_pe;             /* [T, H, 64] bf16, strides (q_pe_stride_t, q_pe_stride_h, 1) */
  int64_t q_pe_stride_t;
  int64_t q_pe_stride_h;

  /* ---- the paged latent cache (slot = token row, for any page size) ---- */
  const void* kv_cache;         /* [num_slots, 576] of kv_dtype, row stride kv_stride_s; [:, :512] are the values */
  int64_t kv_stride_s;
  int64_t num_slots;            /* rows of kv_cache (slot ids index it; the caller keeps them in range) */
  const void* kv_indices;       /* [>= kv_indptr[B]] int32/int64 slot ids, request b at kv_indptr[b]:kv_indptr[b+1] */
  int kv_indices_dtype;         /* KDTREE_INDEX_INT32 or KDTREE_INDEX_INT64 */
  const int32_t* kv_indptr;     /* [B + 1] int32, prefix lengths P_b = kv_indptr[b+1] - kv_indptr[b] */

  /* ---- the verify tokens' own latent rows (SGLang's `k`) ---- */
  const void* k_new;            /* [T, 576] bf16, row stride k_new_stride_t; request b's drafts at qo_indptr[b]: */
  int64_t k_new_stride_t;
  const void* qo_indptr;        /* [B + 1] int32/int64, verify rows of request b: qo_indptr[b]:qo_indptr[b+1] */
  int qo_indptr_dtype;          /* KDTREE_INDEX_INT32 or KDTREE_INDEX_INT64 */

  /* ---- draft-tree visibility ---- */
  const uint64_t* tree_mask;    /* [T, tree_mask_words] uint64, row t = verify token qo_indptr[b] + n:
                                   bit j of word j/64 set <=> token n sees draft j of its request.
                                   NULL: causal chain (draft j visible iff j <= n). */
  int tree_mask_words;          /* words per row, 1..KDTREE_MAX_MASK_WORDS; N_b <= 64 * words. Ignored if NULL. */

  /* ---- output ---- */
  void* out;                    /* [T, H, 512] bf16, strides (out_stride_t, out_stride_h, 1) */
  int64_t out_stride_t;
  int64_t out_stride_h;

  /* ---- sizes ---- */
  int batch_size;               /* B */
  int num_tokens;               /* T = qo_indptr[B] (host-known: the rows of q) */
  int num_heads;                /* H */
  float sm_scale;               /* softmax scale (SGLang's layer.scaling) */

  /* ---- scratch (split-K partials, the work plan); never allocated by the launch ---- */
  void* workspace;              /* >= kdtree_verify_workspace_size(...) bytes, 256-byte aligned */
  size_t workspace_bytes;

  /* ---- the work plan ---- */
  int reuse_plan;               /* 0: plan the split on the GPU in this call (always correct).
                                   1: skip the plan kernel and run on the plan this workspace already holds:
                                   the caller guarantees that the last call on this workspace had the same
                                   batch_size, num_tokens, num_heads and the same kv_indptr / qo_indptr values
                                   (e.g. an earlier layer of one forward pass, which shares its metadata), on
                                   the same device. Anything else reads a wrong plan: wrong results. */

  /* ---- the tree mask packed by this call (optional; zero-initialised callers keep the fields above) ---- */
  const uint8_t* pack_custom_mask; /* NULL: tree_mask comes packed (or is NULL). Else SGLang's flat custom_mask, as
                                      kdtree_pack_tree_mask reads it: the call packs it into tree_mask, which must then
                                      be non-NULL and writable ([num_tokens, tree_mask_words], fully written before the
                                      split reads it), inside its plan kernel (one kernel fewer than packing first;
                                      with reuse_plan, by the pack kernel). */
  const int64_t* pack_mask_indptr; /* [B + 1] int64, request b's block of pack_custom_mask; needed with it */

  /* ---- the pool's element type and scales (SGLang's k_descale / v_descale; drafts are never scaled) ---- */
  int kv_dtype;                 /* KDTREE_KV_BF16 or KDTREE_KV_E4M3 */
  float k_scale;                /* a prefix key scores as k_scale * its pool row: finite, > 0 (1: none) */
  float v_scale;                /* a prefix key's value is v_scale * its pool row[:512]: finite, > 0 (1: none) */
} kdtree_verify_params;

/*
 * Bytes of workspace kdtree_verify_launch needs for a batch of `batch_size` requests with
 * `num_tokens` verify tokens in all and `num_heads` heads, on the current device.
 * Depends only on these host-known sizes (never on prefix lengths), so one buffer sized for
 * the largest batch serves every call, CUDA-graph replays included.
 * Returns 0 on an invalid argument or when no device is usable.
 */
size_t kdtree_verify_workspace_size(int batch_size, int num_tokens, int num_heads);

/* Validate, plan the split on the GPU (unless params->reuse_plan), run the split-K pass and the combine
 * on `stream`. Returns KDTREE_OK or an error status; nothing is launched when validation fails.
 * Every call leaves the plan in the workspace ready for reuse (the combine resets its work counter).
 * The split pass that runs is the one kdtree_verify_call_kernel names; the combine merges each row tile as soon as
 * that tile's split items have stored their partials (it starts while the split pass still runs). */
int kdtree_verify_launch(const kdtree_verify_params* params, void* stream /* cudaStream_t */);

/* The split-K kernels (kdtree_verify_split_kernel, kdtree_verify_call_kernel). */
typedef enum kdtree_split_kernel_id {
  KDTREE_KERNEL_MMA_2STAGE = 1, /* mma.sync, 2 key stages: sm_120 (99 KB of shared memory per block) */
  KDTREE_KERNEL_MMA_3STAGE = 2, /* mma.sync, 3 key stages: a 227 KB GPU without sm_90a code (KDTREE_SPLIT_KERNEL=mma) */
  KDTREE_KERNEL_MMA_32ROW = 3,  /* the 2-stage pipeline with 32-row items: calls of <= 32 rows per request beside 1 */
  KDTREE_KERNEL_DUAL = 4,       /* sm_90a wgmma, two score warpgroups and a producer: H100/H200 */
  KDTREE_KERNEL_SKINNY = 5,     /* sm_90a, 16-row items with the keys as the wgmma M: calls of <= 16 rows per request
                                   beside 4 (every call under KDTREE_SPLIT_KERNEL=skinny) */
  KDTREE_KERNEL_MMA_FP8 = 6,    /* mma.sync over an e4m3 pool (block-scaled e4m3 on sm_120a, plain e4m3 elsewhere),
                                   drafts in bf16 items of their own: KDTREE_KV_E4M3 calls where 8 does not run */
  KDTREE_KERNEL_MMA_SCALED = 7, /* the mma.sync kernel (the device's stages) with the drafts apart, prefix items
                                   scaled: KDTREE_KV_BF16 calls with k_scale or v_scale other than 1 */
  KDTREE_KERNEL_DUAL_FP8 = 8,   /* kernel 4 over an e4m3 pool, its products in e4m3 wgmma (V^T from registers), four
                                   warpgroups, drafts in bf16 items of their own: KDTREE_KV_E4M3 calls where 4 is the
                                   device's kernel */
  KDTREE_KERNEL_SKINNY_FP8 = 9, /* kernel 5 over an e4m3 pool, its products in e4m3 wgmma with the keys as the A
                                   operand from registers, drafts in bf16 items of their own: KDTREE_KV_E4M3 calls
                                   of <= 16 rows per request beside 8 */
  KDTREE_KERNEL_SKINNY_FP8_32ROW = 10 /* kernel 9 with 32-row items, two consumer warpgroups of 16 rows on every key
                                         tile: KDTREE_KV_E4M3 calls of 17 to 32 rows per request beside 8 */
} kdtree_split_kernel_id;

/* The split kernel kdtree_verify_launch runs on the current device for calls of many rows per request, into
 * *kernel (a kdtree_split_kernel_id): KDTREE_KERNEL_DUAL on compute capability 9.0 when the build carries sm_90a code,
 * else the mma.sync kernel with 3 key stages where a block may take that much shared memory, 2 elsewhere (sm_120).
 * Read once per device: KDTREE_SPLIT_KERNEL=mma forces the 3-stage mma.sync kernel and KDTREE_SPLIT_STAGES=2 the
 * 2-stage one (the sm_120 code path, to measure and test it on an H100/H200); KDTREE_SPLIT_KERNEL=skinny runs every
 * call on the skinny kernel (correct for any rows: to test it).
 * Returns KDTREE_OK or an error status. */
int kdtree_verify_split_kernel(int* kernel);

/* The split kernel a call of this batch size, token count, head count, pool type (kv_dtype) and scaling
 * (kv_scaled: k_scale or v_scale other than 1) runs on the current device: for an e4m3 pool KDTREE_KERNEL_DUAL_FP8 where
 * the device's kernel is KDTREE_KERNEL_DUAL (sm_90a) and KDTREE_KERNEL_SKINNY_FP8 where it would run
 * KDTREE_KERNEL_SKINNY (the same rule below; every e4m3 call under KDTREE_SPLIT_KERNEL=skinny) and
 * KDTREE_KERNEL_SKINNY_FP8_32ROW where the same rule with 32 rows holds (KDTREE_SKINNY=0: neither), else
 * KDTREE_KERNEL_MMA_FP8 (its sm_120 code path; on an H100/H200 under KDTREE_SPLIT_KERNEL=mma or KDTREE_SPLIT_STAGES=2),
 * KDTREE_KERNEL_MMA_SCALED for a scaled bf16 pool, else the device's (above), except that where it is
 * KDTREE_KERNEL_DUAL a call of num_heads * num_tokens / batch_size <= 16 rows per request runs KDTREE_KERNEL_SKINNY
 * (KDTREE_SKINNY=0: never), and where it is KDTREE_KERNEL_MMA_2STAGE a call of <= 32 rows per request runs
 * KDTREE_KERNEL_MMA_32ROW (KDTREE_MMA_HALVES=0: never); a call whose num_tokens is not a multiple of batch_size runs
 * the device's kernel. The choice takes every request to have num_tokens / batch_size verify tokens (SGLang's verify
 * batches), so a request's result is the same, bit for bit, alone and in any batch of requests with its token count;
 * in a batch of mixed token counts it may differ at bf16 rounding from its result alone.
 * Returns KDTREE_OK or an error status (an invalid size as kdtree_verify_launch reports it). */
int kdtree_verify_call_kernel(int batch_size, int num_tokens, int num_heads, int kv_dtype, int kv_scaled, int* kernel);

/* Build the compact tree mask from SGLang's flat custom_mask on `stream` (no host sync):
 *   custom_mask   [>= mask_indptr[B]] bytes (bool or uint8), request b's N_b x (P_b + N_b)
 *                 row-major block at mask_indptr[b]; only the N_b x N_b draft columns are read
 *   mask_indptr   [B + 1] int64
 *   out           [num_tokens, out_words] uint64, fully written (bits past N_b are 0) */
int kdtree_pack_tree_mask(const uint8_t* custom_mask, const int64_t* mask_indptr,
                          const void* qo_indptr, int qo_indptr_dtype, const int32_t* kv_indptr,
                          int batch_size, int num_tokens, uint64_t* out, int out_words,
                          void* stream /* cudaStream_t */);

/* A static, human-readable message for a status code (never NULL). */
const char* kdtree_status_string(int status);

/* The CUDA architectures this build carries machine code for, comma-separated ("90,120"). */
const char* kdtree_compiled_archs(void);

#ifdef __cplusplus
}
#endif

#endif /* KDTREE_VERIFY_H_ */
