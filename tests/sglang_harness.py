"""Build SGLang's real ``TritonAttnBackend`` around a real ``MLATokenToKVPool`` for one
TARGET_VERIFY ``forward_extend`` call, without a ModelRunner (shared by the CPU and GPU tests).

Nothing here re-implements SGLang: the backend object is the installed class, created with
``object.__new__`` and given exactly the attributes ``forward_extend`` reads (SGLANG.md,
"Running real SGLang without a full install"); the pool and the layer are the installed
``MLATokenToKVPool`` and ``RadixAttention``; the metadata is the installed ``ForwardMetadata``.
Only the forward batch is a ``SimpleNamespace`` carrying the fields ``forward_extend`` touches.

A case is laid out like a real verify step at page size 1:
  * slot 0 is SGLang's dummy slot; every slot no request owns holds NaN (a kernel that reads a
    slot it must not read turns the output into NaN, and NaN never passes);
  * the prefix slots of all requests are a random permutation of free slots (not in order);
  * the draft tokens' slots (``out_cache_loc``) are further distinct free slots, still NaN
    before the call: the call itself must write them;
  * the custom mask, when present, is SGLang's flat byte layout: per request an
    ``N x (P + N)`` row-major block at ``mask_indptr[b]``; the prefix columns hold random bytes
    (``skip_prefix_custom_mask=True`` never reads them), the ``N x N`` block is a random tree
    (every node sees itself and its ancestors), and ``pad`` trailing nodes are all-False rows
    (DDTree's unused budget).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import types
from typing import List, Optional, Sequence

import torch

from kdtree.synthetic import random_tree_visibility

from sglang_env import import_sglang

KV_LORA_RANK = 512
QK_ROPE_DIM = 64
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_DIM
#: DeepSeek's softmax scale without yarn mscale: deliberately not 576 ** -0.5, so a patch that
#: recomputes the scale from the head dim instead of taking ``layer.scaling`` fails.
DEFAULT_SCALING = 192 ** -0.5


def patch_triton_interpreter_bf16_dot() -> bool:
    """Make ``tl.dot`` on bfloat16 operands correct under ``TRITON_INTERPRET=1`` (CPU only).

    Triton's interpreter stores bfloat16 as uint16 bit patterns and its ``create_dot`` converts only
    8-bit float operands before ``np.matmul``, so a bf16 ``tl.dot`` multiplies the raw bit patterns
    (results around 1e9; triton-lang/triton#11584, "not supported yet"). SGLang's extend kernel
    does ``tl.dot`` on the bf16 q/k/v tiles, so without this every bf16 call of the real
    ``forward_extend`` returns garbage on CPU. The fix widens bf16 operands to float32 exactly
    (bf16 is the top half of a float32) before the interpreter's own matmul, which is what the GPU
    does (bf16 products, float32 accumulation). Returns True when the patch is (now) in place.
    Test infrastructure only: it touches the interpreter, never SGLang, and never runs on a GPU.
    """
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        return False
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_kdtree_bf16_fix", False):
        return True
    original = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16 if hasattr(handle.dtype, "scalar") else handle.dtype == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << np.uint32(16)
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._kdtree_bf16_fix = True
    builder.create_dot = create_dot
    return True


patch_triton_interpreter_bf16_dot()


@dataclasses.dataclass
class VerifyCase:
    """One verify call's inputs, plus what the tests need to check the result."""

    sg: types.SimpleNamespace
    backend: object                 # TritonAttnBackend (real class)
    pool: object                    # MLATokenToKVPool (real class)
    layer: object                   # RadixAttention (real class)
    forward_batch: types.SimpleNamespace
    q: torch.Tensor                 # [T, H, 576]
    k: torch.Tensor                 # [T, 1, 576]
    v: torch.Tensor                 # [T, 1, 512] (= k[..., :512])
    prefix_lens: List[int]
    n: int                          # verify tokens per request
    tree: Optional[List[torch.Tensor]]   # per request [N, N] bool visibility, None = causal chain
    out_cache_loc: torch.Tensor     # [T] int64 slots the call writes

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    def args(self):
        """Positional arguments of ``forward_extend`` after ``self``."""
        return (self.q, self.k, self.v, self.layer, self.forward_batch)

    def key_buffer(self) -> torch.Tensor:
        """The layer's key buffer, ``[S, 1, 576]``."""
        return self.pool.get_key_buffer(self.layer.layer_id)

    def snapshot_pool(self) -> torch.Tensor:
        return self.key_buffer().clone()

    def call(self, *extra, **kwargs) -> torch.Tensor:
        """``backend.forward_extend(q, k, v, layer, forward_batch, *extra, **kwargs)`` under the
        parallel context SGLang's ModelRunner would have set (no DCP)."""
        with parallel_context(self.sg):
            return self.backend.forward_extend(*self.args(), *extra, **kwargs)


@contextlib.contextmanager
def parallel_context(sg):
    """``get_parallel().override(dcp_enabled=False)``: MLATokenToKVPool.set_kv_buffer asserts
    on the DCP flag, which a ModelRunner would have published."""
    with sg.runtime_context.get_parallel().override(dcp_enabled=False):
        yield


def random_tree(n: int, pad: int, generator: torch.Generator) -> torch.Tensor:
    """``[n, n]`` bool visibility of a random draft tree (node 0 the root, parents before children,
    a node sees itself and its ancestors); the last ``pad`` rows are all False (DDTree padding)."""
    assert n - pad >= 1
    return random_tree_visibility(n, "tree", generator, pad=pad)


def make_backend(sg, pool, *, device, is_draft_runner=False, use_mla=True, enable_deterministic=False):
    """The real TritonAttnBackend class, built without a ModelRunner."""
    cls = sg.triton_backend.TritonAttnBackend
    backend = object.__new__(cls)
    attrs = dict(
        token_to_kv_pool=pool,
        use_mla=use_mla,
        dcp_size=1,
        dcp_rank=0,
        enable_deterministic=enable_deterministic,
        use_verify_shared_kv=False,
        use_verify_splitkv=False,
        page_size=1,
        dllm_attention=None,
        extend_attention_fwd=sg.extend_attention_fwd,
        allow_bidirectional_attention_in_extend=False,
        use_dense_fp8_chunked_prefill=False,
        is_draft_runner=is_draft_runner,
        device=torch.device(device),
        sliding_window_size=None,
        forward_metadata=None,
    )
    for name, value in attrs.items():
        setattr(backend, name, value)
    return backend


def build_case(
    *,
    batch: int = 1,
    heads: int = 2,
    n: int = 4,
    prefix_lens: Optional[Sequence[int]] = None,
    mask: str = "tree",
    pad: int = 0,
    device="cpu",
    seed: int = 0,
    layer_num: int = 1,
    layer_id: int = 0,
    kv_dtype: torch.dtype = torch.bfloat16,
    qo_indptr_dtype: torch.dtype = torch.int32,
    forward_mode: str = "TARGET_VERIFY",
    is_draft_runner: bool = False,
    use_mla: bool = True,
    scaling: float = DEFAULT_SCALING,
    attn_output: bool = False,
    graph_layout: bool = False,
    spare_slots: int = 7,
) -> VerifyCase:
    """A TARGET_VERIFY call of ``batch`` requests with ``n`` verify tokens each.

    ``mask``: "tree" (random tree per request, SGLang's flat byte mask), "none" (custom_mask None:
    DFlash's causal chain), "uint8" (the tree mask as uint8, as the CUDA-graph buffer holds it).
    ``pad``: trailing all-False rows per request (DDTree padding; needs ``mask != "none"``).
    ``attn_output``: pass a preallocated output as ``forward_batch._attn_output``.
    ``graph_layout``: the metadata as CUDA-graph replay holds it (SGLANG.md): qo_indptr int64, the
    mask a uint8 buffer much longer than ``mask_indptr[B]`` (tail all ones), ``kv_indices`` a
    buffer longer than ``kv_indptr[B]`` whose tail names NaN slots. Only what the indptrs delimit
    may be read.
    """
    sg = import_sglang()
    g = torch.Generator().manual_seed(seed)
    if prefix_lens is None:
        prefix_lens = [int(torch.randint(1, 24, (1,), generator=g)) for _ in range(batch)]
    prefix_lens = [int(p) for p in prefix_lens]
    assert len(prefix_lens) == batch
    assert mask in ("tree", "none", "uint8")
    if graph_layout:
        qo_indptr_dtype = torch.int64
        mask = "uint8" if mask == "tree" else mask
    assert pad == 0 or mask != "none"
    T = batch * n
    live_slots = sum(prefix_lens) + T
    size = live_slots + spare_slots           # slots [1, size] usable, 0 is the dummy

    pool = sg.memory_pool.MLATokenToKVPool(
        size, page_size=1, dtype=kv_dtype, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_DIM,
        layer_num=layer_num, device=str(device), enable_memory_saver=False,
    )
    # every slot NaN first: nothing may read a slot the metadata does not name
    for lid in range(layer_num):
        buf = pool.get_key_buffer(lid)
        if kv_dtype == torch.bfloat16 or kv_dtype == torch.float16 or kv_dtype == torch.float32:
            buf.fill_(float("nan"))

    perm = (torch.randperm(size, generator=g) + 1).tolist()
    prefix_slots, pos = [], 0
    for p in prefix_lens:
        prefix_slots.append(perm[pos:pos + p])
        pos += p
    out_slots = perm[pos:pos + T]

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale)

    for lid in range(layer_num):
        buf = pool.get_key_buffer(lid)
        for slots in prefix_slots:
            if slots:
                idx = torch.tensor(slots, dtype=torch.int64)
                buf[idx.to(buf.device)] = rand(len(slots), 1, QK_HEAD_DIM).to(buf.dtype).to(buf.device)

    q = rand(T, heads, QK_HEAD_DIM, scale=2.0).to(torch.bfloat16).to(device)
    k = rand(T, 1, QK_HEAD_DIM).to(torch.bfloat16).to(device)
    v = k[..., :KV_LORA_RANK].clone()

    kv_indptr = torch.tensor([0] + list(_cumsum(prefix_lens)), dtype=torch.int32, device=device)
    flat_slots = [s for slots in prefix_slots for s in slots]
    if graph_layout:
        nan_slots = perm[pos + T:] or [0]
        flat_slots += [nan_slots[i % len(nan_slots)] for i in range(3 * len(flat_slots) + 64)]
    kv_indices = torch.tensor(flat_slots, dtype=torch.int64, device=device)
    qo_indptr = torch.arange(0, (batch + 1) * n, n, dtype=qo_indptr_dtype, device=device)

    tree = None
    custom_mask = None
    mask_indptr = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    if mask != "none":
        tree, blocks = [], []
        for p in prefix_lens:
            vis = random_tree(n, pad, g)
            block = torch.zeros(n, p + n, dtype=torch.bool)
            block[:, :p] = torch.rand(n, p, generator=g) < 0.5     # never read
            block[:, p:] = vis
            if pad:
                block[n - pad:, :] = False                        # DDTree: all-False rows
            tree.append(vis)
            blocks.append(block.reshape(-1))
        flat = torch.cat(blocks)
        if graph_layout:
            flat = torch.cat([flat, torch.ones(2 * flat.numel() + 64, dtype=torch.bool)])
        custom_mask = (flat.to(torch.uint8) if mask == "uint8" else flat).to(device)
        mask_indptr[1:] = torch.tensor(list(_cumsum([n * (p + n) for p in prefix_lens])), dtype=torch.int64)

    mode = getattr(sg.forward_batch_info.ForwardMode, forward_mode)
    metadata = sg.triton_backend.ForwardMetadata(
        attn_logits=None, attn_lse=None, max_extend_len=n, num_kv_splits=None,
        kv_indptr=kv_indptr, kv_indices=kv_indices, qo_indptr=qo_indptr,
        custom_mask=custom_mask, mask_indptr=mask_indptr,
        window_kv_indptr=None, window_kv_indices=None, window_num_kv_splits=None,
        window_kv_offsets=None,
    )
    backend = make_backend(sg, pool, device=device, is_draft_runner=is_draft_runner, use_mla=use_mla)
    backend.forward_metadata = metadata

    layer = sg.radix_attention.RadixAttention(heads, QK_HEAD_DIM, scaling, 1, layer_id,
                                              v_head_dim=KV_LORA_RANK)
    out_cache_loc = torch.tensor(out_slots, dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(p, p + n) for p in prefix_lens]).to(device)
    fb = types.SimpleNamespace(
        forward_mode=mode,
        out_cache_loc=out_cache_loc,
        out_cache_loc_is_physical=True,
        mha_one_shot=False,
        attn_attend_prefix_cache=None,
        extend_seq_lens_cpu=[n] * batch,
        mha_return_lse=False,
        positions=positions,
        batch_size=batch,
    )
    if attn_output:
        fb._attn_output = torch.full((T, heads * KV_LORA_RANK), float("nan"), dtype=torch.bfloat16, device=device)
    return VerifyCase(sg=sg, backend=backend, pool=pool, layer=layer, forward_batch=fb, q=q, k=k, v=v,
                      prefix_lens=prefix_lens, n=n, tree=tree, out_cache_loc=out_cache_loc)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def reference_output(case: VerifyCase, dtype=torch.float64) -> torch.Tensor:
    """``[T, H * 512]`` from SGLANG.md's rules, written out independently of kdtree and of
    SGLang: prefix keys always visible, draft key j visible iff tree[i, j] (or j <= i without a
    mask), rows that see nothing are 0. Reads the prefix rows from the pool, drafts from ``k``."""
    kb = case.key_buffer().reshape(-1, QK_HEAD_DIM).to("cpu", dtype)
    md = case.backend.forward_metadata
    kv_indices = md.kv_indices.to("cpu")
    q = case.q.to("cpu", dtype)
    kn = case.k.reshape(-1, QK_HEAD_DIM).to("cpu", dtype)
    H = case.num_heads
    out = torch.zeros(case.num_tokens, H, KV_LORA_RANK, dtype=dtype)
    start_kv = 0
    for b, p in enumerate(case.prefix_lens):
        t0 = b * case.n
        prefix = kb[kv_indices[start_kv:start_kv + p]]
        start_kv += p
        drafts = kn[t0:t0 + case.n]
        keys = torch.cat([prefix, drafts])                              # [P + N, 576]
        scores = torch.einsum("thd,sd->ths", q[t0:t0 + case.n], keys) * case.layer.scaling
        if case.tree is None:
            vis = torch.tril(torch.ones(case.n, case.n, dtype=torch.bool))
        else:
            vis = case.tree[b]
        allowed = torch.cat([torch.ones(case.n, p, dtype=torch.bool), vis], dim=1)   # [N, P + N]
        scores = scores.masked_fill(~allowed[:, None, :], -math.inf)
        any_visible = allowed.any(dim=1)
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(any_visible[:, None, None], probs, torch.zeros_like(probs))
        out[t0:t0 + case.n] = torch.einsum("ths,sd->thd", probs, keys[:, :KV_LORA_RANK])
    return out.reshape(case.num_tokens, H * KV_LORA_RANK)


def assert_close_bf16(actual: torch.Tensor, expected: torch.Tensor, *, atol=2e-2, rtol=2e-2, what="output"):
    """bf16-level closeness: ``|a - e| <= atol + rtol * |e|`` everywhere, NaN/inf never pass."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(e).all(), f"{what}: the expected values are not finite"
    bad_nonfinite = ~torch.isfinite(a)
    assert not bad_nonfinite.any(), f"{what}: {int(bad_nonfinite.sum())} non-finite values"
    err = (a - e).abs()
    tol = atol + rtol * e.abs()
    worst = int(torch.argmax(err - tol))
    assert bool((err <= tol).all()), (
        f"{what}: max abs err {float(err.max()):.3e} (tolerance {atol} + {rtol}*|ref|), worst flat index "
        f"{worst}: got {float(a.reshape(-1)[worst])}, expected {float(e.reshape(-1)[worst])}")
