"""kdtree.verify_attention on CPU tensors (the reference path), its argument validation, the
package surface (lazy extension, no heavy imports) and the command line."""

import os
import subprocess
import sys

import pytest
import torch

import kdtree
from kdtree import (kv_cache_2d, verify_attention, verify_attention_mla,
                    verify_attention_reference)
from kdtree.__main__ import main as cli_main
from kdtree.synthetic import make_verify_batch

SM_SCALE = 0.1147
# subprocesses import kdtree from where this process found it (the source tree or site-packages)
PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(kdtree.__file__)))


def batch_args(prefixes=(40, 0, 7), n=9, heads=3, seed=0):
    """verify_attention's positional arguments for a synthetic SGLang-layout batch (CPU)."""
    b = make_verify_batch(list(prefixes), heads, n, kind="tree", pad=min(2, n - 1), seed=seed, pool_factor=4,
                          graph_tails=True)
    return dict(b.verify_args(), sm_scale=SM_SCALE), b


def call(args, **kw):
    a = dict(args)
    return verify_attention(a.pop("q_nope"), a.pop("q_pe"), a.pop("kv_cache"), a.pop("kv_indptr"),
                            a.pop("kv_indices"), a.pop("qo_indptr"), a.pop("k_new"), a.pop("tree_mask"),
                            a.pop("sm_scale"), **kw)


def reference(args, dtype):
    return verify_attention_reference(*[args[k] for k in ("q_nope", "q_pe", "kv_cache", "kv_indptr", "kv_indices",
                                                         "qo_indptr", "k_new", "tree_mask", "sm_scale")], dtype=dtype)


# ------------------------------------------------------------------ numerics of the CPU path

@pytest.mark.parametrize("prefixes,n,heads,causal", [
    ((40, 0, 7), 9, 3, False),
    ((1,), 1, 1, False),
    ((0, 0), 5, 2, False),        # all prefixes empty: kv_indices holds only the garbage tail
    ((65, 3), 16, 4, True),       # causal chain (tree_mask None)
    ((2,), 130, 1, False),        # 3 mask words
])
def test_cpu_path_is_the_reference(prefixes, n, heads, causal):
    args, _ = batch_args(prefixes, n, heads, seed=n + heads)
    if causal:
        args["tree_mask"] = None
    out = call(args)
    assert out.dtype == torch.bfloat16 and out.shape == (sum([n] * len(prefixes)), heads, 512)
    assert torch.equal(out, reference(args, torch.float32).to(torch.bfloat16))
    ref64 = reference(args, torch.float64)
    assert torch.isfinite(ref64).all() and torch.isfinite(out).all()
    err = (out.double() - ref64).abs()
    assert bool((err <= 1e-2 + 1e-2 * ref64.abs()).all()), float(err.max())


def test_out_is_written_in_place_with_strides():
    args, _ = batch_args()
    T, H = args["q_nope"].shape[:2]
    storage = torch.full((T, H + 2, 640), float("nan"), dtype=torch.bfloat16)
    out = storage[:, 1:H + 1, :512]
    result = call(args, out=out)
    assert result is out
    assert torch.equal(out, call(args))
    assert storage[:, 0].isnan().all() and storage[:, H + 1].isnan().all() and storage[..., 512:].isnan().all()


def test_reference_semantics_by_hand():
    """One request, P=2, N=3, one head, tree: token 0 -> {0}, token 1 -> {0,1}, token 2 -> {} (padding).
    Checks the rules directly with a hand-written softmax (no kdtree helper involved)."""
    gen = torch.Generator().manual_seed(1)
    T, P = 3, 2
    q = torch.randn((T, 1, 576), generator=gen).to(torch.bfloat16)
    pool = torch.full((6, 576), float("nan")).to(torch.bfloat16)
    pool[4] = torch.randn(576, generator=gen).to(torch.bfloat16)
    pool[1] = torch.randn(576, generator=gen).to(torch.bfloat16)
    k_new = torch.randn((T, 576), generator=gen).to(torch.bfloat16)
    kv_indices = torch.tensor([4, 1, 0], dtype=torch.int32)  # slot 0 (NaN) is past kv_indptr[B]
    tree = torch.tensor([[0b001], [0b011], [0b000]], dtype=torch.int64)
    out = verify_attention_reference(q[..., :512], q[..., 512:], pool, torch.tensor([0, 2], dtype=torch.int32),
                                     kv_indices, torch.tensor([0, 3], dtype=torch.int32), k_new, tree, 0.3,
                                     dtype=torch.float64)
    keys = torch.stack([pool[4], pool[1], k_new[0], k_new[1], k_new[2]]).double()
    for t, visible in enumerate([[0, 1, 2], [0, 1, 2, 3], [0, 1]]):
        s = 0.3 * keys[visible] @ q[t, 0].double()
        want = torch.softmax(s, 0) @ keys[visible, :512]
        assert torch.allclose(out[t, 0], want, rtol=1e-12, atol=1e-12)

    # no prefix and an all-False row: zeros, not NaN
    out0 = verify_attention_reference(q[..., :512], q[..., 512:], pool, torch.tensor([0, 0], dtype=torch.int32),
                                      kv_indices, torch.tensor([0, 3], dtype=torch.int32), k_new, tree, 0.3)
    assert out0[2].eq(0).all() and torch.isfinite(out0).all()
    # causal chain: token 2 sees drafts 0..2
    outc = verify_attention_reference(q[..., :512], q[..., 512:], pool, torch.tensor([0, 2], dtype=torch.int32),
                                      kv_indices, torch.tensor([0, 3], dtype=torch.int32), k_new, None, 0.3,
                                      dtype=torch.float64)
    want = torch.softmax(0.3 * keys @ q[2, 0].double(), 0) @ keys[:, :512]
    assert torch.allclose(outc[2, 0], want, rtol=1e-12, atol=1e-12)


def test_nan_in_unread_slots_never_leaks():
    args, b = batch_args((30, 12), 9, 2)
    out = call(args)
    assert torch.isfinite(out).all()
    # the same batch with the unused slots zeroed instead gives the same numbers
    pool = b.kv_buffer.clone()
    pool[pool.isnan()] = 0
    assert torch.equal(out, call(dict(args, kv_cache=kv_cache_2d(pool))))
    # and a NaN in a slot that IS read does show up (the poison is real)
    pool = b.kv_buffer.clone()
    pool[int(args["kv_indices"][3])] = float("nan")
    assert call(dict(args, kv_cache=kv_cache_2d(pool)))[:9].isnan().any()


@pytest.mark.parametrize("page_size, shuffle", [(64, True), (64, False), (3, True)])
def test_synthetic_paged_pools(page_size, shuffle):
    """make_verify_batch(page_size=...) lays a batch out as SGLang's paged pools do: each request's prefix, then its
    drafts, fill pages of its own from their first slot, no slot twice, page 0 unused; its result is the reference's."""
    prefixes, n = (130, 0, 63, 7), 3
    b = make_verify_batch(list(prefixes), 2, n, seed=3, page_size=page_size, shuffle=shuffle, pool_factor=3)
    slots = b.kv_buffer.shape[0]
    assert slots % page_size == 0
    firsts = b.kv_indptr[:-1].long()
    for i, p in enumerate(prefixes):
        req = torch.cat([b.kv_indices[firsts[i]:firsts[i] + p], b.out_cache_loc[i * n:(i + 1) * n]])
        assert int(req[0]) % page_size == 0                       # a request starts a page
        within = req[1:] % page_size != 0                         # and runs on through each page it is in
        assert torch.equal(req[1:][within], req[:-1][within] + 1)
    every = torch.cat([b.kv_indices, b.out_cache_loc])
    assert every.unique().numel() == every.numel() and int(every.min()) >= page_size
    if not shuffle:
        assert torch.equal(b.kv_indices[:130], torch.arange(page_size, page_size + 130))
    args = dict(b.verify_args(), sm_scale=SM_SCALE)
    assert torch.isfinite(call(args)).all()
    with pytest.raises(ValueError, match="page_size"):
        make_verify_batch([4], 1, 1, page_size=0)


def test_verify_attention_mla_matches():
    args, b = batch_args((20, 5), 5, 2)
    got = verify_attention_mla(b.q, b.k, b.kv_buffer, b.kv_indptr, b.kv_indices, b.qo_indptr,
                               args["tree_mask"], SM_SCALE)
    assert torch.equal(got, call(args))


def test_int32_kv_indices_and_int64_qo_indptr():
    args, _ = batch_args()
    want = call(args)
    got = call(dict(args, kv_indices=args["kv_indices"].int(), qo_indptr=args["qo_indptr"].long()))
    assert torch.equal(got, want)


# ------------------------------------------------------------------ bad input

def _meta(t):
    return t.to("meta")


def _noncontig_last(t):
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    return wide[..., ::2]


def _transposed_tokens(t):
    return t.transpose(0, 1).contiguous().transpose(0, 1)


BAD = [
    # (argument, how to break it, exception, message regex)
    ("q_nope", lambda t: t.to(torch.float16), TypeError, r"q_nope must be bfloat16, got torch.float16"),
    ("q_pe", lambda t: t.float(), TypeError, r"q_pe must be bfloat16, got torch.float32"),
    ("kv_cache", lambda t: t.to(torch.float16), TypeError,
     r"kv_cache must be bfloat16 or float8_e4m3fn, got torch.float16"),
    ("k_new", lambda t: t.float(), TypeError, r"k_new must be bfloat16, got torch.float32"),
    ("kv_indptr", lambda t: t.long(), TypeError, r"kv_indptr must be int32, got torch.int64"),
    ("kv_indices", lambda t: t.float(), TypeError, r"kv_indices must be int32 or int64, got torch.float32"),
    ("qo_indptr", lambda t: t.to(torch.int16), TypeError, r"qo_indptr must be int32 or int64, got torch.int16"),
    ("tree_mask", lambda t: t.int(), TypeError, r"tree_mask must be int64, got torch.int32"),
    ("q_nope", lambda t: t.float().numpy(), TypeError, r"q_nope must be a torch.Tensor, got ndarray"),
    ("k_new", lambda t: None, TypeError, r"k_new must be a torch.Tensor, got NoneType"),
    # devices (meta stands in for "another device" on a CPU-only machine)
    ("kv_cache", _meta, ValueError, r"kv_cache is on meta but q_nope is on cpu"),
    ("q_pe", _meta, ValueError, r"q_pe is on meta but q_nope is on cpu"),
    ("kv_indices", _meta, ValueError, r"kv_indices is on meta but q_nope is on cpu"),
    ("qo_indptr", _meta, ValueError, r"qo_indptr is on meta but q_nope is on cpu"),
    ("tree_mask", _meta, ValueError, r"tree_mask is on meta but q_nope is on cpu"),
    # dims and shapes
    ("q_nope", lambda t: t[:, 0], ValueError, r"q_nope must be 3-D \[T, H, 512\], got shape \(27, 512\)"),
    ("q_nope", lambda t: torch.zeros(27, 3, 576, dtype=t.dtype), ValueError, r"q_nope must be \[T, H, 512\]"),
    ("q_pe", lambda t: t[:, :2], ValueError, r"q_pe.shape\[:2\] must equal q_nope.shape\[:2\] = \(27, 3\)"),
    ("q_pe", lambda t: t[..., :32], ValueError, r"q_pe must be \[T, H, 64\]"),
    ("kv_cache", lambda t: t[:, None], ValueError, r"kv_cache must be 2-D \[S, 576\]"),
    ("kv_cache", lambda t: t[:, :512], ValueError, r"kv_cache must be \[S >= 1, 576\]"),
    ("k_new", lambda t: t[:-1], ValueError, r"k_new must have one row per verify token \(T = 27"),
    ("k_new", lambda t: t[:, :570], ValueError, r"k_new must be \[T, 576\]"),
    ("tree_mask", lambda t: t[:-1], ValueError, r"tree_mask must have one row per verify token \(T = 27\)"),
    ("tree_mask", lambda t: torch.zeros(27, 9, dtype=torch.int64), ValueError, r"tree_mask must have 1..8 words"),
    ("tree_mask", lambda t: t[:, 0], ValueError, r"tree_mask must be 2-D"),
    ("tree_mask", lambda t: torch.zeros(2, 27, dtype=torch.int64).t(), ValueError, r"tree_mask must be contiguous"),
    # strides
    ("q_nope", _noncontig_last, ValueError, r"q_nope must have a contiguous last dimension"),
    ("q_pe", _noncontig_last, ValueError, r"q_pe must have a contiguous last dimension"),
    ("k_new", _noncontig_last, ValueError, r"k_new must have a contiguous last dimension"),
    ("kv_cache", lambda t: t.t().contiguous().t(), ValueError, r"kv_cache must have a contiguous last dimension"),
    ("q_nope", _transposed_tokens, ValueError, r"q_nope token stride must be >= \(H - 1\) \* head stride \+ 512"),
    ("q_nope", lambda t: torch.zeros(27 * 3 * 512, dtype=t.dtype).as_strided((27, 3, 512), (768, 256, 1)),
     ValueError, r"q_nope head stride must be >= 512"),
    ("kv_cache", lambda t: torch.zeros(t.shape[0] * 576, dtype=t.dtype).as_strided(t.shape, (512, 1)),
     ValueError, r"kv_cache row stride must be >= 576, got 512"),
    ("k_new", lambda t: torch.zeros(27 * 576, dtype=t.dtype).as_strided(t.shape, (64, 1)),
     ValueError, r"k_new row stride must be >= 576, got 64"),
    # index vectors
    ("kv_indptr", lambda t: t[:, None], ValueError, r"kv_indptr must be 1-D"),
    ("kv_indices", lambda t: torch.zeros(2 * t.numel(), dtype=t.dtype)[::2], ValueError,
     r"kv_indices must be contiguous \(stride 1\), got stride 2"),
    ("qo_indptr", lambda t: torch.cat([t, t[-1:]]), ValueError,
     r"qo_indptr and kv_indptr must both be \[B \+ 1\]: got lengths 5 and 4"),
    ("kv_indptr", lambda t: t[:1], ValueError, r"kv_indptr must be \[B \+ 1\] with B >= 1, got length 1"),
    # values (checked on the CPU path only; on CUDA they are the caller's contract)
    ("qo_indptr", lambda t: t.clone().fill_(0), ValueError, r"qo_indptr must rise from 0 to T=27"),
    ("kv_indptr", lambda t: t + 10_000, ValueError, r"kv_indptr\[B\]=10\d+ exceeds kv_indices' length"),
    ("kv_indices", lambda t: t + 100_000, ValueError, r"kv_indices of request 0 leave the pool"),
    # scale
    ("sm_scale", lambda s: 0.0, ValueError, r"sm_scale must be finite and positive, got 0.0"),
    ("sm_scale", lambda s: -0.1, ValueError, r"sm_scale must be finite and positive"),
    ("sm_scale", lambda s: float("nan"), ValueError, r"sm_scale must be finite and positive, got nan"),
    ("sm_scale", lambda s: float("inf"), ValueError, r"sm_scale must be finite and positive, got inf"),
    ("sm_scale", lambda s: torch.tensor(s), TypeError, r"sm_scale must be a real number \(a host float\), got Tensor"),
    ("sm_scale", lambda s: True, TypeError, r"sm_scale must be a real number"),
]


@pytest.mark.parametrize("name,breaker,exc,message", BAD,
                         ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input_is_named(name, breaker, exc, message):
    args, _ = batch_args((40, 0, 7), 9, 3)
    assert args["q_nope"].shape[:2] == (27, 3) and args["kv_indptr"].numel() == 4
    call(args)  # the unbroken arguments are fine
    args[name] = breaker(args[name])
    with pytest.raises(exc, match=message):
        call(args)


@pytest.mark.parametrize("breaker,exc,message", [
    (lambda a: torch.zeros_like(a["q_nope"], dtype=torch.float32), TypeError, r"out must be bfloat16, got torch.float32"),
    (lambda a: torch.zeros(27, 3, 576, dtype=torch.bfloat16), ValueError, r"out must be \[T, H, 512\] = \(27, 3, 512\)"),
    (lambda a: torch.zeros(27, 512, dtype=torch.bfloat16), ValueError, r"out must be 3-D"),
    (lambda a: torch.zeros(27, 3, 512, dtype=torch.bfloat16, device="meta"), ValueError, r"out is on meta but q_nope is on cpu"),
    (lambda a: torch.zeros(3, 27, 512, dtype=torch.bfloat16).transpose(0, 1), ValueError, r"out token stride"),
    (lambda a: _noncontig_last(torch.zeros(27, 3, 512, dtype=torch.bfloat16)), ValueError,
     r"out must have a contiguous last dimension"),
])
def test_bad_out_is_named(breaker, exc, message):
    args, _ = batch_args((40, 0, 7), 9, 3)
    with pytest.raises(exc, match=message):
        call(args, out=breaker(args))


def test_structure_checks_are_cached_per_signature(monkeypatch):
    # a second call with the same tensor signatures skips the structural checks (and gets the same
    # result); a changed signature is checked afresh; the cache stays bounded
    from kdtree import ops

    args, _ = batch_args((40, 0, 7), 9, 3)
    ops._CHECKED.clear()
    first = call(args)
    assert len(ops._CHECKED) == 1
    checks = []
    monkeypatch.setattr(ops, "_check_structure", lambda *a: checks.append(1) or pytest.fail("not cached"))
    assert torch.equal(call(args), first)
    assert not checks
    monkeypatch.undo()
    with pytest.raises(TypeError, match="q_pe must be bfloat16"):   # new signature: checked, refused
        call(dict(args, q_pe=args["q_pe"].float()))
    assert len(ops._CHECKED) == 1
    monkeypatch.setattr(ops, "verify_attention_reference", lambda *a, **k: torch.zeros(1, 1, 512))
    for t in range(ops._CHECKED_MAX + 10):   # distinct signatures (the stubbed reference keeps it quick)
        q = torch.zeros(t + 1, 1, 512, dtype=torch.bfloat16)
        verify_attention(q, torch.zeros(t + 1, 1, 64, dtype=torch.bfloat16), torch.zeros(4, 576, dtype=torch.bfloat16),
                         torch.tensor([0, 0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                         torch.tensor([0, t + 1], dtype=torch.int32), torch.zeros(t + 1, 576, dtype=torch.bfloat16),
                         None, SM_SCALE)
        assert len(ops._CHECKED) <= ops._CHECKED_MAX


def test_tensor_subclasses_take_the_full_checks():
    from kdtree import ops

    args, _ = batch_args((40, 0, 7), 9, 3)
    ops._CHECKED.clear()
    out = call(dict(args, q_nope=torch.nn.Parameter(args["q_nope"], requires_grad=False)))
    assert torch.equal(out, call(args))
    assert len(ops._CHECKED) == 1   # only the plain-tensor call was cached


@pytest.fixture
def fake_cuda(monkeypatch):
    """verify_attention's CUDA branch on CPU tensors: the device, the stream, graph capture state,
    allocation and the extension stubbed. Yields (launch keyword dicts, a 4096-byte workspace)."""
    import contextlib
    import types

    from kdtree import _ext, ops

    launches = []

    class FakeExt:
        def workspace_size(self, b, t, h):
            return 4096

        def launch(self, **kw):
            launches.append(kw)

    ws = torch.empty(8192, dtype=torch.uint8)
    ws = ws[(-ws.data_ptr()) % 256:][:4096]   # 256-byte aligned, like the real workspace
    real = ops._check_structure
    real_empty = torch.empty

    def empty(*size, device=None, **kw):   # "CUDA" buffers of a Workspace are CPU tensors here
        return real_empty(*size, **kw)

    monkeypatch.setattr(ops, "_check_structure", lambda *a: real(*a)._replace(device=torch.device("cuda", 0)))
    monkeypatch.setattr(_ext, "load", lambda: FakeExt())
    monkeypatch.setattr(ops, "workspace_for", lambda device, nbytes: ws)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: types.SimpleNamespace(cuda_stream=1234))
    monkeypatch.setattr(ops, "_raw_stream", None)   # the public accessor above, stubbed
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch, "empty", empty)
    ops._CHECKED.clear()
    yield launches, ws
    ops._CHECKED.clear()


def test_cuda_branch_launches_the_checked_layout(fake_cuda):
    # the CUDA branch of verify_attention run on CPU tensors with the device, the stream and the
    # extension stubbed: the launch gets the sizes and strides the checks derived, on the first
    # (checked) and the second (cached) call alike
    launches, ws = fake_cuda
    args, _ = batch_args((40, 0, 7), 9, 3)
    out = torch.empty(27, 3, 512, dtype=torch.bfloat16)
    call(args, out=out)
    call(args, out=out)
    assert len(launches) == 2 and launches[0] == launches[1]
    kw = launches[0]
    q_nope, q_pe, kv, k_new = args["q_nope"], args["q_pe"], args["kv_cache"], args["k_new"]
    assert (kw["num_tokens"], kw["num_heads"], kw["batch_size"]) == (27, 3, 3)
    assert (kw["q_nope_stride_t"], kw["q_nope_stride_h"]) == (q_nope.stride(0), q_nope.stride(1))
    assert (kw["q_pe_stride_t"], kw["q_pe_stride_h"]) == (q_pe.stride(0), q_pe.stride(1))
    assert kw["kv_stride_s"] == kv.stride(0) and kw["k_new_stride_t"] == k_new.stride(0)
    assert (kw["out_stride_t"], kw["out_stride_h"]) == (out.stride(0), out.stride(1))
    assert kw["tree_mask_words"] == args["tree_mask"].shape[1] and kw["tree_mask"] == args["tree_mask"].data_ptr()
    assert kw["q_nope"] == q_nope.data_ptr() and kw["out"] == out.data_ptr() and kw["kv_cache"] == kv.data_ptr()
    assert kw["num_slots"] == kv.shape[0] and kw["sm_scale"] == SM_SCALE
    assert kw["workspace"] == ws.data_ptr() and kw["workspace_bytes"] == 4096 and kw["stream"] == 1234
    assert kw["reuse_plan"] is False


def _offset_copy(t, elements):
    """t's values in a tensor of t's shape and strides whose storage starts `elements` in (a misaligned base)."""
    flat = torch.zeros(t.numel() + elements, dtype=t.dtype)
    view = flat[elements:].view(t.shape)
    view.copy_(t)
    return view


def _wide_rows(t, width):
    """t's values in rows `width` elements apart (last dimension padded and sliced back)."""
    wide = torch.zeros(*t.shape[:-1], width, dtype=t.dtype)
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


@pytest.mark.parametrize("name", ["q_nope", "q_pe", "kv_cache", "k_new", "out"])
def test_cuda_branch_names_a_misaligned_pointer(fake_cuda, name):
    # CUDA needs 16-byte aligned rows: a base pointer off by one bf16 is refused, naming the tensor, on the first
    # (checked) and a second (cached signature) call alike
    launches, _ = fake_cuda
    args, _ = batch_args((40, 0, 7), 9, 3)
    out = torch.empty(27, 3, 512, dtype=torch.bfloat16)
    if name == "out":
        out = _offset_copy(out, 1)
    else:
        args[name] = _offset_copy(args[name], 1)
    for _ in range(2):
        with pytest.raises(ValueError, match=rf"{name} data pointer must be 16-byte aligned, got offset 2"):
            call(args, out=out)
    assert not launches


@pytest.mark.parametrize("name,width", [("q_nope", 516), ("q_pe", 68), ("kv_cache", 580), ("k_new", 582),
                                        ("out", 520 + 4)])
def test_cuda_branch_names_a_misaligned_row_stride(fake_cuda, monkeypatch, name, width):
    from kdtree import ops

    launches, _ = fake_cuda
    args, _ = batch_args((40, 0, 7), 9, 3)
    out = torch.empty(27, 3, 512, dtype=torch.bfloat16)
    if name == "out":
        out = _wide_rows(out, width)
    else:
        args[name] = _wide_rows(args[name], width)
    with pytest.raises(ValueError, match=rf"{name} row strides must be multiples of 8 elements \(16 bytes\)"):
        call(args, out=out)
    assert not launches and not ops._CHECKED   # a refused signature is not cached
    monkeypatch.undo()   # the real CPU path: no alignment needed
    assert torch.equal(call(args, out=out), call(batch_args((40, 0, 7), 9, 3)[0]))


def test_reuse_plan_needs_the_callers_workspace(fake_cuda, monkeypatch):
    from kdtree import ops

    launches, ws = fake_cuda
    args, _ = batch_args((40, 0, 7), 9, 3)
    with pytest.raises(ValueError, match=r"reuse_plan=True needs workspace="):
        call(args, reuse_plan=True)
    assert not launches
    monkeypatch.setattr(ops, "_device", lambda t, name, device: None)   # ws is a CPU tensor standing in
    call(args, workspace=ws, reuse_plan=True)
    assert launches[-1]["reuse_plan"] is True and launches[-1]["workspace"] == ws.data_ptr()


def test_reuse_plan_on_a_workspace_object_that_grows_plans_afresh(fake_cuda):
    from kdtree import ops

    launches, _ = fake_cuda
    args, _ = batch_args((40, 0, 7), 9, 3)
    own = ops.Workspace()
    call(args, workspace=own, reuse_plan=True)     # the first call allocates: there is no plan to reuse
    call(args, workspace=own, reuse_plan=True)     # same buffer: reuse
    call(args, workspace=own)
    assert [kw["reuse_plan"] for kw in launches] == [False, True, False]
    assert len({kw["workspace"] for kw in launches}) == 1
    assert launches[0]["workspace"] == own.get(torch.device("cuda", 0), 1).data_ptr()
    assert launches[0]["workspace_bytes"] >= 4096


@pytest.mark.parametrize("value", [1, "yes", None])
def test_reuse_plan_must_be_a_bool(value):
    args, _ = batch_args((4,), 2, 1)
    with pytest.raises(TypeError, match=r"reuse_plan must be a bool"):
        call(args, reuse_plan=value)


def test_cpu_ignores_a_workspace_object_and_reuse_plan():
    from kdtree import ops

    args, _ = batch_args((40, 0, 7), 9, 3)
    ref = call(args)
    assert torch.equal(call(args, workspace=ops.Workspace(), reuse_plan=True), ref)


def test_the_call_packs_custom_mask_into_tree_mask():
    # verify_attention(custom_mask=, mask_indptr=) fills tree_mask as build_tree_mask would, then attends with it
    args, b = batch_args((40, 0, 7), 9, 3)
    buf = torch.full_like(args["tree_mask"], 0x5A5A)
    out = call(dict(args, tree_mask=buf), custom_mask=b.custom_mask, mask_indptr=b.mask_indptr)
    assert torch.equal(buf, args["tree_mask"])
    assert torch.equal(out, call(args))
    buf.fill_(-1)   # int32 mask_indptr and a uint8 custom_mask are accepted too
    call(dict(args, tree_mask=buf), custom_mask=b.custom_mask.to(torch.uint8), mask_indptr=b.mask_indptr.int())
    assert torch.equal(buf, args["tree_mask"])


@pytest.mark.parametrize("kw,exc,message", [
    (dict(mask_indptr="b"), ValueError, r"mask_indptr is given without custom_mask"),
    (dict(custom_mask="b"), ValueError, r"custom_mask needs mask_indptr"),
    (dict(custom_mask="b", mask_indptr="b", tree_mask=None), ValueError, r"custom_mask needs tree_mask"),
    (dict(custom_mask="int", mask_indptr="b"), TypeError, r"custom_mask must be bool or uint8"),
    (dict(custom_mask="b", mask_indptr="float"), TypeError, r"mask_indptr must be"),
    (dict(custom_mask="b", mask_indptr="short"), ValueError, r"mask_indptr, qo_indptr and kv_indptr must all be"),
])
def test_custom_mask_arguments_are_named(kw, exc, message):
    args, b = batch_args((40, 0, 7), 9, 3)
    values = {"b": None, "int": b.custom_mask.int(), "float": b.mask_indptr.float(), "short": b.mask_indptr[:-1]}
    pack = {}
    for name in ("custom_mask", "mask_indptr"):
        if name in kw:
            v = values[kw[name]]
            pack[name] = v if v is not None else getattr(b, name)
    if "tree_mask" in kw:
        args["tree_mask"] = kw["tree_mask"]
    with pytest.raises(exc, match=message):
        call(args, **pack)


def test_cuda_branch_passes_the_mask_to_pack(fake_cuda, monkeypatch):
    from kdtree import ops

    launches, _ = fake_cuda
    monkeypatch.setattr(ops, "check_custom_mask", lambda *a: torch.device("cuda", 0))
    args, b = batch_args((40, 0, 7), 9, 3)
    call(args)
    call(args, custom_mask=b.custom_mask, mask_indptr=b.mask_indptr)
    assert (launches[0]["pack_custom_mask"], launches[0]["pack_mask_indptr"]) == (0, 0)
    assert launches[1]["pack_custom_mask"] == b.custom_mask.data_ptr()
    assert launches[1]["pack_mask_indptr"] == b.mask_indptr.data_ptr()   # int64 already: no copy
    assert launches[1]["tree_mask"] == args["tree_mask"].data_ptr()


def test_too_many_heads():
    args, _ = batch_args((4,), 2, 1)
    T = args["q_nope"].shape[0]
    args["q_nope"] = torch.zeros(T, 129, 512, dtype=torch.bfloat16)
    args["q_pe"] = torch.zeros(T, 129, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q_nope has 129 heads; kdtree serves 1..128 heads per rank"):
        call(args)


def test_no_tokens():
    args, _ = batch_args((4,), 2, 1)
    args["q_nope"], args["q_pe"] = args["q_nope"][:0], args["q_pe"][:0]
    with pytest.raises(ValueError, match=r"q_nope must have at least one verify token"):
        call(args)


def test_too_many_tokens_for_the_mask_words():
    args, b = batch_args((3,), 65, 1)
    assert args["tree_mask"].shape == (65, 2)
    args["tree_mask"] = args["tree_mask"][:, :1].contiguous()
    with pytest.raises(ValueError, match=r"tree_mask has 1 words per row \(64 draft tokens\) but a request has 65"):
        call(args)


def test_workspace_on_cpu_is_refused():
    args, _ = batch_args()
    with pytest.raises(ValueError, match=r"workspace is only used for CUDA tensors"):
        call(args, workspace=torch.empty(1024, dtype=torch.uint8))


# ------------------------------------------------------------------ package surface

def test_version_and_exports():
    assert kdtree.__version__ == "0.1.0"
    for name in kdtree.__all__:
        assert getattr(kdtree, name) is not None
    assert issubclass(kdtree.KdtreeError, RuntimeError)
    with pytest.raises(AttributeError):
        kdtree.no_such_name


def test_import_is_light():
    """import kdtree pulls in neither sglang, triton nor the compiled extension and needs no GPU."""
    code = ("import sys, kdtree\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'triton', 'transformers'))\n"
            "assert not heavy, heavy\n"
            "assert 'kdtree._verify' not in sys.modules\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_missing_extension_message(monkeypatch):
    from kdtree import _ext

    if _ext.available():
        pytest.skip("kdtree._verify is built here")
    with pytest.raises(ImportError, match=r"kdtree._verify, the compiled CUDA extension of kdtree, could not be imported"):
        _ext.load()
    with pytest.raises(ImportError, match=r"CPU tensors work without it"):
        _ext.load()  # the second attempt says the same
    assert kdtree.KdtreeError is _ext.KdtreeErrorUnavailable


# ------------------------------------------------------------------ command line

def test_cli_info(capsys):
    assert cli_main(["info"]) == 0
    text = capsys.readouterr().out
    assert "kdtree 0.1.0" in text and f"torch {torch.__version__}" in text
    assert ("no GPU" in text) != torch.cuda.is_available()


def test_cli_check_passes(capsys):
    assert cli_main(["check", "--cpu", "--prefix", "100", "30", "--heads", "4"]) == 0
    text = capsys.readouterr().out
    assert "path: CPU reference" in text and "OK" in text and "max abs error" in text


@pytest.mark.parametrize("corruption,expected", [
    (lambda out: out.mul_(1.05), "beyond bf16 tolerance"),
    (lambda out: out.view(-1)[123].fill_(float("nan")), "non-finite output values"),
])
def test_cli_check_fails_on_a_wrong_result(monkeypatch, capsys, corruption, expected):
    import kdtree.__main__ as cli

    def broken(*args, **kwargs):
        out = verify_attention(*args, **kwargs)
        corruption(out)
        return out

    monkeypatch.setattr(cli, "verify_attention", broken)
    assert cli.main(["check", "--cpu", "--prefix", "50", "--batch", "1", "--heads", "2"]) == 1
    text = capsys.readouterr().out
    assert expected in text and "FAIL" in text


def test_cli_module_runs():
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "kdtree", "check", "--cpu"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout
