"""kdtree: paged tree-verify attention for MLA speculative decoding (SGLang TARGET_VERIFY).

Public API::

    kdtree.verify_attention(q_nope, q_pe, kv_cache, kv_indptr, kv_indices, qo_indptr, k_new,
                            tree_mask, sm_scale, *, out=None, workspace=None, reuse_plan=False)
    kdtree.Workspace()                                        # a caller's own grow-only scratch
    kdtree.verify_attention_mla(q, k, key_buffer, ...)        # SGLang's unsplit tensors
    kdtree.verify_attention_reference(...)                    # plain torch, float32/float64
    kdtree.split_mla_q(q), kdtree.kv_cache_2d(key_buffer)     # views
    kdtree.build_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_tokens, max_n)
    kdtree.KdtreeError                                        # kernel status errors

Importing kdtree needs only torch: the compiled extension (kdtree._verify) is loaded on the first
CUDA call, SGLang is never imported here, and no GPU is required (CPU tensors use the reference).
"""

import logging

from .layout import build_tree_mask, kv_cache_2d, split_mla_q
from .ops import Workspace, verify_attention, verify_attention_mla
from .reference import verify_attention_reference

__version__ = "0.1.0"

logger = logging.getLogger(__name__)

__all__ = [
    "__version__",
    "Workspace",
    "verify_attention",
    "verify_attention_mla",
    "verify_attention_reference",
    "split_mla_q",
    "kv_cache_2d",
    "build_tree_mask",
    "KdtreeError",
]


def __getattr__(name):
    # KdtreeError lives in the compiled extension; resolve it only when asked for, so that
    # `import kdtree` works without a build (then a never-raised stand-in class is returned).
    if name == "KdtreeError":
        from . import _ext

        return _ext.kdtree_error_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
