"""The FP8 kernel (e4m3 pools) and the scaled bf16 kernel on a GPU, beyond the kernel grid that KDTREE_TEST_KV=e4m3
runs through tests/test_kernel_gpu.py: which kernel a call runs, KV scales, large queries, and the accuracy against
SGLang's fp8 numerics (the model of tests/fp8_model.py) on the same inputs.
"""

import os

import pytest
import torch

import kdtree
from kdtree import _ext
from kdtree.reference import verify_attention_reference
from kdtree.synthetic import make_verify_batch

from fp8_model import sglang_fp8

pytestmark = pytest.mark.gpu

E4M3 = torch.float8_e4m3fn


def _rel(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def _run(args, **kw):
    t, h = args["q_nope"].shape[:2]
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device=args["q_nope"].device)
    kdtree.verify_attention(**args, out=out, **kw)
    assert torch.isfinite(out).all(), "NaN/Inf in the output (an unwritten element, or a poisoned slot read)"
    return out


FP8_KERNELS = ("mma.sync-fp8", "mma.sync-scaled", "wgmma-dual-fp8", "wgmma-skinny-fp8", "wgmma-skinny-fp8-32row")


def test_calls_run_the_fp8_and_scaled_kernels():
    ext = _ext.load()
    # e4m3: the dual kernel's FP8 form where the device runs the dual kernel (sm_90a), the skinny kernel's where it
    # runs that, else the sm_120 code path; calls of <= 16 rows per request take the skinny FP8 kernel beside the dual,
    # of 17 to 32 its 32-row form
    device = ext.split_kernel()
    fp8 = {"wgmma-dual": "wgmma-dual-fp8", "wgmma-skinny": "wgmma-skinny-fp8"}.get(device, "mma.sync-fp8")
    skinny = device == "wgmma-dual" and os.environ.get("KDTREE_SKINNY") != "0"
    small = "wgmma-skinny-fp8" if skinny else fp8
    pair = "wgmma-skinny-fp8-32row" if skinny else fp8
    for (b, t, h), want in [((1, 9, 16), fp8), ((4, 36, 16), fp8), ((2, 3, 128), fp8), ((3, 5, 4), fp8),
                            ((1, 3, 11), fp8), ((1, 1, 16), small), ((1, 2, 8), small), ((3, 6, 8), small),
                            ((5, 45, 1), small), ((1, 4, 8), pair), ((1, 2, 16), pair), ((2, 6, 6), pair),
                            ((4, 16, 8), pair)]:
        assert ext.split_kernel(b, t, h, ext.KV_E4M3) == want, (b, t, h)
        assert ext.split_kernel(b, t, h, ext.KV_E4M3, True) == want, (b, t, h)
        assert ext.split_kernel(b, t, h, ext.KV_BF16, True) == "mma.sync-scaled"
        assert ext.split_kernel(b, t, h, ext.KV_BF16) not in FP8_KERNELS


# (H, N): 144 rows a request (the dual kernel's FP8 form on sm_90a), 16 and 8 (its skinny FP8 kernel), 32 and 20 (the
# 32-row form: both consumer warpgroups full, the second with 4 rows)
SHAPES = [(16, 9), (16, 1), (4, 2), (8, 4), (5, 4)]


@pytest.mark.parametrize("kv", ["e4m3", "bf16"])
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.37, 2.5), (4.0, 0.125)])
@pytest.mark.parametrize("prefixes", [[0], [1], [700], [5000, 33, 0, 2100]])
@pytest.mark.parametrize("heads, n", SHAPES)
def test_kv_scales(kv, k_scale, v_scale, prefixes, heads, n):
    dtype = E4M3 if kv == "e4m3" else torch.bfloat16
    batch = make_verify_batch(prefixes, heads, n, kind="tree", pad=1 if n > 1 else 0, device="cuda",
                              seed=len(prefixes) * 7 + prefixes[0] + n, kv_dtype=dtype)
    args = batch.verify_args()
    out = _run(args, k_scale=k_scale, v_scale=v_scale)
    ref = verify_attention_reference(**args, k_scale=k_scale, v_scale=v_scale)
    tol = 3e-2 if kv == "e4m3" else 1e-2
    assert _rel(out, ref) < tol
    if (k_scale, v_scale) != (1.0, 1.0) and sum(prefixes) > 0:   # the scales are applied, not ignored
        unscaled = verify_attention_reference(**args)
        assert _rel(out, unscaled) > 5 * _rel(out, ref)


@pytest.mark.parametrize("qscale", [1e-3, 1.0, 30.0, 1e3])
@pytest.mark.parametrize("heads, n", SHAPES)
def test_large_and_small_queries_stay_finite_and_accurate(qscale, heads, n):
    # |q| up to ~4e3 (N(0, 1) x 1e3): SGLang's unscaled e4m3 cast of q saturates there; the row-scaled split does not
    batch = make_verify_batch([3000, 17], heads, n, kind="tree", device="cuda", seed=int(qscale * 10) + 1 + n,
                              kv_dtype=E4M3)
    batch.q = (batch.q.float() * qscale).to(torch.bfloat16)
    args = batch.verify_args()
    out = _run(args)
    ref = verify_attention_reference(**args)
    # at qscale 1e3 a row's scores span ~1e3 in log2 units, so a relative error of 1e-5 in a score moves its weight by
    # ~1%: the dual kernel's FP8 form (e4m3 wgmma, whose accumulator keeps fewer bits than fp32) measures 5.4e-2 to
    # 9.7e-2 there over 8 inputs on an H100 (6.5e-2 on this one); SGLang's saturated cast of q, 1.1 to 1.2 on the same
    # inputs (test_more_accurate_than_sglang_fp8). The bound catches a wrong scale, not the last digit.
    assert _rel(out, ref) < (1.5e-1 if qscale == 1e3 else 3e-2)


@pytest.mark.parametrize("prefixes, heads, n, qscale", [
    ([64], 16, 9, 1.0), ([1000], 16, 9, 1.0), ([4000], 16, 9, 1.0), ([2000, 300], 8, 9, 1.0), ([1000], 16, 33, 1.0),
    ([1000], 16, 9, 30.0), ([4000], 16, 1, 1.0), ([2000, 300], 8, 2, 1.0), ([1000], 16, 1, 30.0),
    ([3000, 17], 16, 9, 1e3),
])
def test_more_accurate_than_sglang_fp8(prefixes, heads, n, qscale):
    """The kernel's error against the float64 reference on the dequantised pool does not exceed SGLang's (its fp8
    numerics, tests/fp8_model.py) on the same inputs."""
    batch = make_verify_batch(prefixes, heads, n, kind="tree", device="cuda", seed=sum(prefixes) + n, kv_dtype=E4M3)
    batch.q = (batch.q.float() * qscale).to(torch.bfloat16)
    args = batch.verify_args()
    out = _run(args)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    ref = verify_attention_reference(**cpu, dtype=torch.float64)
    q = batch.q.cpu()
    sg = sglang_fp8(q, cpu["kv_cache"], cpu["kv_indptr"], cpu["kv_indices"], cpu["qo_indptr"], cpu["k_new"],
                    cpu["tree_mask"], cpu["sm_scale"])
    mine, theirs = _rel(out.cpu(), ref), _rel(sg, ref)
    assert mine <= theirs, f"kdtree {mine:.3e} > SGLang's fp8 numerics {theirs:.3e}"


@pytest.mark.parametrize("heads, n", SHAPES)
def test_fp8_graph_replay_and_batch_invariance(heads, n):
    # one request alone and inside a batch of requests with its token count: bit for bit (batch invariance); and the
    # same call replayed from a CUDA graph on fresh inputs of the same shapes
    solo = make_verify_batch([2500], heads, n, kind="tree", device="cuda", seed=41, kv_dtype=E4M3)
    big = make_verify_batch([700, 2500, 90], heads, n, kind="tree", device="cuda", seed=42, kv_dtype=E4M3)
    lo, hi = 700, 700 + 2500
    big.kv_buffer[big.kv_indices[lo:hi]] = solo.kv_buffer[solo.kv_indices]
    big.q[n:2 * n] = solo.q
    big.k[n:2 * n] = solo.k
    big.custom_mask[big.mask_indptr[1]:big.mask_indptr[2]] = solo.custom_mask
    a_solo, a_big = solo.verify_args(), big.verify_args()
    o_solo, o_big = _run(a_solo), _run(a_big)
    assert torch.equal(o_solo, o_big[n:2 * n])

    ws = kdtree.Workspace()
    out = torch.empty_like(o_big)
    kdtree.verify_attention(**a_big, out=out, workspace=ws)   # warm-up sizes the workspace
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kdtree.verify_attention(**a_big, out=out, workspace=ws)
    gen = torch.Generator(device="cuda").manual_seed(43)   # fresh values in the same tensors
    big.q.copy_(torch.randn(big.q.shape, generator=gen, device="cuda"))
    big.k.copy_(torch.randn(big.k.shape, generator=gen, device="cuda"))
    idx = big.kv_indices
    big.kv_buffer[idx] = torch.randn((idx.numel(), 1, 576), generator=gen, device="cuda").to(E4M3)
    g.replay()
    torch.cuda.synchronize()
    ref = verify_attention_reference(**big.verify_args())
    assert _rel(out, ref) < 3e-2


@pytest.mark.parametrize("heads, n", SHAPES)
def test_fp8_reused_plan_reads_what_the_kernels_before_it_wrote(heads, n):
    # A captured pass of three layers, layers 1 and 2 on layer 0's plan, where an FP8 call's prep kernel splits only q.
    # Each layer's pool rows, slot ids, drafts and (last, right before the call) q are copied in inside the graph, so
    # the split kernel must read the keys those copies wrote and this layer's q terms, not the last layer's still in
    # the workspace: every output must equal an eager call that plans for itself, bit for bit.
    prefixes = [6000, 300]
    live = make_verify_batch(prefixes, heads, n, kind="tree", device="cuda", seed=80, kv_dtype=E4M3)
    layers = [make_verify_batch(prefixes, heads, n, kind="tree", device="cuda", seed=81 + i, kv_dtype=E4M3)
              for i in range(3)]
    for b in layers:   # one pass: the same metadata and tree, each layer its own values and slots
        assert torch.equal(b.kv_indptr, live.kv_indptr) and b.kv_buffer.shape == live.kv_buffer.shape
        b.custom_mask = live.custom_mask
    args = live.verify_args()   # views of live's tensors
    outs = [torch.empty(live.q.shape[0], heads, 512, dtype=torch.bfloat16, device="cuda") for _ in layers]
    ws = kdtree.Workspace()

    def one_pass():
        for i, (b, out) in enumerate(zip(layers, outs)):
            live.kv_buffer.copy_(b.kv_buffer)
            live.kv_indices.copy_(b.kv_indices)
            live.k.copy_(b.k)
            live.q.copy_(b.q)
            kdtree.verify_attention(**args, out=out, workspace=ws, reuse_plan=i > 0)

    one_pass()   # eager warm-up sizes the workspace
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        one_pass()
    wants = [kdtree.verify_attention(**b.verify_args()) for b in layers]
    for rep in range(3):
        for out in outs:
            out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for i, (want, out) in enumerate(zip(wants, outs)):
            assert torch.equal(out, want), f"replay {rep}, layer {i} differs"


@pytest.mark.parametrize("page_size, shuffle", [(64, True), (64, False), (3, True)])
@pytest.mark.parametrize("heads, n", SHAPES)
def test_paged_pools_match_shuffled_slots(page_size, shuffle, heads, n):
    """Pools whose consecutive keys sit in consecutive slots (SGLang's 64-token pages, drawn at random or in order; 3-slot
    pages, whose runs of consecutive slots break at odd and even keys alike): the result within the reference's
    tolerance, and bit for bit the result of the same keys in shuffled slots of another pool, whatever a kernel makes of
    the runs. Every slot a call must not read holds the e4m3 NaN, so a copy past a request's last key shows as NaN."""
    prefixes = [4097, 63, 0, 1000]   # odd and even ends, an empty prefix, a request shorter than a page
    batch = make_verify_batch(prefixes, heads, n, kind="tree", pad=1 if n > 1 else 0, device="cuda",
                              seed=page_size + heads + n, kv_dtype=E4M3, page_size=page_size, shuffle=shuffle)
    args = batch.verify_args()
    out = _run(args)
    assert _rel(out, verify_attention_reference(**args)) < 3e-2
    gen = torch.Generator(device="cuda").manual_seed(5)
    slots = batch.kv_buffer.shape[0]
    moved_idx = torch.randperm(slots - 1, generator=gen, device="cuda")[:batch.kv_indices.numel()] + 1
    moved = torch.full((slots, 1, 576), 0x7F, dtype=torch.uint8, device="cuda").view(E4M3)
    moved[moved_idx] = batch.kv_buffer[batch.kv_indices]
    moved_args = dict(args, kv_cache=moved.view(slots, 576), kv_indices=moved_idx)
    assert torch.equal(out, _run(moved_args))
