# cython: language_level=3, embedsignature=True
"""kdtree._verify: the thin binding over src/cuda/kdtree_verify.h.

Pointers are Python ints (torch's ``tensor.data_ptr()``), strides are in elements, ``stream`` is
an int (``torch.cuda.current_stream().cuda_stream``; 0 is the legacy default stream).
A non-zero status from the library raises :class:`KdtreeError`. No tensor logic lives here:
shapes, dtypes and devices are checked by ``kdtree.ops`` before it calls in.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, uintptr_t

import operator


cdef extern from "kdtree_verify.h" nogil:
    enum:
        KDTREE_HEAD_DIM_NOPE
        KDTREE_HEAD_DIM_PE
        KDTREE_HEAD_DIM_QK
        KDTREE_HEAD_DIM_V
        KDTREE_MAX_HEADS
        KDTREE_MAX_MASK_WORDS
        KDTREE_INDEX_INT32
        KDTREE_INDEX_INT64
        KDTREE_KV_BF16
        KDTREE_KV_E4M3
        KDTREE_OK
        KDTREE_ERR_BATCH
        KDTREE_ERR_NUM_TOKENS
        KDTREE_ERR_NUM_HEADS
        KDTREE_ERR_NO_DEVICE

    ctypedef enum kdtree_split_kernel_id:
        KDTREE_KERNEL_MMA_2STAGE
        KDTREE_KERNEL_MMA_3STAGE
        KDTREE_KERNEL_MMA_32ROW
        KDTREE_KERNEL_DUAL
        KDTREE_KERNEL_SKINNY
        KDTREE_KERNEL_MMA_FP8
        KDTREE_KERNEL_DUAL_FP8
        KDTREE_KERNEL_SKINNY_FP8
        KDTREE_KERNEL_SKINNY_FP8_32ROW
        KDTREE_KERNEL_MMA_SCALED

    ctypedef struct kdtree_verify_params:
        const void* q_nope
        int64_t q_nope_stride_t
        int64_t q_nope_stride_h
        const void* q_pe
        int64_t q_pe_stride_t
        int64_t q_pe_stride_h
        const void* kv_cache
        int64_t kv_stride_s
        int64_t num_slots
        const void* kv_indices
        int kv_indices_dtype
        const int32_t* kv_indptr
        const void* k_new
        int64_t k_new_stride_t
        const void* qo_indptr
        int qo_indptr_dtype
        const uint64_t* tree_mask
        int tree_mask_words
        void* out
        int64_t out_stride_t
        int64_t out_stride_h
        int batch_size
        int num_tokens
        int num_heads
        float sm_scale
        void* workspace
        size_t workspace_bytes
        int reuse_plan
        const uint8_t* pack_custom_mask
        const int64_t* pack_mask_indptr
        int kv_dtype
        float k_scale
        float v_scale

    size_t kdtree_verify_workspace_size(int batch_size, int num_tokens, int num_heads)
    int kdtree_verify_launch(const kdtree_verify_params* params, void* stream)
    int kdtree_pack_tree_mask(const uint8_t* custom_mask, const int64_t* mask_indptr,
                              const void* qo_indptr, int qo_indptr_dtype, const int32_t* kv_indptr,
                              int batch_size, int num_tokens, uint64_t* out, int out_words,
                              void* stream)
    const char* kdtree_status_string(int status)
    const char* kdtree_compiled_archs()
    int kdtree_verify_split_kernel(int* kernel)
    int kdtree_verify_call_kernel(int batch_size, int num_tokens, int num_heads, int kv_dtype, int kv_scaled,
                                  int* kernel)


HEAD_DIM_NOPE = KDTREE_HEAD_DIM_NOPE
HEAD_DIM_PE = KDTREE_HEAD_DIM_PE
HEAD_DIM_QK = KDTREE_HEAD_DIM_QK
HEAD_DIM_V = KDTREE_HEAD_DIM_V
MAX_HEADS = KDTREE_MAX_HEADS
MAX_MASK_WORDS = KDTREE_MAX_MASK_WORDS
INDEX_INT32 = KDTREE_INDEX_INT32
INDEX_INT64 = KDTREE_INDEX_INT64
KV_BF16 = KDTREE_KV_BF16
KV_E4M3 = KDTREE_KV_E4M3


def status_string(status):
    """The library's message for a status code (0 ok, > 0 a cudaError_t, < 0 a kdtree code)."""
    return kdtree_status_string(_c_int(status, "status")).decode("utf-8", "replace")


def compiled_archs():
    """Compute capabilities this build carries machine code for, ascending: e.g. ``"90,120"``."""
    return kdtree_compiled_archs().decode("ascii")


_KERNEL_NAMES = {KDTREE_KERNEL_MMA_2STAGE: "mma.sync-2stage", KDTREE_KERNEL_MMA_3STAGE: "mma.sync-3stage",
                 KDTREE_KERNEL_MMA_32ROW: "mma.sync-2stage-32row", KDTREE_KERNEL_DUAL: "wgmma-dual",
                 KDTREE_KERNEL_SKINNY: "wgmma-skinny", KDTREE_KERNEL_MMA_FP8: "mma.sync-fp8",
                 KDTREE_KERNEL_MMA_SCALED: "mma.sync-scaled", KDTREE_KERNEL_DUAL_FP8: "wgmma-dual-fp8",
                 KDTREE_KERNEL_SKINNY_FP8: "wgmma-skinny-fp8", KDTREE_KERNEL_SKINNY_FP8_32ROW: "wgmma-skinny-fp8-32row"}


def split_kernel(batch_size=None, num_tokens=None, num_heads=None, kv_dtype=KDTREE_KV_BF16, kv_scaled=False):
    """The split kernel that runs on the current device: ``"wgmma-dual"`` or ``"wgmma-skinny"`` (sm_90a; the second
    only under KDTREE_SPLIT_KERNEL=skinny), ``"mma.sync-3stage"`` or ``"mma.sync-2stage"``. Given all three
    sizes, the kernel a call of that batch size, token count and head count runs (``"wgmma-skinny"`` where the device
    runs the dual kernel and no request can exceed 16 rows, ``"mma.sync-2stage-32row"`` where it runs the 2-stage
    kernel and no request can exceed 32 rows; for ``kv_dtype=KV_E4M3`` ``"wgmma-dual-fp8"`` where the device runs the
    dual kernel, ``"wgmma-skinny-fp8"`` where it would run ``"wgmma-skinny"`` on a bf16 pool,
    ``"wgmma-skinny-fp8-32row"`` where it runs the dual kernel and no request can exceed 32 rows, else
    ``"mma.sync-fp8"``; ``"mma.sync-scaled"`` for a bf16 pool with ``kv_scaled``: KV scales other
    than 1). Raises KdtreeError when no device is usable."""
    cdef int kernel = 0
    cdef int status
    sizes = (batch_size, num_tokens, num_heads)
    if all(v is None for v in sizes):
        status = kdtree_verify_split_kernel(&kernel)
    elif any(v is None for v in sizes):
        raise ValueError("split_kernel: give batch_size, num_tokens and num_heads together, or none of them")
    else:
        status = kdtree_verify_call_kernel(_c_int(batch_size, "batch_size"), _c_int(num_tokens, "num_tokens"),
                                           _c_int(num_heads, "num_heads"), _c_int(kv_dtype, "kv_dtype"),
                                           1 if kv_scaled else 0, &kernel)
    if status != 0:
        raise KdtreeError(status, "split_kernel")
    return _KERNEL_NAMES.get(kernel, str(kernel))


class KdtreeError(RuntimeError):
    """A non-zero status from the CUDA library; ``.status`` holds the code."""

    def __init__(self, status, context=""):
        self.status = int(status)
        self.context = context
        message = f"{status_string(self.status)} (status {self.status})"
        super().__init__(f"{context}: {message}" if context else message)

    def __reduce__(self):
        return (type(self), (self.status, self.context))


# ---- argument conversion: every failure names the argument ----

cdef object _int(object value, str name):
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


cdef int _c_int(object value, str name) except? -1:
    v = _int(value, name)
    if not -2**31 <= v < 2**31:
        raise OverflowError(f"{name} must fit in a C int, got {v}")
    return v


cdef int64_t _i64(object value, str name) except? -1:
    v = _int(value, name)
    if not -2**63 <= v < 2**63:
        raise OverflowError(f"{name} must fit in int64, got {v}")
    return v


cdef uintptr_t _ptr(object value, str name) except? 0:
    # A device address (data_ptr()), a stream handle or a byte count; 0 is allowed (NULL).
    v = _int(value, name)
    if not 0 <= v < 2**64:
        raise OverflowError(f"{name} must be an address or size in [0, 2**64), got {v}")
    return v


cdef float _f32(object value, str name) except? -1:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}") from None


# ---- entry points ----

def workspace_size(batch_size, num_tokens, num_heads):
    """Bytes of workspace :func:`launch` needs on the current device for these sizes.

    Raises KdtreeError when the library returns 0 (an invalid size, no usable CUDA device, a bad KDTREE_* switch).
    """
    cdef int b = _c_int(batch_size, "batch_size")
    cdef int t = _c_int(num_tokens, "num_tokens")
    cdef int h = _c_int(num_heads, "num_heads")
    cdef size_t nbytes
    cdef int kernel = 0
    with nogil:
        nbytes = kdtree_verify_workspace_size(b, t, h)
    if nbytes:
        return nbytes
    # 0 does not say why; name the argument when it is one the header range-checks.
    if b < 1:
        status = KDTREE_ERR_BATCH
    elif t < 1:
        status = KDTREE_ERR_NUM_TOKENS
    elif not 1 <= h <= KDTREE_MAX_HEADS:
        status = KDTREE_ERR_NUM_HEADS
    else:   # the library's reason for the device (no device, an environment switch, ...)
        status = kdtree_verify_split_kernel(&kernel) or KDTREE_ERR_NO_DEVICE
    raise KdtreeError(status, f"workspace_size(batch_size={b}, num_tokens={t}, num_heads={h}) returned 0")


def launch(*, q_nope, q_nope_stride_t, q_nope_stride_h, q_pe, q_pe_stride_t, q_pe_stride_h,
           kv_cache, kv_stride_s, num_slots, kv_indices, kv_indices_dtype, kv_indptr,
           k_new, k_new_stride_t, qo_indptr, qo_indptr_dtype, tree_mask, tree_mask_words,
           out, out_stride_t, out_stride_h, batch_size, num_tokens, num_heads, sm_scale,
           workspace, workspace_bytes, stream, reuse_plan=False, pack_custom_mask=0, pack_mask_indptr=0,
           kv_dtype=KDTREE_KV_BF16, k_scale=1.0, v_scale=1.0):
    """Run kdtree_verify_launch on ``stream`` (asynchronous; the GIL is released during the call).

    Shapes, dtypes and stride units are those of ``kdtree_verify_params`` in kdtree_verify.h.
    ``tree_mask=0`` means a causal chain. ``reuse_plan=True`` skips the plan kernel and runs on the
    plan the workspace holds from the previous call (same batch, tokens, heads and indptr values:
    the header says when that is safe). ``pack_custom_mask`` / ``pack_mask_indptr`` (SGLang's flat custom_mask and
    its int64 indptr): the call packs them into ``tree_mask`` itself, in its plan kernel. ``kv_dtype`` (KV_BF16 or
    KV_E4M3), ``k_scale``, ``v_scale``: the pool's element type and SGLang's k_descale / v_descale (prefix keys only).
    Raises KdtreeError on a non-zero status.
    """
    if not isinstance(reuse_plan, bool):
        raise TypeError(f"reuse_plan must be a bool, got {type(reuse_plan).__name__}")
    cdef kdtree_verify_params p
    p.q_nope = <const void*>_ptr(q_nope, "q_nope")
    p.q_nope_stride_t = _i64(q_nope_stride_t, "q_nope_stride_t")
    p.q_nope_stride_h = _i64(q_nope_stride_h, "q_nope_stride_h")
    p.q_pe = <const void*>_ptr(q_pe, "q_pe")
    p.q_pe_stride_t = _i64(q_pe_stride_t, "q_pe_stride_t")
    p.q_pe_stride_h = _i64(q_pe_stride_h, "q_pe_stride_h")
    p.kv_cache = <const void*>_ptr(kv_cache, "kv_cache")
    p.kv_stride_s = _i64(kv_stride_s, "kv_stride_s")
    p.num_slots = _i64(num_slots, "num_slots")
    p.kv_indices = <const void*>_ptr(kv_indices, "kv_indices")
    p.kv_indices_dtype = _c_int(kv_indices_dtype, "kv_indices_dtype")
    p.kv_indptr = <const int32_t*>_ptr(kv_indptr, "kv_indptr")
    p.k_new = <const void*>_ptr(k_new, "k_new")
    p.k_new_stride_t = _i64(k_new_stride_t, "k_new_stride_t")
    p.qo_indptr = <const void*>_ptr(qo_indptr, "qo_indptr")
    p.qo_indptr_dtype = _c_int(qo_indptr_dtype, "qo_indptr_dtype")
    p.tree_mask = <const uint64_t*>_ptr(tree_mask, "tree_mask")
    p.tree_mask_words = _c_int(tree_mask_words, "tree_mask_words")
    p.out = <void*>_ptr(out, "out")
    p.out_stride_t = _i64(out_stride_t, "out_stride_t")
    p.out_stride_h = _i64(out_stride_h, "out_stride_h")
    p.batch_size = _c_int(batch_size, "batch_size")
    p.num_tokens = _c_int(num_tokens, "num_tokens")
    p.num_heads = _c_int(num_heads, "num_heads")
    p.sm_scale = _f32(sm_scale, "sm_scale")
    p.workspace = <void*>_ptr(workspace, "workspace")
    p.workspace_bytes = _ptr(workspace_bytes, "workspace_bytes")
    p.reuse_plan = 1 if reuse_plan else 0
    p.pack_custom_mask = <const uint8_t*>_ptr(pack_custom_mask, "pack_custom_mask")
    p.pack_mask_indptr = <const int64_t*>_ptr(pack_mask_indptr, "pack_mask_indptr")
    p.kv_dtype = _c_int(kv_dtype, "kv_dtype")
    p.k_scale = _f32(k_scale, "k_scale")
    p.v_scale = _f32(v_scale, "v_scale")
    cdef void* c_stream = <void*>_ptr(stream, "stream")
    cdef int status
    with nogil:
        status = kdtree_verify_launch(&p, c_stream)
    if status != KDTREE_OK:
        raise KdtreeError(status, "kdtree_verify_launch")


def pack_tree_mask(*, custom_mask, mask_indptr, qo_indptr, qo_indptr_dtype, kv_indptr,
                   batch_size, num_tokens, out, out_words, stream):
    """Run kdtree_pack_tree_mask on ``stream``: SGLang's flat custom_mask -> [num_tokens, out_words]
    uint64 tree mask (no host sync). Raises KdtreeError on a non-zero status."""
    cdef const uint8_t* c_custom_mask = <const uint8_t*>_ptr(custom_mask, "custom_mask")
    cdef const int64_t* c_mask_indptr = <const int64_t*>_ptr(mask_indptr, "mask_indptr")
    cdef const void* c_qo_indptr = <const void*>_ptr(qo_indptr, "qo_indptr")
    cdef int c_qo_indptr_dtype = _c_int(qo_indptr_dtype, "qo_indptr_dtype")
    cdef const int32_t* c_kv_indptr = <const int32_t*>_ptr(kv_indptr, "kv_indptr")
    cdef int c_batch_size = _c_int(batch_size, "batch_size")
    cdef int c_num_tokens = _c_int(num_tokens, "num_tokens")
    cdef uint64_t* c_out = <uint64_t*>_ptr(out, "out")
    cdef int c_out_words = _c_int(out_words, "out_words")
    cdef void* c_stream = <void*>_ptr(stream, "stream")
    cdef int status
    with nogil:
        status = kdtree_pack_tree_mask(c_custom_mask, c_mask_indptr, c_qo_indptr, c_qo_indptr_dtype,
                                       c_kv_indptr, c_batch_size, c_num_tokens, c_out, c_out_words,
                                       c_stream)
    if status != KDTREE_OK:
        raise KdtreeError(status, "kdtree_pack_tree_mask")
