"""kdtree.layout: the tree-mask packer against a brute-force decoding of SGLang's flat custom_mask,
and the q / KV-pool helpers (views, never copies)."""

import random
import zlib

import pytest
import torch

from kdtree import build_tree_mask, kv_cache_2d, split_mla_q
from kdtree.layout import mask_words


# ------------------------------------------------------------------ brute force (pure Python)

def expected_words(custom_mask, mask_indptr, qo_indptr, kv_indptr, num_tokens, words):
    """Decode SGLang's layout element by element: M(b,i,j) = mask[mask_indptr[b] + i*(P+N) + j],
    keep the draft columns j in [P, P+N), pack bit (j-P) of word (j-P)//64, as signed int64."""
    cm = [int(x) for x in custom_mask.tolist()]
    mi, qo, kv = mask_indptr.tolist(), qo_indptr.tolist(), kv_indptr.tolist()
    rows = [[0] * words for _ in range(num_tokens)]
    for b in range(len(qo) - 1):
        n_b, p_b = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        for i in range(n_b):
            for j in range(n_b):
                if cm[mi[b] + i * (p_b + n_b) + p_b + j] != 0:
                    rows[qo[b] + i][j // 64] |= 1 << (j % 64)
    signed = [[w - (1 << 64) if w >= (1 << 63) else w for w in row] for row in rows]
    return torch.tensor(signed, dtype=torch.int64).reshape(num_tokens, words)


def tree_block(n, kind, rng, num_padding=0):
    """[n, n] draft visibility: 'tree' random parents before children, 'chain', 'star',
    'random' (arbitrary bits, also above the diagonal: the packer must copy every column)."""
    if kind == "random":
        return [[rng.random() < 0.5 for _ in range(n)] for _ in range(n)]
    vis = [[False] * n for _ in range(n)]
    for i in range(n - num_padding):
        if i > 0:
            parent = {"tree": rng.randrange(i), "chain": i - 1, "star": 0}[kind]
            vis[i] = list(vis[parent])
        vis[i][i] = True
    return vis


def make_layout(ns, ps, kind, *, seed, mask_dtype=torch.bool, qo_dtype=torch.int32, tail=0,
                num_padding=0, prefix_value=True):
    """SGLang's flat custom_mask for requests with N_b = ns[b] drafts and P_b = ps[b] prefix keys."""
    rng = random.Random(seed)
    flat = []
    for n, p in zip(ns, ps):
        block = tree_block(n, kind, rng, min(num_padding, max(n - 1, 0)))
        for i in range(n):
            live = any(block[i])
            # prefix columns: set for live rows, all-False padding rows are all-False there too;
            # prefix_value=False leaves them 0 everywhere (the packer must not read them)
            flat += [1 if (live and prefix_value) else 0] * p
            flat += [1 if x else 0 for x in block[i]]
    # graph buffers are longer than mask_indptr[B]; fill the tail with ones so a read past the
    # blocks shows up as a set bit
    flat += [1] * tail
    if mask_dtype == torch.uint8:
        # any nonzero byte means "may attend"
        flat = [rng.choice((1, 2, 255)) if x else 0 for x in flat]
    custom_mask = torch.tensor(flat, dtype=torch.uint8).to(mask_dtype)

    def indptr(lengths, dtype):
        return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(dtype)

    mask_indptr = indptr([n * (p + n) for n, p in zip(ns, ps)], torch.int64)
    return custom_mask, mask_indptr, indptr(ns, qo_dtype), indptr(ps, torch.int32)


CASES = [
    # (ns, ps, kind, padding)
    ([1], [0], "tree", 0),
    ([1], [5], "chain", 0),
    ([9], [17], "tree", 2),
    ([9], [0], "tree", 2),
    ([16], [3], "chain", 0),
    ([33], [70], "tree", 5),
    ([33], [1], "star", 0),
    ([64], [2], "chain", 0),          # the last bit of word 0 is the int64 sign bit
    ([65], [1], "random", 0),         # one bit into word 1
    ([9, 9, 9], [100, 0, 7], "tree", 2),
    ([3, 12, 1, 7], [4, 0, 9, 1], "random", 0),  # ragged
    ([5, 0, 4], [3, 2, 0], "tree", 0),           # an empty request in the middle
    ([200], [3], "tree", 10),          # 4 words
    ([130, 70], [1, 12], "random", 0),
]


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
@pytest.mark.parametrize("qo_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("ns,ps,kind,padding", CASES)
def test_build_tree_mask_matches_brute_force(ns, ps, kind, padding, mask_dtype, qo_dtype):
    seed = zlib.crc32(repr((ns, ps, kind, str(mask_dtype), str(qo_dtype))).encode())
    custom_mask, mask_indptr, qo_indptr, kv_indptr = make_layout(
        ns, ps, kind, seed=seed, mask_dtype=mask_dtype, qo_dtype=qo_dtype, tail=777, num_padding=padding)
    T, max_n = sum(ns), max(ns)
    got = build_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, T, max_n)
    want = expected_words(custom_mask, mask_indptr, qo_indptr, kv_indptr, T, (max_n + 63) // 64)
    assert got.dtype == torch.int64 and got.shape == (T, (max_n + 63) // 64)
    assert torch.equal(got, want)


def test_build_tree_mask_all_false_rows_and_prefix_columns_ignored():
    ns, ps = [9, 9], [4, 11]
    custom_mask, mask_indptr, qo_indptr, kv_indptr = make_layout(
        ns, ps, "tree", seed=3, num_padding=3, prefix_value=False)
    got = build_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, 18, 9)
    for base in (0, 9):
        assert got[base + 6:base + 9].eq(0).all()          # the padding rows
        assert (got[base:base + 6] != 0).all()              # live rows see at least themselves
    # now set every prefix column: the packed mask must not change
    flat = custom_mask.clone()
    for b, (n, p) in enumerate(zip(ns, ps)):
        for i in range(n):
            start = int(mask_indptr[b]) + i * (p + n)
            flat[start:start + p] = True
    assert torch.equal(build_tree_mask(flat, mask_indptr, qo_indptr, kv_indptr, 18, 9), got)


def test_build_tree_mask_wider_than_needed_has_zero_high_words():
    custom_mask, mask_indptr, qo_indptr, kv_indptr = make_layout([7, 5], [3, 3], "random", seed=5, tail=100)
    got = build_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, 12, 300)  # W = 5
    assert got.shape == (12, 5)
    assert got[:, 1:].eq(0).all()
    assert torch.equal(got, expected_words(custom_mask, mask_indptr, qo_indptr, kv_indptr, 12, 5))
    # bits at j >= N_b are zero even though the buffer continues with ones
    assert (got[7:, 0] >> 5).eq(0).all() and (got[:7, 0] >> 7).eq(0).all()


def test_build_tree_mask_full_rows_set_the_sign_bit():
    n = 128
    flat = torch.ones(n * n, dtype=torch.bool)
    mask_indptr = torch.tensor([0, n * n], dtype=torch.int64)
    qo = torch.tensor([0, n], dtype=torch.int64)
    kv = torch.tensor([0, 0], dtype=torch.int32)
    got = build_tree_mask(flat, mask_indptr, qo, kv, n, n)
    assert got.eq(-1).all()  # all 64 bits of both words


def test_build_tree_mask_none_is_causal():
    qo = torch.tensor([0, 4], dtype=torch.int32)
    assert build_tree_mask(None, None, qo, qo, 4, 4) is None


def test_build_tree_mask_rejects_bad_input():
    custom_mask, mask_indptr, qo_indptr, kv_indptr = make_layout([9], [3], "tree", seed=1)
    with pytest.raises(TypeError, match="custom_mask must be bool or uint8, got torch.int32"):
        build_tree_mask(custom_mask.int(), mask_indptr, qo_indptr, kv_indptr, 9, 9)
    with pytest.raises(ValueError, match="custom_mask must be 1-D"):
        build_tree_mask(custom_mask.view(9, -1), mask_indptr, qo_indptr, kv_indptr, 9, 9)
    with pytest.raises(TypeError, match="qo_indptr must be torch.int32 or torch.int64, got torch.float32"):
        build_tree_mask(custom_mask, mask_indptr, qo_indptr.float(), kv_indptr, 9, 9)
    long_mask, long_mi, long_qo, long_kv = make_layout([65], [2], "chain", seed=1)
    with pytest.raises(ValueError, match=r"max_n gives 1 mask words \(64 draft tokens\) but a request has 65"):
        build_tree_mask(long_mask, long_mi, long_qo, long_kv, 65, 64)
    with pytest.raises(ValueError, match=r"max_n must be in \[1, 512\]"):
        build_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, 9, 513)
    with pytest.raises(ValueError, match="max_n must be in"):
        build_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, 9, 0)
    with pytest.raises(ValueError, match="must equal num_tokens=10"):
        build_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, 10, 9)
    with pytest.raises(ValueError, match="must all be"):
        build_tree_mask(custom_mask, mask_indptr, qo_indptr[:1], kv_indptr, 9, 9)
    with pytest.raises(ValueError, match="mask_indptr does not delimit"):
        build_tree_mask(custom_mask[:50], mask_indptr, qo_indptr, kv_indptr, 9, 9)
    with pytest.raises(ValueError, match="kv_indptr is on meta but custom_mask is on cpu"):
        build_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr.to("meta"), 9, 9)


def test_mask_words():
    assert [mask_words(n) for n in (1, 63, 64, 65, 128, 129, 512)] == [1, 1, 1, 2, 2, 3, 8]


# ------------------------------------------------------------------ views

def test_split_mla_q_returns_views():
    q = torch.randn(5, 3, 576).to(torch.bfloat16)
    q_nope, q_pe = split_mla_q(q)
    assert q_nope.shape == (5, 3, 512) and q_pe.shape == (5, 3, 64)
    assert q_nope.data_ptr() == q.data_ptr()
    assert q_pe.data_ptr() == q.data_ptr() + 512 * q.element_size()
    assert q_nope.stride() == q.stride() == q_pe.stride()
    q[2, 1, 513] = 7.0
    assert q_pe[2, 1, 1].item() == 7.0  # shares storage, no copy
    assert torch.equal(torch.cat([q_nope, q_pe], -1), q)


def test_split_mla_q_rejects_bad_input():
    with pytest.raises(TypeError, match="q must be bfloat16, got torch.float16"):
        split_mla_q(torch.zeros(2, 1, 576, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"q must be \[T, H, 576\], got shape \(2, 512\)"):
        split_mla_q(torch.zeros(2, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        split_mla_q(torch.zeros(2, 1, 1152, dtype=torch.bfloat16)[..., ::2])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        split_mla_q([1.0])


@pytest.mark.parametrize("shape", [(37, 1, 576), (37, 576)])
def test_kv_cache_2d_is_a_view(shape):
    buf = torch.randn(shape).to(torch.bfloat16)
    kv = kv_cache_2d(buf)
    assert kv.shape == (37, 576) and kv.stride() == (576, 1)
    assert kv.data_ptr() == buf.data_ptr()
    assert kv.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    buf.view(37, 576)[11, 500] = 3.0
    assert kv[11, 500].item() == 3.0


def test_kv_cache_2d_keeps_a_padded_row_stride():
    big = torch.zeros(10, 1, 640, dtype=torch.bfloat16)
    kv = kv_cache_2d(big[..., :576])
    assert kv.stride() == (640, 1) and kv.data_ptr() == big.data_ptr()


def test_kv_cache_2d_rejects_bad_input():
    with pytest.raises(TypeError, match="key_buffer must be bfloat16 or float8_e4m3fn, got torch.float8_e5m2"):
        kv_cache_2d(torch.zeros(4, 1, 576).to(torch.float8_e5m2))
    assert kv_cache_2d(torch.zeros(4, 1, 576).to(torch.float8_e4m3fn)).shape == (4, 576)
    with pytest.raises(ValueError, match=r"got shape \(4, 2, 576\)"):
        kv_cache_2d(torch.zeros(4, 2, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"got shape \(4, 512\)"):
        kv_cache_2d(torch.zeros(4, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"got shape \(576,\)"):
        kv_cache_2d(torch.zeros(576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        kv_cache_2d(torch.zeros(576, 4, dtype=torch.bfloat16).t())


# ------------------------------------------------------------------ CUDA packer

@pytest.mark.gpu
@pytest.mark.parametrize("qo_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
@pytest.mark.parametrize("ns,ps,kind,padding", CASES)
def test_build_tree_mask_cuda_matches_cpu(ns, ps, kind, padding, mask_dtype, qo_dtype):
    custom_mask, mask_indptr, qo_indptr, kv_indptr = make_layout(
        ns, ps, kind, seed=11, mask_dtype=mask_dtype, qo_dtype=qo_dtype, tail=4096, num_padding=padding)
    T, max_n = sum(ns), max(ns)
    want = build_tree_mask(custom_mask, mask_indptr, qo_indptr, kv_indptr, T, max_n)
    dev = [t.cuda() for t in (custom_mask, mask_indptr, qo_indptr, kv_indptr)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the CUDA path must never synchronise with the host
    try:
        got = build_tree_mask(*dev, T, max_n)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), want)
