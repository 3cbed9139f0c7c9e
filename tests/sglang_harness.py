"""Build SGLang's real ``TritonAttnBackend`` around a real MLA KV pool for one TARGET_VERIFY
``forward_extend`` call, without a ModelRunner (shared by the CPU and GPU tests).

Nothing here re-implements SGLang: the backend object is the installed class, created with
``object.__new__`` and given exactly the attributes its methods read (SGLANG.md, "Running real
SGLang without a full install"); the pool is the installed ``MLATokenToKVPool`` or
``DSATokenToKVPool`` (built with the arguments SGLang's KV-cache configurator passes), the layer
the installed ``RadixAttention``, the metadata the installed ``ForwardMetadata``. Only the forward
batch and the speculative input are ``SimpleNamespace`` objects carrying the fields SGLang reads.

The metadata comes from one of two places (``metadata=``):
  * ``"manual"``: written here from the layout below, as SGLANG.md describes it;
  * ``"sglang"``: built by the backend itself from a ``req_to_token`` table through SGLang's
    ``KVIndexTranslator`` and ``KVLocPlan``: ``init_forward_metadata`` (eager), or with
    ``graph_layout`` ``init_forward_metadata_out_graph(in_capture=True)`` into the CUDA-graph
    buffers (``init_cuda_graph_state``'s buffers, pre-filled with stale values), which
    :meth:`VerifyCase.advance` refreshes the way a graph replay's preparation does.

A case is laid out like a real verify step at any page size P:
  * page 0 (slots ``[0, P)``) is SGLang's padding page; every slot no request owns holds NaN (a
    kernel that reads a slot it must not read turns the output into NaN, and NaN never passes);
  * each request owns whole pages, a random choice of the pool's pages in random order; token
    position t of a request sits in slot ``page[t // P] * P + t % P`` (its ``req_to_token`` row);
  * the draft tokens' slots (``out_cache_loc``) are the positions after the prefix, in the same
    pages (the last prefix page continues), still NaN before the call: the call must write them;
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
from typing import Dict, List, Optional, Sequence

import torch

from kdtree.synthetic import random_tree_visibility

from sglang_env import import_sglang

KV_LORA_RANK = 512
QK_ROPE_DIM = 64
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_DIM
#: DeepSeek's softmax scale without yarn mscale: deliberately not 576 ** -0.5, so a patch that
#: recomputes the scale from the head dim instead of taking ``layer.scaling`` fails.
DEFAULT_SCALING = 192 ** -0.5
#: pool kinds: "mla" = MLATokenToKVPool (DeepSeek V2/V3/R1), "dsa" = DSATokenToKVPool (GLM-5.x,
#: DeepSeek-V3.2: ``index_topk`` set)
POOL_KINDS = ("mla", "dsa")
#: the DSA indexer's key width (GLM-5 and DeepSeek-V3.2; DSATokenToKVPool asserts it)
DSA_INDEX_HEAD_DIM = 128
#: DSATokenToKVPool's physical page size on CUDA (it asserts it; SGLang forces --page-size 64)
DSA_PAGE_SIZE = 64


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
    pool: object                    # MLATokenToKVPool / DSATokenToKVPool (real class)
    layer: object                   # RadixAttention (real class)
    forward_batch: types.SimpleNamespace
    q: torch.Tensor                 # [T, H, 576]
    k: torch.Tensor                 # [T, 1, 576]
    v: torch.Tensor                 # [T, 1, 512] (= k[..., :512])
    prefix_lens: List[int]
    n: int                          # verify tokens per request
    tree: Optional[List[torch.Tensor]]   # per request [N, N] bool visibility, None = causal chain
    out_cache_loc: torch.Tensor     # [T] int64 slots the call writes
    page_size: int = 1
    metadata: str = "manual"        # who built forward_metadata: "manual" or "sglang"
    graph_layout: bool = False
    slot_rows: Optional[List[torch.Tensor]] = None   # per request: slot of each token position
    generator: Optional[torch.Generator] = None

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

    def pool_buffers(self) -> Dict[str, torch.Tensor]:
        """Every tensor the pool holds, by attribute path (see :func:`pool_tensors`)."""
        return pool_tensors(self.pool)

    def call(self, *extra, **kwargs) -> torch.Tensor:
        """``backend.forward_extend(q, k, v, layer, forward_batch, *extra, **kwargs)`` under the
        parallel context SGLang's ModelRunner would have set (no DCP)."""
        with parallel_context(self.sg):
            return self.backend.forward_extend(*self.args(), *extra, **kwargs)

    def advance(self, accepted: Sequence[int], seed: int) -> None:
        """The next verify step of the same requests: request b commits the first ``accepted[b]``
        draft tokens of this step (their KV rows, written by this step's call, join its prefix),
        the next ``n`` positions become the new drafts, with fresh ``q``/``k`` and draft trees.

        Everything changes in place, as between two CUDA-graph replays: the forward batch's
        ``seq_lens``, ``out_cache_loc`` and ``positions`` tensors, ``q``/``k``/``v``, and with
        ``metadata="sglang"`` the metadata, which the backend rebuilds (eager) or refills into the
        captured buffers (``graph_layout``: ``init_forward_metadata_out_graph(in_capture=False)``,
        SGLang's replay preparation). Needs ``metadata="sglang"`` and ``reserve`` room.
        """
        if self.metadata != "sglang":
            raise ValueError("advance needs metadata='sglang' (the backend rebuilds the metadata)")
        if len(accepted) != len(self.prefix_lens):
            raise ValueError(f"accepted has {len(accepted)} entries for {len(self.prefix_lens)} requests")
        fb, n, g = self.forward_batch, self.n, self.generator
        new_lens = [p + int(a) for p, a in zip(self.prefix_lens, accepted)]
        for b, (p, a) in enumerate(zip(new_lens, accepted)):
            if not 0 <= int(a) <= n or p + n > self.slot_rows[b].numel():
                raise ValueError(f"request {b}: accepting {a} leaves no reserved slots for the next "
                                 f"{n} drafts (row of {self.slot_rows[b].numel()} positions)")
        self.prefix_lens = new_lens
        out = torch.cat([row[p:p + n] for row, p in zip(self.slot_rows, new_lens)])
        self.out_cache_loc.copy_(out.to(self.out_cache_loc.device))
        fb.positions.copy_(torch.cat([torch.arange(p, p + n) for p in new_lens]).to(fb.positions.device))
        fb.seq_lens.copy_(torch.tensor(new_lens, dtype=fb.seq_lens.dtype))
        fb.seq_lens_cpu = torch.tensor(new_lens, dtype=torch.int64)
        fb.seq_lens_sum = sum(new_lens)
        self.q.copy_(torch.randn(self.q.shape, generator=g) * 2)
        self.k.copy_(torch.randn(self.k.shape, generator=g))
        self.v.copy_(self.k[..., :KV_LORA_RANK])
        if self.tree is not None:
            pad = int((~self.tree[0].any(dim=1)).sum())
            self.tree, flat = _random_tree_mask(new_lens, n, pad, g)
            fb.spec_info.custom_mask = flat.to(self.q.device)
        self.backend.kv_index_translator.bind_own_plan(fb)
        if self.graph_layout:
            self.backend.init_forward_metadata_out_graph(fb, in_capture=False)
        else:
            self.backend.init_forward_metadata(fb)


@contextlib.contextmanager
def parallel_context(sg):
    """``get_parallel().override(dcp_enabled=False, attn_dcp_size=1)``: the MLA pools assert on
    the DCP flag and the DSA pool sizes its index cache by the DCP width, both of which a
    ModelRunner would have published."""
    with sg.runtime_context.get_parallel().override(dcp_enabled=False, attn_dcp_size=1):
        yield


def pool_tensors(pool) -> Dict[str, torch.Tensor]:
    """Every tensor reachable from the pool's attributes (through lists, tuples, dicts and SGLang
    helper objects such as the DSA pool's ``IndexKeyCache``), keyed by attribute path: the latent
    KV of every layer, the DSA index keys and scales, compression tails, scale buffers."""
    found: Dict[str, torch.Tensor] = {}
    seen = {id(pool)}

    def walk(obj, path, depth):
        if isinstance(obj, torch.Tensor):
            found.setdefault(path, obj)
            return
        if depth > 4 or id(obj) in seen:
            return
        if isinstance(obj, (list, tuple)):
            seen.add(id(obj))
            for i, item in enumerate(obj):
                walk(item, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            seen.add(id(obj))
            for key, item in obj.items():
                walk(item, f"{path}[{key!r}]", depth + 1)
        elif type(obj).__module__.startswith("sglang.") and hasattr(obj, "__dict__"):
            seen.add(id(obj))
            for key, item in vars(obj).items():
                walk(item, f"{path}.{key}", depth + 1)

    for key, value in vars(pool).items():
        walk(value, key, 0)
    return found


def random_tree(n: int, pad: int, generator: torch.Generator) -> torch.Tensor:
    """``[n, n]`` bool visibility of a random draft tree (node 0 the root, parents before children,
    a node sees itself and its ancestors); the last ``pad`` rows are all False (DDTree padding)."""
    assert n - pad >= 1
    return random_tree_visibility(n, "tree", generator, pad=pad)


def _random_tree_mask(prefix_lens, n, pad, g):
    """Per request a random tree and SGLang's flat bool mask of all requests (prefix columns random:
    never read; padding rows all False, prefix columns too)."""
    trees, blocks = [], []
    for p in prefix_lens:
        vis = random_tree(n, pad, g)
        block = torch.zeros(n, p + n, dtype=torch.bool)
        block[:, :p] = torch.rand(n, p, generator=g) < 0.5     # never read
        block[:, p:] = vis
        if pad:
            block[n - pad:, :] = False                        # DDTree: all-False rows
        trees.append(vis)
        blocks.append(block.reshape(-1))
    return trees, torch.cat(blocks)


def make_backend(sg, pool, *, device, is_draft_runner=False, use_mla=True, enable_deterministic=False,
                 page_size=1):
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
        page_size=page_size,
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


def _attach_metadata_builders(sg, backend, *, req_to_token, page_size, n, max_bs, device, graph_layout,
                              stale_slots: List[int], stale_indices: int):
    """Give the backend what its own metadata builders read, as ``TritonAttnBackend.__init__`` and
    ``init_cuda_graph_state`` set it up (SGLANG.md): the indptr buffers, the ``KVIndexTranslator``
    over ``req_to_token`` (a plain pool: reads stay token slots) and, for ``graph_layout``, the
    graph's kv-indices buffer and verify-mask buffer, filled with stale values (slot ids of NaN
    slots, mask bytes 1) as a buffer holds after earlier, longer batches."""
    try:
        from sglang.srt.layers.attention.verify_mask import VerifyMask, tree_mask_numel
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.speculative.eagle_utils import TreeMaskMode
    except ModuleNotFoundError as e:   # the device bundle's file list lacks these (SGLANG.md)
        raise ModuleNotFoundError(f"{e}: on a GPU machine, complete the SGLang device bundle with "
                                  "`python tools/sglang_bundle_extras.py` before carrying it") from e

    dev = torch.device(device)
    backend.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
    backend.qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=dev)
    backend.mask_indptr = torch.zeros(max_bs + 1, dtype=torch.int64, device=dev)
    backend.window_kv_indptr = None
    backend.use_sliding_window_kv_pool = False
    backend.max_context_len = req_to_token.shape[1]
    backend.target_verify_num_tokens_per_req = n
    backend.num_draft_tokens = n
    backend.skip_prefill = False
    backend.req_to_token = req_to_token
    backend._verify_mask = None
    backend._dense_one_shot_kv_indptr = None
    backend.kv_index_translator = KVIndexTranslator(
        req_to_token=req_to_token, token_to_kv_pool_allocator=None, token_to_kv_pool=backend.token_to_kv_pool,
        page_size=page_size, device=str(dev))
    if graph_layout:
        stale = torch.tensor(stale_slots or [0], dtype=torch.int64)
        backend.cuda_graph_kv_indices = stale[torch.arange(stale_indices) % stale.numel()].to(dev)
        mode = TreeMaskMode.FULL_MASK    # the GPU layout: per request N x (P + N)
        backend._verify_mask = VerifyMask(
            buffer=torch.ones(tree_mask_numel(mode, max_bs, n, req_to_token.shape[1]), dtype=torch.uint8, device=dev),
            mode=mode, max_bs=max_bs)


def make_pool(sg, kind: str, *, size: int, page_size: int, kv_dtype: torch.dtype, layer_num: int, device,
              max_running_requests: int, num_draft_tokens: int, kv_cache_dim: Optional[int] = None):
    """The KV pool SGLang's KV-cache configurator builds for a model of this kind:
    ``MLATokenToKVPool`` with ``_build_mla_kv_pool``'s arguments, or ``DSATokenToKVPool`` with
    ``_build_dsa_kv_pool``'s for a GLM-5-like config (kv_lora_rank 512, rope 64, index_head_dim
    128, index_kpool 1, no kpool compression, ``tail_extra_slots`` = the draft tokens).
    ``kv_cache_dim`` is ``calculate_mla_kv_cache_dim``'s answer: 576 (bf16, or FP8 in the TRTLLM
    layout) or 656 (the packed FP8 row); default 576."""
    if kind not in POOL_KINDS:
        raise ValueError(f"pool kind must be one of {POOL_KINDS}, got {kind!r}")
    common = dict(page_size=page_size, dtype=kv_dtype, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=QK_ROPE_DIM,
                  layer_num=layer_num, device=str(device), enable_memory_saver=False, start_layer=0,
                  end_layer=layer_num)     # the configurator passes ModelLayerInfo's exclusive end
    with parallel_context(sg):
        if kind == "mla":
            if kv_cache_dim not in (None, QK_HEAD_DIM):
                raise ValueError("an MLATokenToKVPool row is always 576 values")
            return sg.memory_pool.MLATokenToKVPool(size, **common)
        return sg.memory_pool.DSATokenToKVPool(
            size, kv_cache_dim=QK_HEAD_DIM if kv_cache_dim is None else kv_cache_dim,
            index_head_dim=DSA_INDEX_HEAD_DIM, index_kpool=1, index_kpool_compress=False,
            tail_extra_slots=num_draft_tokens, max_running_requests=max_running_requests, **common)


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
    pool_kind: str = "mla",
    page_size: Optional[int] = None,
    metadata: str = "manual",
    reserve: int = 0,
    kv_cache_dim: Optional[int] = None,
    kv_scales: Optional[Sequence[float]] = None,
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
    ``pool_kind``: "mla" or "dsa" (:func:`make_pool`); ``page_size``: the pool's page size
    (default 1, and 64 for "dsa", the only size DSATokenToKVPool takes); ``kv_cache_dim``: the DSA
    pool's row width (656: the packed FP8 row). ``kv_scales``: (k, v) set as the layer's KV scales (``k_scale`` /
    ``v_scale`` tensors and their ``*_float`` values), as a checkpoint with KV scales leaves them.
    ``metadata``: "manual" or "sglang" (module docstring); ``reserve``: further token positions
    each request owns past its drafts, for :meth:`VerifyCase.advance`.
    """
    sg = import_sglang()
    g = torch.Generator().manual_seed(seed)
    if page_size is None:
        page_size = DSA_PAGE_SIZE if pool_kind == "dsa" else 1
    if prefix_lens is None:
        prefix_lens = [int(torch.randint(1, 24, (1,), generator=g)) for _ in range(batch)]
    prefix_lens = [int(p) for p in prefix_lens]
    assert len(prefix_lens) == batch
    assert mask in ("tree", "none", "uint8")
    assert metadata in ("manual", "sglang")
    assert page_size >= 1 and reserve >= 0
    if metadata == "sglang":
        assert forward_mode == "TARGET_VERIFY", "the backend builds verify metadata only for TARGET_VERIFY"
    elif reserve:
        raise ValueError("reserve needs metadata='sglang' (advance rebuilds the metadata through SGLang)")
    if graph_layout:
        qo_indptr_dtype = torch.int64
        mask = "uint8" if mask == "tree" else mask
    assert pad == 0 or mask != "none"
    T = batch * n

    # whole pages per request, a random choice of the pool's pages in random order (page 0: padding)
    need = [-(-(p + n + reserve) // page_size) for p in prefix_lens]
    num_pages = sum(need) + max(1, -(-spare_slots // page_size))
    size = num_pages * page_size                   # slots [page_size, size + page_size) usable
    page_perm = torch.randperm(num_pages, generator=g) + 1
    slot_rows, at = [], 0
    for p, k in zip(prefix_lens, need):
        pages = page_perm[at:at + k]
        at += k
        t = torch.arange(p + n + reserve)
        slot_rows.append(pages[t // page_size] * page_size + t % page_size)
    owned = torch.cat([row for row in slot_rows])
    free = torch.ones(size + page_size, dtype=torch.bool)
    free[owned] = False
    nan_slots = free.nonzero().flatten().tolist()  # page 0 included: never a prefix slot

    pool = make_pool(sg, pool_kind, size=size, page_size=page_size, kv_dtype=kv_dtype, layer_num=layer_num,
                     device=device, max_running_requests=batch + 3, num_draft_tokens=n, kv_cache_dim=kv_cache_dim)
    floating = kv_dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)   # (e4m3 NaN: 0x7f)
    for lid in range(layer_num):
        buf = pool.get_key_buffer(lid)
        if floating:
            buf.fill_(float("nan"))          # nothing may read a slot the metadata does not name
    for path, t in pool_tensors(pool).items():
        if t.dtype == torch.uint8 and "index" in path:   # DSA index keys + scales: random bytes
            t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8).to(t.device))

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale)

    for lid in range(layer_num):
        buf = pool.get_key_buffer(lid)
        for row, p in zip(slot_rows, prefix_lens):
            if p:
                buf[row[:p].to(buf.device)] = rand(p, 1, buf.shape[-1]).to(buf.dtype).to(buf.device)

    q = rand(T, heads, QK_HEAD_DIM, scale=2.0).to(torch.bfloat16).to(device)
    k = rand(T, 1, QK_HEAD_DIM).to(torch.bfloat16).to(device)
    v = k[..., :KV_LORA_RANK].clone()

    tree, flat = None, None
    if mask != "none":
        tree, flat = _random_tree_mask(prefix_lens, n, pad, g)

    mode = getattr(sg.forward_batch_info.ForwardMode, forward_mode)
    backend = make_backend(sg, pool, device=device, is_draft_runner=is_draft_runner, use_mla=use_mla,
                           page_size=page_size)
    layer = sg.radix_attention.RadixAttention(heads, QK_HEAD_DIM, scaling, 1, layer_id,
                                              v_head_dim=KV_LORA_RANK)
    if kv_scales is not None:
        layer.k_scale, layer.v_scale = (torch.tensor(float(x), device=device) for x in kv_scales)
        layer.k_scale_float, layer.v_scale_float = (float(x) for x in kv_scales)
    out_cache_loc = torch.cat([row[p:p + n] for row, p in zip(slot_rows, prefix_lens)]).to(device)
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

    if metadata == "manual":
        kv_indptr = torch.tensor([0] + list(_cumsum(prefix_lens)), dtype=torch.int32, device=device)
        flat_slots = [s for row, p in zip(slot_rows, prefix_lens) for s in row[:p].tolist()]
        if graph_layout:
            stale = nan_slots or [0]
            flat_slots += [stale[i % len(stale)] for i in range(3 * len(flat_slots) + 64)]
        kv_indices = torch.tensor(flat_slots, dtype=torch.int64, device=device)
        qo_indptr = torch.arange(0, (batch + 1) * n, n, dtype=qo_indptr_dtype, device=device)
        custom_mask = None
        mask_indptr = torch.zeros(batch + 1, dtype=torch.int64, device=device)
        if flat is not None:
            full = flat
            if graph_layout:
                full = torch.cat([flat, torch.ones(2 * flat.numel() + 64, dtype=torch.bool)])
            custom_mask = (full.to(torch.uint8) if mask == "uint8" else full).to(device)
            mask_indptr[1:] = torch.tensor(list(_cumsum([n * (p + n) for p in prefix_lens])), dtype=torch.int64)
        backend.forward_metadata = sg.triton_backend.ForwardMetadata(
            attn_logits=None, attn_lse=None, max_extend_len=n, num_kv_splits=None,
            kv_indptr=kv_indptr, kv_indices=kv_indices, qo_indptr=qo_indptr,
            custom_mask=custom_mask, mask_indptr=mask_indptr,
            window_kv_indptr=None, window_kv_indices=None, window_num_kv_splits=None,
            window_kv_offsets=None,
        )
    else:
        rows_total = batch + 3
        width = max(row.numel() for row in slot_rows)
        req_to_token = torch.zeros(rows_total, width, dtype=torch.int32)
        req_pool_indices = torch.randperm(rows_total, generator=g)[:batch]
        for r, row in zip(req_pool_indices.tolist(), slot_rows):
            req_to_token[r, :row.numel()] = row.to(torch.int32)
        fb.req_pool_indices = req_pool_indices.to(device)
        fb.seq_lens = torch.tensor(prefix_lens, dtype=torch.int64, device=device)
        fb.seq_lens_cpu = torch.tensor(prefix_lens, dtype=torch.int64)
        fb.seq_lens_sum = sum(prefix_lens)
        fb.encoder_lens = None
        custom_mask = None if flat is None else flat.to(device)
        fb.spec_info = types.SimpleNamespace(custom_mask=custom_mask, num_tokens_per_req=n, draft_token_num=n,
                                             kv_indptr=None, kv_indices=None)
        _attach_metadata_builders(sg, backend, req_to_token=req_to_token.to(device), page_size=page_size, n=n,
                                  max_bs=rows_total, device=device, graph_layout=graph_layout,
                                  stale_slots=nan_slots, stale_indices=4 * rows_total * width + 64)
        backend.kv_index_translator.bind_own_plan(fb)
        assert fb.out_cache_loc is out_cache_loc, "a plain pool's plan writes the virtual slots themselves"
        with parallel_context(sg):
            if graph_layout:
                backend.init_forward_metadata_out_graph(fb, in_capture=True)
            else:
                backend.init_forward_metadata(fb)

    return VerifyCase(sg=sg, backend=backend, pool=pool, layer=layer, forward_batch=fb, q=q, k=k, v=v,
                      prefix_lens=prefix_lens, n=n, tree=tree, out_cache_loc=out_cache_loc, page_size=page_size,
                      metadata=metadata, graph_layout=graph_layout, slot_rows=slot_rows, generator=g)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def reference_output(case: VerifyCase, dtype=torch.float64) -> torch.Tensor:
    """``[T, H * 512]`` from SGLANG.md's rules, written out independently of kdtree and of
    SGLang: prefix keys always visible, draft key j visible iff tree[i, j] (or j <= i without a
    mask), rows that see nothing are 0. Reads the prefix rows from the pool, drafts from ``k``; with the layer's KV
    scales both set, prefix keys score as k_scale * row and their values are v_scale * row[:512] (SGLang's k_descale /
    v_descale), drafts unscaled."""
    kb = case.key_buffer().reshape(-1, QK_HEAD_DIM).to("cpu", dtype)
    md = case.backend.forward_metadata
    kv_indices = md.kv_indices.to("cpu")
    q = case.q.to("cpu", dtype)
    kn = case.k.reshape(-1, QK_HEAD_DIM).to("cpu", dtype)
    H = case.num_heads
    layer = case.layer
    both = getattr(layer, "k_scale", None) is not None and getattr(layer, "v_scale", None) is not None
    k_scale, v_scale = (float(layer.k_scale_float), float(layer.v_scale_float)) if both else (1.0, 1.0)
    out = torch.zeros(case.num_tokens, H, KV_LORA_RANK, dtype=dtype)
    start_kv = 0
    for b, p in enumerate(case.prefix_lens):
        t0 = b * case.n
        prefix = kb[kv_indices[start_kv:start_kv + p]]
        start_kv += p
        drafts = kn[t0:t0 + case.n]
        keys = torch.cat([prefix * k_scale, drafts])                    # [P + N, 576]
        values = torch.cat([prefix[:, :KV_LORA_RANK] * v_scale, drafts[:, :KV_LORA_RANK]])
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
        out[t0:t0 + case.n] = torch.einsum("ths,sd->thd", probs, values)
    return out.reshape(case.num_tokens, H * KV_LORA_RANK)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor, so that torch.equal also compares NaN slots."""
    return t.detach().contiguous().view(torch.uint8)


def assert_pools_identical(case: VerifyCase, twin: VerifyCase, what: str) -> None:
    """Every tensor of the two cases' pools byte for byte (:func:`pool_tensors`: latent KV of every
    layer, DSA index keys and scales), except the pointer tables (``data_ptrs``), which name each
    pool's own buffers and must still do so."""
    mine, theirs = case.pool_buffers(), twin.pool_buffers()
    assert mine.keys() == theirs.keys(), f"{what}: the pools hold different tensors"
    for path in mine:
        if path == "data_ptrs":
            for c in (case, twin):
                assert c.pool.data_ptrs.tolist() == [b.data_ptr() for b in c.pool.kv_buffer], what
            continue
        assert torch.equal(bits(mine[path]), bits(theirs[path])), f"{what}: pool buffer {path} differs"


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
