"""The CUDA kernel against the float32 reference, on a GPU (skipped without one).

Every case: fresh random inputs, shuffled page-size-1 slots, every pool slot the call must not read
set to NaN, the output pre-filled with NaN (so an unwritten element fails), SGLang's own mask layout
rebuilt on the device. KDTREE_TEST_LARGE=1 widens the grid. KDTREE_TEST_KV=e4m3 runs every case on an e4m3 pool
(the FP8 kernel; unread slots hold the e4m3 NaN byte 0x7F), against the reference on the dequantised pool.
"""

import functools
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import kdtree
from kdtree.layout import build_tree_mask, split_mla_q
from kdtree.reference import verify_attention_reference
from kdtree.synthetic import make_verify_batch as _make_verify_batch

pytestmark = pytest.mark.gpu

LARGE = os.environ.get("KDTREE_TEST_LARGE") == "1"
KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
KV_DTYPE = KV_DTYPES[os.environ.get("KDTREE_TEST_KV", "bf16")]
make_verify_batch = functools.partial(_make_verify_batch, kv_dtype=KV_DTYPE)
# bf16 inputs, fp32 accumulation, bf16 P and bf16 output: a few 1e-3 relative; 1e-2 leaves margin
# for long prefixes while a wrong key, a wrong mask bit or a dropped split still fails by far. An e4m3 pool: P in e4m3
# gives 1.2-1.7e-2 on these N(0, 1) inputs (the CPU model in tests/test_fp8_cpu.py), 3e-2 the same margin.
REL_TOL = 3e-2 if KV_DTYPE == torch.float8_e4m3fn else 1e-2


def _run(batch, **kw):
    args = batch.verify_args()
    t, h = batch.q.shape[:2]
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device=batch.q.device)
    kdtree.verify_attention(**args, out=out, **kw)
    return out, args


def _check(out, args):
    ref = verify_attention_reference(**args)
    assert torch.isfinite(out).all(), "kernel output has NaN/Inf (unwritten element or poisoned slot read)"
    err = (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)
    max_abs = (out.float() - ref.float()).abs().max().item()
    assert err.item() < REL_TOL, f"relative L2 error {err.item():.3e} (max abs {max_abs:.3e})"
    return err.item()


HEADS = [1, 8, 16, 128]
TOKENS = [1, 4, 9, 16, 33, 64]   # (4 at H8: 32 rows a request, the 32-row skinny FP8 kernel's calls on sm_90a)
PREFIXES = [0, 1, 7, 1000, 65536] if LARGE else [0, 1, 7, 1000]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_heads_tokens_grid(heads, tokens):
    if heads * tokens > 2048 and not LARGE:
        pytest.skip("large row count only with KDTREE_TEST_LARGE=1")
    batch = make_verify_batch([1000], heads, tokens, kind="tree", pad=min(2, tokens - 1),
                              device="cuda", seed=heads * 100 + tokens)
    out, args = _run(batch)
    _check(out, args)


@pytest.mark.parametrize("prefix", PREFIXES + [15, 16, 17, 255, 256, 257])
def test_prefix_lengths(prefix):
    batch = make_verify_batch([prefix], 16, 9, kind="tree", device="cuda", seed=prefix)
    out, args = _run(batch)
    _check(out, args)


def test_long_prefix_split_k():
    batch = make_verify_batch([65536], 16, 9, kind="tree", pad=2, device="cuda", seed=7)
    out, args = _run(batch)
    _check(out, args)


@pytest.mark.parametrize("prefixes, heads, tokens", [
    ([6000, 6100], 128, 9),   # 18 row tiles: 8 splits each, 9,216 partial rows a request (above 132 x 64)
    ([2000], 16, 65),         # 17 row tiles
    ([10000], 16, 33),        # 9
    ([20000], 32, 9),         # 5
])
def test_balanced_splits(prefixes, heads, tokens):
    # row-tile counts that do not divide 132 SMs: the split rule adds a split with a short last chunk
    # (verify_split_rule.h); on a 132-SM GPU every request here is planned that way (tests/test_split_rule.py's model)
    batch = make_verify_batch(prefixes, heads, tokens, kind="tree", pad=1, device="cuda", seed=sum(prefixes) + heads)
    out, args = _run(batch)
    _check(out, args)


@pytest.mark.parametrize("prefix", [20000, 50000, 70000])
@pytest.mark.parametrize("tokens", [1, 4])
def test_combine_column_slices(prefix, tokens):
    # one 64-row tile (H16, N <= 4) over a long prefix: ~80, ~200 and (on 132 SMs) the cap of 264
    # splits, so the combine runs with 2, 4 and 8 column slices per row
    batch = make_verify_batch([prefix], 16, tokens, kind="tree", device="cuda", seed=prefix + tokens)
    out, args = _run(batch)
    _check(out, args)


@pytest.mark.parametrize("kind", ["tree", "chain", "star", "deep"])
def test_tree_shapes(kind):
    batch = make_verify_batch([300, 5000], 16, 33, kind=kind, device="cuda", seed=3)
    out, args = _run(batch)
    _check(out, args)


def test_causal_none_dflash_chain():
    batch = make_verify_batch([4000, 1], 16, 16, causal_none=True, device="cuda", seed=11)
    assert batch.custom_mask is None
    out, args = _run(batch)
    assert args["tree_mask"] is None
    _check(out, args)


def test_all_false_padding_rows_with_and_without_prefix():
    # DDTree pads unused nodes with all-False rows: with a prefix they see it; with P == 0 they see
    # nothing and must come out as zeros, never NaN.
    batch = make_verify_batch([0, 2000], 8, 33, kind="tree", pad=5, device="cuda", seed=5)
    out, args = _run(batch)
    _check(out, args)
    t0 = slice(33 - 5, 33)  # padding rows of request 0 (P = 0)
    assert (out[t0].float() == 0).all()


def test_ragged_batch():
    prefixes = [65536, 7, 1000, 1] if LARGE else [9000, 7, 1000, 1]
    batch = make_verify_batch(prefixes, 16, 9, kind="tree", pad=1, device="cuda", seed=21)
    out, args = _run(batch)
    _check(out, args)


@pytest.mark.parametrize("requests", [32, 64])
def test_many_work_items_per_block(requests):
    # far more work items than SMs, of 1 to ~100 key tiles each: every block of the persistent grid
    # runs many items back to back, so the split kernels' barrier phases carry across items of every length;
    # 32 requests are the plan kernel's one-warp path at its fullest, 64 its block-wide scan
    prefixes = [int(x) for x in torch.randint(0, 3000, (requests,), generator=torch.Generator().manual_seed(5))]
    batch = make_verify_batch(prefixes, 16, 9, kind="tree", device="cuda", seed=23)
    out, args = _run(batch)
    _check(out, args)


def _rising_scores(batch, prefix, split=0.85):
    """Scale the request's prefix key rows along the prefix: x1 -> x3 over the first `split` of it, x8 -> x10 after.
    Row maxima keep rising by small steps and then jump by ~60 (log2 units) at the boundary."""
    idx = batch.kv_indices
    cut = int(prefix * split)
    scale = torch.cat([torch.linspace(1.0, 3.0, cut), torch.linspace(8.0, 10.0, prefix - cut)]).to(idx.device)
    batch.kv_buffer[idx] = (batch.kv_buffer[idx].float() * scale.view(-1, 1, 1)).to(batch.kv_buffer.dtype)


@pytest.mark.parametrize("tokens", [1, 9, 33])
def test_rising_and_jumping_row_maxima(tokens):
    # the lazy reference maximum (KDTREE_DUAL_LAZY_RESCALE, KDTREE_MMA_LAZY_RESCALE): a row keeps its
    # reference while its maximum rises by less than tau, so P reaches up to 2^tau for many tiles, and moves it when a
    # tile's maximum is far above (here, the 8-10x scaled keys after 85% of the prefix, in some split's middle)
    prefix = 40000
    batch = make_verify_batch([prefix], 16, tokens, kind="tree", device="cuda", seed=31 + tokens)
    _rising_scores(batch, prefix)
    out, args = _run(batch)
    _check(out, args)


def test_empty_request_in_batch():
    batch = make_verify_batch([100, 0, 300], 4, 9, device="cuda", seed=2)
    out, args = _run(batch)
    _check(out, args)


def test_index_dtypes():
    batch = make_verify_batch([3000, 17], 16, 9, device="cuda", seed=8)
    args = batch.verify_args()
    args["kv_indices"] = args["kv_indices"].to(torch.int32)
    args["qo_indptr"] = args["qo_indptr"].to(torch.int64)   # SGLang's dtype under CUDA graphs
    out = kdtree.verify_attention(**args)
    _check(out, args)


def test_gpu_mask_pack_matches_cpu():
    batch = make_verify_batch([50, 0, 7], 2, 70, kind="tree", pad=3, device="cuda", seed=4)
    t = batch.q.shape[0]
    gpu = build_tree_mask(batch.custom_mask, batch.mask_indptr, batch.qo_indptr, batch.kv_indptr, t, 70)
    cpu = build_tree_mask(batch.custom_mask.cpu(), batch.mask_indptr.cpu(), batch.qo_indptr.cpu(),
                          batch.kv_indptr.cpu(), t, 70)
    assert torch.equal(gpu.cpu(), cpu)


def test_the_call_packs_its_own_mask():
    # verify_attention(custom_mask=, mask_indptr=): the plan kernel's blocks 1.. pack the mask into tree_mask (garbage
    # before), bit for bit as build_tree_mask does, and the output is the separately packed call's, bit for bit
    batch = make_verify_batch([5000, 0, 300, 70000], 16, 9, kind="tree", pad=2, device="cuda", seed=61)
    args = batch.verify_args()
    t = batch.q.shape[0]
    ref_out = kdtree.verify_attention(**args)
    _check(ref_out, args)
    pack = dict(custom_mask=batch.custom_mask, mask_indptr=batch.mask_indptr)
    for max_n in (9, 130):   # W = 1 and 3: the words past the drafts are written as zeros
        want = build_tree_mask(batch.custom_mask, batch.mask_indptr, batch.qo_indptr, batch.kv_indptr, t, max_n)
        buf = torch.full_like(want, -1)
        out = kdtree.verify_attention(**dict(args, tree_mask=buf), **pack)
        torch.cuda.synchronize()
        assert torch.equal(buf, want), f"W={want.shape[1]}: the mask packed in the call differs"
        assert torch.equal(out, ref_out), f"W={want.shape[1]}: the output differs from the separately packed call's"
    # reuse_plan: no plan kernel runs, so the pack kernel packs before the split
    ws = kdtree.Workspace()
    kdtree.verify_attention(**args, workspace=ws)
    buf = torch.full_like(args["tree_mask"], -1)
    out = kdtree.verify_attention(**dict(args, tree_mask=buf), workspace=ws, reuse_plan=True, **pack)
    torch.cuda.synchronize()
    assert torch.equal(buf, args["tree_mask"]) and torch.equal(out, ref_out)


def test_the_packing_call_in_a_cuda_graph():
    # captured once, replayed on a new tree in the same custom_mask buffer: the replay packs the new mask
    batch = make_verify_batch([6000, 100], 16, 9, device="cuda", seed=71)
    args = batch.verify_args()
    t, h = batch.q.shape[:2]
    buf = torch.empty_like(args["tree_mask"])
    out = torch.empty(t, h, 512, dtype=torch.bfloat16, device="cuda")

    def packing_call():
        kdtree.verify_attention(**dict(args, tree_mask=buf), out=out, custom_mask=batch.custom_mask,
                                mask_indptr=batch.mask_indptr)

    packing_call()   # warm-up: workspace sized outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        packing_call()
    fresh = make_verify_batch([6000, 100], 16, 9, device="cuda", seed=72)   # same sizes, another random tree
    assert fresh.custom_mask.shape == batch.custom_mask.shape
    batch.custom_mask.copy_(fresh.custom_mask)
    want = build_tree_mask(batch.custom_mask, batch.mask_indptr, batch.qo_indptr, batch.kv_indptr, t, 9)
    assert not torch.equal(want, args["tree_mask"]), "the new tree must differ from the captured one"
    buf.fill_(-1)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(buf, want)
    new_args = dict(args, tree_mask=want)
    _check(out, new_args)
    assert torch.equal(out, kdtree.verify_attention(**new_args)), "graph replay differs from eager"


def _solo_and_in_a_batch(heads, n, seed):
    """One request (20,000-token prefix) alone, and the same request second in a batch of three with the same
    token count: its rows from both calls, and the solo call's arguments."""
    solo = make_verify_batch([20000], heads, n, device="cuda", seed=seed)
    out1, args = _run(solo)
    big = make_verify_batch([500, 20000, 3000], heads, n, device="cuda", seed=seed)
    big_args = big.verify_args()
    lo, hi = int(big.kv_indptr[1]), int(big.kv_indptr[2])
    big.kv_buffer[big.kv_indices[lo:hi]] = solo.kv_buffer[solo.kv_indices]
    big.q[n:2 * n] = solo.q
    big.k[n:2 * n] = solo.k
    big_args["tree_mask"][n:2 * n] = args["tree_mask"]
    out_b = kdtree.verify_attention(**big_args)
    return out1, out_b[n:2 * n], args


def test_deterministic_and_batch_invariant():
    out1, batched, args = _solo_and_in_a_batch(16, 9, seed=9)
    out2 = kdtree.verify_attention(**args)
    assert torch.equal(out1, out2), "two runs on the same inputs differ"
    # the same request inside a batch (other requests around it) gives bit-identical rows
    assert torch.equal(batched, out1), "a request's result depends on its batch mates"


def test_small_row_requests_are_batch_invariant():
    """Requests of <= 16 rows run the small-call kernel (skinny on sm_90a, the 32-row shape on the 2-stage path)
    alone and inside a batch of requests with the same token count: bit-identical rows either way."""
    for heads, n in ((8, 2), (16, 1)):
        out1, batched, _ = _solo_and_in_a_batch(heads, n, seed=21)
        assert torch.equal(batched, out1), f"H{heads} N{n}: a request's result depends on its batch mates"


def test_non_default_stream():
    batch = make_verify_batch([5000, 3], 16, 9, device="cuda", seed=12)
    args = batch.verify_args()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = kdtree.verify_attention(**args)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    _check(out, args)


def _run_in_child(env_over, prefixes, heads, tokens, seed):
    """_run on make_verify_batch(prefixes, heads, tokens, seed=seed) in a child process with env_over set (the
    launcher reads its switches once per process); its output on the CPU."""
    code = (
        "import sys, torch, kdtree\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_kernel_gpu import _run, make_verify_batch\n"   # (the pool type of KDTREE_TEST_KV, inherited)
        f"out, _ = _run(make_verify_batch({prefixes!r}, {heads}, {tokens}, device='cuda', seed={seed}))\n"
        "torch.save(out.cpu(), sys.argv[2])\n"
    )
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "out.pt")
        r = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), path],
                           env=dict(os.environ, **env_over), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return torch.load(path)


def test_programmatic_launch_on_and_off_agree():
    """The call's kernels chained by programmatic dependent launch (default on sm_90+) and launched
    plainly (KDTREE_PDL=0, read once per process: a child process) give bit-identical results."""
    plain = _run_in_child({"KDTREE_PDL": "0"}, [30000, 700], 16, 9, 41)
    out, args = _run(make_verify_batch([30000, 700], 16, 9, device="cuda", seed=41))
    _check(out, args)
    assert torch.equal(out.cpu(), plain), "KDTREE_PDL=0 and the default launch differ"


@pytest.mark.parametrize("heads,tokens", [(16, 9), (5, 9), (128, 2)])
def test_q_by_tma_and_by_copies_agree(heads, tokens):
    """Where the split kernel loads q by TMA (the dual kernel on an H100 / H200, q rows evenly strided), the result
    is bit-identical to its cp.async load (KDTREE_Q_TMA=0, a child process): the same rows reach shared memory,
    whichever rows pad the last tile (zeros, or the next request's)."""
    prefixes = [5000, 300, 0]
    copied = _run_in_child({"KDTREE_Q_TMA": "0"}, prefixes, heads, tokens, 43)
    out, args = _run(make_verify_batch(prefixes, heads, tokens, device="cuda", seed=43))
    _check(out, args)
    assert torch.equal(out.cpu(), copied), "q loaded by TMA and by cp.async give different results"


def test_q_rows_not_evenly_strided():
    """q_nope / q_pe whose token stride is not heads x head stride (here heads 0..15 of a 19-head buffer): no single
    row stride, so the kernel copies q itself; the result still matches the reference."""
    b = make_verify_batch([3000, 70], 16, 9, device="cuda", seed=47)
    wide = torch.randn(b.q.shape[0], 19, 576, dtype=b.q.dtype, device=b.q.device)
    wide[:, :16] = b.q
    q_nope, q_pe = split_mla_q(wide[:, :16])
    assert q_nope.stride(0) != 16 * q_nope.stride(1)
    args = dict(b.verify_args(), q_nope=q_nope, q_pe=q_pe)
    out = torch.full((b.q.shape[0], 16, 512), float("nan"), dtype=torch.bfloat16, device=b.q.device)
    kdtree.verify_attention(**args, out=out)
    _check(out, args)


def test_sm120_pipeline_takes_its_32_row_shape_for_small_requests():
    """The 2-stage mma.sync pipeline (sm_120's, forced with KDTREE_SPLIT_STAGES=2) runs calls of at most 32 rows
    per request (H x T / B <= 32) on its 32-row shape, two score warps per row block; with
    KDTREE_MMA_HALVES=0 on its 48-row kernel. Both must match the reference (child processes: the settings are
    read once per process), and their results must differ somewhere, or the 32-row shape never ran."""
    code = (
        "import sys, torch, kdtree\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_kernel_gpu import _run, _check\n"
        "from kdtree.synthetic import make_verify_batch\n"
        "outs = []\n"
        "for prefixes, heads, n in (([20000], 16, 1), ([3000, 0, 700], 8, 2), ([5000], 1, 16), ([40, 900], 32, 1)):\n"
        "    out, args = _run(make_verify_batch(prefixes, heads, n, device='cuda', seed=43))\n"
        "    _check(out, args)\n"
        "    outs.append(out.cpu())\n"
        "torch.save(outs, sys.argv[2])\n"
    )
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for halves in ("1", "0"):
            path = os.path.join(d, f"out{halves}.pt")
            env = dict(os.environ, KDTREE_SPLIT_STAGES="2", KDTREE_MMA_HALVES=halves)
            r = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), path],
                               env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-2000:]
            results[halves] = torch.load(path)
    assert any(not torch.equal(a, b) for a, b in zip(results["1"], results["0"])), \
        "the 32-row and 48-row shapes gave bit-identical results on every case: the 32-row shape did not run"


def test_cuda_graph_capture_and_replay():
    batch = make_verify_batch([6000, 100], 16, 9, device="cuda", seed=13)
    args = batch.verify_args()
    t, h = batch.q.shape[:2]
    out = torch.empty(t, h, 512, dtype=torch.bfloat16, device="cuda")
    kdtree.verify_attention(**args, out=out)      # warm-up: workspace sized outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kdtree.verify_attention(**args, out=out)
    # new values in the same buffers, then replay
    fresh = make_verify_batch([6000, 100], 16, 9, device="cuda", seed=14)
    args["q_nope"].copy_(split_mla_q(fresh.q)[0])
    args["q_pe"].copy_(split_mla_q(fresh.q)[1])
    batch.kv_buffer.copy_(fresh.kv_buffer)
    args["kv_indices"].copy_(fresh.kv_indices)
    args["k_new"].copy_(fresh.k[:, 0])
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    _check(out, args)
    eager = kdtree.verify_attention(**args)
    assert torch.equal(eager, out), "graph replay differs from eager"


def _layers(count, seed):
    """``count`` verify batches with the same request lengths (the metadata one forward pass shares) but
    their own q, KV values and slot ids, as the layers of one pass see them: 64 requests of up to 3000
    keys and one of 40,000, i.e. well over one work item per SM, so that blocks claim items from the
    plan's counter."""
    prefixes = [int(x) for x in torch.randint(0, 3000, (64,), generator=torch.Generator().manual_seed(seed))]
    prefixes.append(40000)
    return [make_verify_batch(prefixes, 16, 9, kind="tree", device="cuda", seed=seed + i) for i in range(count)]


def test_reused_plan_serves_the_later_layers_of_a_pass():
    # layer 0 plans into the caller's workspace, layers 1-3 run on that plan (no plan kernel): every
    # layer's output must equal a call that plans for itself, bit for bit. A work counter left at its end
    # value by the previous layer would skip most items (NaN rows); the combine resets it.
    ws = kdtree.Workspace()
    for i, batch in enumerate(_layers(4, seed=31)):
        out, args = _run(batch, workspace=ws, reuse_plan=i > 0)
        _check(out, args)
        assert torch.equal(out, kdtree.verify_attention(**args)), f"layer {i}: the reused plan's result differs"


def test_reused_plan_in_a_cuda_graph():
    # a captured pass: layer 0's plan kernel and layers 1-2 without one, replayed twice on new values
    layers = _layers(3, seed=51)
    ws = kdtree.Workspace()
    argss = [b.verify_args() for b in layers]
    t, h = layers[0].q.shape[:2]
    outs = [torch.empty(t, h, 512, dtype=torch.bfloat16, device="cuda") for _ in layers]
    for i, (args, out) in enumerate(zip(argss, outs)):   # eager warm-up sizes the workspace
        kdtree.verify_attention(**args, out=out, workspace=ws, reuse_plan=i > 0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i, (args, out) in enumerate(zip(argss, outs)):
            kdtree.verify_attention(**args, out=out, workspace=ws, reuse_plan=i > 0)
    for rep in range(2):
        for b in layers:
            b.q.copy_(torch.randn_like(b.q))
        for out in outs:
            out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for i, (args, out) in enumerate(zip(argss, outs)):
            _check(out, args)
            assert torch.equal(out, kdtree.verify_attention(**args)), f"replay {rep}, layer {i} differs from eager"


@pytest.mark.parametrize("fill", [0x01, 0xFF])
@pytest.mark.parametrize("tokens", [1, 9])
def test_a_fresh_workspace_may_hold_anything(fill, tokens):
    # the combine starts while the split pass runs and waits for each row tile's items on counters in the
    # workspace (tile_done): the plan kernel zeroes them, whatever an uninitialised buffer holds (0x01 bytes:
    # counters already past every target, so a missing zeroing reads partials before they are written; 0xFF:
    # negative, it would never see them all), and every call leaves them zero for the next (a second call on
    # the plan, with new values, must wait for its own items again)
    batch = make_verify_batch([20000, 3000], 16, tokens, device="cuda", seed=61 + tokens)
    args = batch.verify_args()
    t, h = batch.q.shape[:2]
    need = kdtree._ext.load().workspace_size(2, t, h)
    ws = torch.full((need,), fill, dtype=torch.uint8, device="cuda")
    out, _ = _run(batch, workspace=ws)
    _check(out, args)
    batch.q.copy_(torch.randn_like(batch.q))
    args = batch.verify_args()
    out2, _ = _run(batch, workspace=ws, reuse_plan=True)
    _check(out2, args)
    assert torch.equal(out2, kdtree.verify_attention(**args)), "the reused plan's result differs"


def test_tree_mask_narrower_than_the_drafts_is_never_read_past():
    # 70 drafts but a 1-word (64-column) mask: the host cannot see N_b without a sync, so the kernel
    # must treat drafts 64.. as invisible rather than read past the mask row (memory safety).
    batch = make_verify_batch([500, 300], 4, 70, kind="deep", device="cuda", seed=31)
    args = batch.verify_args()
    wide = args["tree_mask"]                      # [T, 2] words
    assert wide.shape[1] == 2
    narrow = wide[:, :1].contiguous()
    out = kdtree.verify_attention(**dict(args, tree_mask=narrow))
    expect_args = dict(args, tree_mask=torch.stack([wide[:, 0], torch.zeros_like(wide[:, 1])], dim=1))
    _check(out, expect_args)


def test_the_fastest_split_kernel_is_selected():
    """sm_90 (built as sm_90a by default) runs the dual-score wgmma kernel, everything else mma.sync;
    the environment overrides select the other code paths (for measuring them on an H100/H200)."""
    from kdtree import _ext

    got = _ext.load().split_kernel()
    cc = torch.cuda.get_device_capability()
    if os.environ.get("KDTREE_SPLIT_STAGES") == "2":
        assert got == "mma.sync-2stage"
    elif cc == (9, 0) and os.environ.get("KDTREE_SPLIT_KERNEL") == "skinny":
        assert got == "wgmma-skinny"
    elif cc == (9, 0) and os.environ.get("KDTREE_SPLIT_KERNEL") != "mma":
        assert got == "wgmma-dual", "an sm_90 GPU should run the sm_90a wgmma kernel (built with KDTREE_SM90A=OFF?)"
    elif cc == (9, 0):
        assert got == "mma.sync-3stage"
    elif cc[0] == 12:
        assert got == "mma.sync-2stage"   # 99 KB of shared memory per block
    else:
        assert got.startswith("mma.sync")
    # per call (B, T, H): calls of <= 16 rows per request (T a multiple of B, H * T / B <= 16) run the skinny kernel
    # where the device runs the dual one (unless KDTREE_SKINNY=0), those of <= 32 the 32-row shape where it runs the
    # 2-stage mma.sync kernel (unless KDTREE_MMA_HALVES=0); a T that is not a multiple of B, the device's kernel
    ext = _ext.load()
    le16 = [(1, 1, 16), (2, 2, 16), (1, 2, 8), (1, 16, 1), (3, 6, 8), (5, 45, 1)]
    le32 = [(1, 2, 16), (2, 4, 16), (1, 1, 32), (4, 16, 8)]
    large = [(1, 1, 33), (2, 6, 16), (1, 1, 128), (3, 5, 4), (2, 3, 1), (1, 2, 48)]
    small16 = small32 = got
    if got == "wgmma-dual" and os.environ.get("KDTREE_SKINNY") != "0":
        small16 = "wgmma-skinny"
    if got == "mma.sync-2stage" and os.environ.get("KDTREE_MMA_HALVES") != "0":
        small16 = small32 = "mma.sync-2stage-32row"
    for sizes, expect in [(le16, small16), (le32, small32), (large, got)]:
        for b, t, h in sizes:
            assert ext.split_kernel(b, t, h) == expect, (b, t, h)
