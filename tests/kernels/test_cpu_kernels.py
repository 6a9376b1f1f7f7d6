"""The native CPU kernels (kernels/cpu): built here, checked against float64 numpy or their jnp references,
picked only where they apply, and a served model with them against one without."""

from __future__ import annotations

import concurrent.futures
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu
from kernels.backend import KernelBackends, use_kernels
from tests.helpers import LOGPROB_ATOL, greedy


def test_builds_where_a_compiler_exists():
    # CI and this machine have a C++ compiler: a failed build must fail here, not quietly fall back.
    assert shutil.which("c++") or shutil.which("g++")
    assert cpu.available(), "the CPU matmul kernel did not build (see the warning logged above)"


def _reference64(x, w, transpose_w):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x64 @ (w64.T if transpose_w else w64)


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (2, 5, 3), (3, 33, 70), (4, 1536, 576), (1, 100, 4097),
                                   (4, 17, 16), (1, 1, 1),
                                   # the register-tiled GEMM ([k, n], 5+ rows): row tiles of 8 and their
                                   # tails, column tiles of 48, 32 and 16 and a scalar tail, blocks of 32
                                   # weight rows and a short one, chunks split over the threads
                                   (32, 576, 1536), (5, 33, 70), (13, 100, 113), (64, 1536, 96), (9, 7, 49),
                                   # the [n, k] GEMM (17+ rows): 2, 3 and 4 vectors of rows (without
                                   # AVX-512 XLA's dot from 33), whole tiles of columns and single ones,
                                   # a tail of k past a cache line
                                   (17, 33, 70), (40, 100, 113), (64, 40, 51), (63, 17, 26)])
def test_matches_float64(m, k, n, transpose_w):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k) if transpose_w else (k, n), dtype=np.float32)
    got = np.asarray(jax.jit(lambda x, w: cpu.matmul_native(x, w, transpose_w=transpose_w))(x, w))
    want = _reference64(x, w, transpose_w)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (2, 5, 3), (3, 33, 70), (4, 1536, 576), (1, 100, 4097)])
def test_bf16_weights_match_float64(m, k, n, transpose_w):
    """bf16 weights (a bfloat16 model's), widened as read, times x rounded to bf16 (as the reference rounds
    it): the exact products of those bf16 numbers summed in f32, against float64 sums of the same numbers."""
    rng = np.random.default_rng(m * 1000 + k + n)
    shape = (n, k) if transpose_w else (k, n)
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)).astype(jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(jnp.bfloat16)
    native = jax.jit(lambda x, w: cpu.matmul_native(x, w, transpose_w=transpose_w))
    got = np.asarray(native(x, w))
    assert got.dtype == np.float32
    want = _reference64(np.asarray(x, np.float32), np.asarray(w, np.float32), transpose_w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    # an f32 x is rounded to bf16 first, as the reference does
    x32 = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    np.testing.assert_allclose(np.asarray(native(x32, w)),
                               np.asarray(cpu.matmul_reference(x32, w, transpose_w=transpose_w)),
                               rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_inside_a_layer_scan_with_switched_weights():
    """How the models call it: a `lax.switch` picks each layer's weights inside a `lax.scan`."""
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((64, 64), dtype=np.float32) / 8) for _ in range(3)]

    def run(matmul):
        def body(x, i):
            return jax.lax.switch(i, [lambda x, w=w: jnp.tanh(matmul(x, w)) for w in ws], x), None

        return jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(3))[0])

    x = jnp.asarray(rng.standard_normal((2, 64), dtype=np.float32))
    np.testing.assert_allclose(run(cpu.matmul_native)(x), run(cpu.matmul_reference)(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [3, 16])
def test_concurrent_calls_from_several_threads(rows):
    """Programs running at once share the helper threads: a caller that finds them busy works alone."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((512, 1024), dtype=np.float32))
    f = jax.jit(lambda x: cpu.matmul_native(x, w))
    xs = [jnp.asarray(rng.standard_normal((rows, 512), dtype=np.float32)) for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda x: np.asarray(f(x)), xs * 4))
    for x, got in zip(xs * 4, results):
        np.testing.assert_allclose(got, _reference64(x, w, False), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 16])
def test_same_input_same_bits(rows):
    """Partial sums are added in chunk order, whichever thread computed them: repeated calls agree exactly
    (a fixed seed must reproduce its tokens)."""
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((1536, 576), dtype=np.float32))
    x = jnp.asarray(rng.standard_normal((rows, 1536), dtype=np.float32))
    f = jax.jit(cpu.matmul_native)
    first = np.asarray(f(x, w))
    for _ in range(30):
        np.testing.assert_array_equal(np.asarray(f(x, w)), first)


def _custom_calls(fn, *args) -> int:
    # A fresh function each time: jit's trace cache does not know about the active kernel backends.
    return jax.jit(lambda *a: fn(*a)).lower(*args).as_text().count("xlaserve_cpu_matmul")


def test_dispatch_only_where_it_applies():
    w = jnp.zeros((64, 32), jnp.float32)
    small, big = jnp.zeros((cpu.MAX_NATIVE_ROWS, 64)), jnp.zeros((cpu.MAX_NATIVE_ROWS + 1, 64))
    assert _custom_calls(cpu.matmul, small, w) == 1  # default backends on CPU: auto = native
    assert _custom_calls(cpu.matmul, big, w) == 0  # prefill-sized: XLA's dot
    # [n, k] weights (the tied LM head): the matrix-vector kernel up to MAX_GEMV_ROWS rows, XLA's dot between
    # that and MIN_NK_GEMM_ROWS, the GEMM from there to max_nk_gemm_rows() (MAX_NATIVE_ROWS with AVX-512)
    head = lambda x, w: cpu.matmul(x, w, transpose_w=True)  # noqa: E731
    assert cpu.max_nk_gemm_rows() == (cpu.MAX_NATIVE_ROWS if cpu.vector_registers() >= 32
                                      else cpu.MAX_NK_GEMM_ROWS_NARROW)
    nk_top = cpu.max_nk_gemm_rows()
    for rows, calls in ((cpu.MAX_GEMV_ROWS, 1), (cpu.MAX_GEMV_ROWS + 1, 0), (cpu.MIN_NK_GEMM_ROWS - 1, 0),
                        (cpu.MIN_NK_GEMM_ROWS, 1), (nk_top, 1), (nk_top + 1, 0)):
        assert _custom_calls(head, jnp.zeros((rows, 32)), w) == calls, rows
    # bf16 weights (a bfloat16 model's): up to MAX_GEMV_ROWS rows, either layout; XLA's dot above
    bf16 = w.astype(jnp.bfloat16)
    assert _custom_calls(cpu.matmul, small[:cpu.MAX_GEMV_ROWS], bf16) == 1
    assert _custom_calls(cpu.matmul, small[:cpu.MAX_GEMV_ROWS + 1], bf16) == 0
    assert _custom_calls(head, jnp.zeros((1, 32)), bf16) == 1
    assert _custom_calls(cpu.matmul, small[:1], w.astype(jnp.float16)) == 0  # f32 and bf16 only
    with use_kernels(KernelBackends.parse("auto,matmul=reference")):
        assert _custom_calls(cpu.matmul, small, w) == 0
    assert KernelBackends().choice("matmul", "gpu") == ("reference", False)
    assert KernelBackends("pallas").choice("matmul", "tpu") == ("reference", False)


@pytest.mark.parametrize("q_dtype,pool_dtype", [(jnp.float32, jnp.float32), (jnp.float32, jnp.bfloat16),
                                                (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("heads,kv_heads,window,soft_cap",
                         [(6, 2, None, None), (4, 4, 5, None), (8, 1, None, 2.0)])
def test_decode_attention_matches_reference(heads, kv_heads, window, soft_cap, q_dtype, pool_dtype):
    """Against the jnp reference (tests/kernels/test_paged_attention.py checks both against dense attention):
    GQA groups, pages in a random order, a padding row (position -1, no visible key: zeros), a layer index;
    f32 pools, bf16 pools under f32 queries (`--kv-cache-dtype bfloat16`) and a bf16 model's queries and
    pools, against the reference's f32 arithmetic on the same numbers (the kernel computes in f32 throughout;
    a bf16 query's output is rounded to bf16)."""
    from kernels.paged_attention.reference import decode_attention_reference

    rng = np.random.default_rng(heads + kv_heads)
    # 1, 21 and 48 visible keys: the softmax's vector exp over 16 keys at a time and its scalar tail
    layers, page_size, num_pages, d = 3, 8, 32, 32
    pool_shape = (layers, num_pages * page_size, kv_heads, d)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(pool_shape), pool_dtype) for _ in range(2))
    pages = jnp.asarray(rng.permutation(np.arange(1, num_pages))[:24].reshape(4, 6), jnp.int32)
    positions = jnp.asarray([0, 20, 47, -1], jnp.int32)
    q = jnp.asarray(rng.standard_normal((4, heads, d)), q_dtype)
    kw = dict(page_size=page_size, scale=d**-0.5, sliding_window=window, soft_cap=soft_cap)
    f32 = [x.astype(jnp.float32) for x in (q, k_pool, v_pool)]
    tol = 1e-5 if q_dtype == jnp.float32 else 2**-8
    for layer in (0, 2):
        got = jax.jit(lambda *a: cpu.decode_attention_native(*a, **kw))(q, k_pool, v_pool, layer, pages,
                                                                        positions)
        assert got.dtype == q_dtype
        want = decode_attention_reference(*f32, layer, pages, positions, **kw)
        np.testing.assert_allclose(np.asarray(got, np.float32)[:3], np.asarray(want)[:3], rtol=tol, atol=tol)
        assert not np.asarray(got, np.float32)[3].any()


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
def test_decode_attention_bf16_pairs(d, heads, kv_heads):
    """bf16 queries against a bf16 pool (a bf16 model's, or `--activation-quantization bf16` over a bf16 KV
    cache) sum the values in AVX512-BF16 pairs of tokens, the weights rounded to bf16 as the reference rounds
    them: head widths taking 64 columns at a time, then 32; 1-4 query heads a pass (groups of 3 and 8); odd
    and even numbers of visible tokens (the last odd token paired with a zero weight). Against the
    reference's f32 arithmetic on the same numbers, to bf16 rounding; whole permutations of a head's columns
    or a pair's tokens would be far off."""
    from kernels.paged_attention.reference import decode_attention_reference

    rng = np.random.default_rng(d + heads)
    layers, page_size, num_pages = 2, 16, 80
    pool_shape = (layers, num_pages * page_size, kv_heads, d)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(pool_shape), jnp.bfloat16) for _ in range(2))
    pages = jnp.asarray(rng.permutation(np.arange(1, num_pages))[:76].reshape(4, 19), jnp.int32)
    positions = jnp.asarray([0, 32, 299, 190], jnp.int32)  # 1, 33, 300 and 191 visible keys
    q = jnp.asarray(rng.standard_normal((4, heads, d)), jnp.bfloat16)
    kw = dict(page_size=page_size, scale=d**-0.5)
    got = jax.jit(lambda *a: cpu.decode_attention_native(*a, **kw))(q, k_pool, v_pool, 1, pages, positions)
    f32 = [x.astype(jnp.float32) for x in (q, k_pool, v_pool)]
    want = decode_attention_reference(*f32, 1, pages, positions, **kw)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2**-8, atol=2**-8)


@pytest.mark.parametrize("kv_heads,window,soft_cap,pool_dtype", [(3, None, None, jnp.float32),
                                                              (1, None, 2.0, jnp.bfloat16),
                                                              (3, 700, None, jnp.bfloat16)])
def test_decode_attention_split_over_tokens(kv_heads, window, soft_cap, pool_dtype):
    """One long sequence whose KV heads do not divide over the threads: each (sequence, KV head) is split
    over its tokens into a part per thread, each part's softmax kept unnormalized and the parts merged
    (attention.cc `run`); against the reference. Long enough for every thread to get 256 tokens."""
    import os

    from kernels.paged_attention.reference import decode_attention_reference

    threads = os.cpu_count() or 1
    page_size, d, heads = 16, 32, 3 * kv_heads
    ctx = max(600, threads * 256 + 37)
    num_pages = ctx // page_size + 2
    rng = np.random.default_rng(kv_heads)
    pool_shape = (2, num_pages * page_size, kv_heads, d)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(pool_shape), pool_dtype) for _ in range(2))
    pages = jnp.asarray(rng.permutation(np.arange(1, num_pages))[None, :num_pages - 1], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, heads, d)), jnp.float32)
    kw = dict(page_size=page_size, scale=d**-0.5, sliding_window=window, soft_cap=soft_cap)
    f32 = [x.astype(jnp.float32) for x in (q, k_pool, v_pool)]
    native = jax.jit(lambda *a: cpu.decode_attention_native(*a, **kw))
    for position in (ctx - 1, ctx - 30, 3):  # long enough to split (twice), and not
        positions = jnp.asarray([position], jnp.int32)
        got = native(q, k_pool, v_pool, 1, pages, positions)
        want = decode_attention_reference(*f32, 1, pages, positions, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("soft_cap", [None, 4.0])
def test_decode_attention_running_maximum(pool_dtype, soft_cap):
    """Long sequences whose largest scores come late, early and in the middle, so that any kernel form that
    keeps a running maximum (an online softmax over blocks of tokens, or parts merged by their maxima) must
    rescale earlier sums when a later block raises the maximum and leave them when it does not: sequences of
    1,000 and 601 tokens, f32 and bf16 pools, with and without a soft cap, against the reference."""
    from kernels.paged_attention.reference import decode_attention_reference

    rng = np.random.default_rng(7)
    page_size, d, heads, kv_heads, ctx = 16, 64, 9, 3, 1000
    width = ctx // page_size + 1
    num_pages = 3 * width + 1
    ramp = np.linspace(0.2, 3.0, ctx)
    shapes = [ramp, ramp[::-1], np.concatenate([ramp[: ctx // 2], ramp[: ctx // 2][::-1]])]
    keys = np.zeros((num_pages * page_size, kv_heads, d), np.float32)
    pages = 1 + rng.permutation(3 * width).reshape(3, width)
    for row, shape in enumerate(shapes):
        slots = (pages[row, :, None] * page_size + np.arange(page_size)).reshape(-1)[:ctx]
        keys[slots] = rng.standard_normal((ctx, kv_heads, d)) * shape[:, None, None]
    k_pool = jnp.asarray(keys[None], pool_dtype)
    v_pool = jnp.asarray(rng.standard_normal((1, num_pages * page_size, kv_heads, d)), pool_dtype)
    q = jnp.asarray(rng.standard_normal((3, heads, d)), jnp.float32)
    kw = dict(page_size=page_size, scale=d**-0.5, soft_cap=soft_cap)
    f32 = [x.astype(jnp.float32) for x in (q, k_pool, v_pool)]
    native = jax.jit(lambda *a: cpu.decode_attention_native(*a, **kw))
    for last in (ctx - 1, 600):
        positions = jnp.full((3,), last, jnp.int32)
        got = native(q, k_pool, v_pool, 0, jnp.asarray(pages, jnp.int32), positions)
        want = decode_attention_reference(*f32, 0, jnp.asarray(pages, jnp.int32), positions, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_dtype,pool_dtype", [(jnp.float32, jnp.float32), (jnp.float32, jnp.bfloat16),
                                                (jnp.bfloat16, jnp.bfloat16)])
@pytest.mark.parametrize("heads,kv_heads,soft_cap,d", [(9, 3, None, 32), (4, 1, 3.0, 32), (9, 3, None, 64),
                                                       (4, 2, None, 128)])
def test_decode_attention_shared_pages(heads, kv_heads, soft_cap, d, q_dtype, pool_dtype):
    """Rows whose page tables begin with the same pages (a cached prefix shared by several requests, one
    request's draft rows in a verify step) are attended once over those pages for the whole group, then each
    over its own (attention.cc `run_shared`): against the reference. The batch mixes: four rows of one
    prompt's prefix of 70 tokens (ending mid-page) that diverge after it, one of them sharing only 2 pages
    (too few: it is attended alone);
    four verify rows of one request (the same pages, consecutive positions); a row sharing a first page
    with nobody; a padding row; a group too short to share (20 tokens). The kernel reports the reads it
    saved, so the shared path is known to have run. Head dimensions of 32, 64 (SmolLM2's) and 128."""
    from kernels.paged_attention.reference import decode_attention_reference

    rng = np.random.default_rng(heads + d)
    page_size, width = 8, 80  # pages a row
    num_pages = 1000
    pool_shape = (2, num_pages * page_size, kv_heads, d)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(pool_shape), pool_dtype) for _ in range(2))
    free = iter(rng.permutation(np.arange(1, num_pages)))

    def own(n):
        return [int(next(free)) for _ in range(n)]

    prefix = own(9)  # 72 slots; the rows share 70 tokens, so the ninth page is each row's own (copied)
    rows, positions = [], []
    for length in (300, 71, 140, 95):
        rows.append(prefix[:8] + own(width - 8))
        positions.append(length - 1)
    rows[3] = prefix[:2] + own(width - 2)  # shares 16 tokens only
    verify = own(width)
    for i in range(4):
        rows.append(verify)
        positions.append(517 + i)  # two long parts over the shared tokens
    short = own(width)
    rows += [own(width), [0] * width, short, short]
    positions += [60, -1, 19, 18]
    pages = jnp.asarray(np.array(rows), jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(rows), heads, d)), q_dtype)
    kw = dict(page_size=page_size, scale=d**-0.5, soft_cap=soft_cap)
    f32 = [x.astype(jnp.float32) for x in (q, k_pool, v_pool)]
    before = cpu.shared_attention_tokens()
    native = jax.jit(lambda *a: cpu.decode_attention_native(*a, **kw))
    got = native(q, k_pool, v_pool, 1, pages, positions)
    got = np.asarray(got, np.float32)  # done (dispatch is asynchronous) before the count is read
    # prefix: 2 more rows over 64 tokens (the ninth page differs; the row sharing 16 tokens stays out, and
    # alone); verify: 3 more over 518; the others none
    assert cpu.shared_attention_tokens() - before == 2 * 64 + 3 * 518
    want = decode_attention_reference(*f32, 1, pages, positions, **kw)
    cpu.use_shared_attention(False)  # each row alone: no count, results as close
    try:
        before = cpu.shared_attention_tokens()
        alone = np.asarray(native(q, k_pool, v_pool, 1, pages, positions), np.float32)
        assert cpu.shared_attention_tokens() == before
    finally:
        cpu.use_shared_attention(True)
    tol = 1e-5 if q_dtype == jnp.float32 else 2**-8
    real = np.asarray(positions) >= 0
    np.testing.assert_allclose(alone[real], np.asarray(want)[real], rtol=tol, atol=tol)
    np.testing.assert_allclose(got[real], np.asarray(want)[real], rtol=tol, atol=tol)
    assert not got[~real].any()


F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("heads,kv_heads,d,window,soft_cap,block_size,pool_dtype,q_dtype",
                         [(6, 2, 32, None, None, 4, F32, F32), (4, 4, 64, 5, None, 4, F32, F32),
                          (8, 1, 16, None, 2.0, 8, F32, F32), (9, 3, 64, None, None, 16, F32, F32),
                          (6, 2, 80, 70, None, 4, F32, F32), (3, 1, 16, None, None, 1, F32, F32),
                          (9, 3, 64, None, None, 16, BF16, F32), (6, 2, 80, 70, 2.0, 4, BF16, F32),
                          (9, 3, 64, None, None, 16, BF16, BF16), (4, 2, 128, 70, 2.0, 4, BF16, BF16),
                          (6, 2, 80, None, None, 4, BF16, BF16)])
def test_prefill_attention_matches_reference(heads, kv_heads, d, window, soft_cap, block_size, pool_dtype,
                                             q_dtype):
    """Against the jnp reference (tests/kernels/test_paged_attention.py checks it against dense attention):
    query blocks of two sequences whose pages lie in a random order, a sequence's last block ending in padding
    rows (position 0), an all-padding block, contexts crossing the kernel's 64-key tiles, a sliding window
    shorter and longer than a tile, GQA groups, head dimensions of one to five vectors, a layer index; f32 and
    bf16 pools under f32 queries (to f32 rounding), and a bf16 model's queries against a bf16 pool (bf16
    products, as the reference's: head dimensions of 64 and 128 take the kernel's bf16 pairs, 80 its f32
    loops; to bf16 rounding, the two round their softmax weights at different points)."""
    from kernels.paged_attention.reference import prefill_attention_reference

    rng = np.random.default_rng(heads * d + block_size)
    layers, page_size, pages_per_seq = 2, 8, 24
    pool_shape = (layers, (2 * pages_per_seq + 1) * page_size, kv_heads, d)
    k_pool, v_pool = (jnp.asarray(rng.standard_normal(pool_shape), pool_dtype) for _ in range(2))
    table = rng.permutation(np.arange(1, 2 * pages_per_seq + 1)).reshape(2, pages_per_seq)
    # sequence 0: tokens 0..9 (its prompt from the start); sequence 1: tokens 150..170 after a cached prefix
    seqs = [(0, np.arange(0, 10)), (1, np.arange(150, 171))]
    block_pages, positions, valid = [], [], []
    for seq, pos in seqs:
        for start in range(0, len(pos), block_size):
            chunk = pos[start:start + block_size]
            valid += list(range(len(positions), len(positions) + len(chunk)))
            positions += list(chunk) + [0] * (block_size - len(chunk))
            block_pages.append(table[seq])
    block_pages.append(np.zeros(pages_per_seq, np.int64))  # an all-padding block
    positions += [0] * block_size
    block_pages, positions = jnp.asarray(np.stack(block_pages), jnp.int32), jnp.asarray(positions, jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(positions), heads, d), dtype=np.float32), q_dtype)
    kw = dict(page_size=page_size, block_size=block_size, scale=d**-0.5, sliding_window=window,
              soft_cap=soft_cap)
    tol = 1e-5 if q_dtype == F32 else 2**-6
    for layer in (0, 1):
        native = jax.jit(lambda *a: cpu.prefill_attention_native(*a, **kw))
        got = np.asarray(native(q, k_pool, v_pool, layer, block_pages, positions), np.float32)
        want = np.asarray(prefill_attention_reference(q, k_pool, v_pool, layer, block_pages, positions, **kw),
                          np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got[valid], want[valid], rtol=tol, atol=tol)


def test_prefill_attention_dispatch():
    """`paged_attention` of query blocks runs the native kernel on CPU (f32 or bf16 queries and pools, head
    dimension a multiple of 16), the reference otherwise."""
    from kernels.paged_attention import paged_attention

    def calls(q, pool, backend="auto", **kw):
        pages, positions = jnp.zeros((2, 4), jnp.int32), jnp.zeros((q.shape[0],), jnp.int32)
        with use_kernels(KernelBackends(backend)):
            hlo = jax.jit(lambda q, p: paged_attention(q, p, p, 0, pages, positions, page_size=8, scale=0.1,
                                                       **kw)).lower(q, pool).as_text()
        return hlo.count("xlaserve_cpu_prefill_attention")

    q, pool = jnp.zeros((8, 4, 32)), jnp.zeros((1, 40, 2, 32))
    assert calls(q, pool, block_size=4) == 1
    assert calls(q, pool, "reference", block_size=4) == 0
    assert calls(q[:2], pool, block_size=1) == 0  # decode has its own kernel
    assert calls(q[..., :24], pool[..., :24], block_size=4) == 0  # head dimension 24
    assert calls(q.astype(jnp.bfloat16), pool.astype(jnp.bfloat16), block_size=4) == 1  # a bf16 model
    assert calls(q, pool.astype(jnp.bfloat16), block_size=4) == 1  # --kv-cache-dtype bfloat16
    assert calls(q, pool.astype(jnp.float16), block_size=4) == 0
    assert calls(q.astype(jnp.float16), pool, block_size=4) == 0


def test_ssd_decode_update_matches_reference():
    """In place on the pool: each row's slot updated as the reference does, every other slot untouched."""
    from kernels.ssd.reference import ssd_decode_update

    rng = np.random.default_rng(3)
    rows, heads, p, groups, n, layers, slots = 3, 4, 16, 2, 32, 2, 5
    x = jnp.asarray(rng.standard_normal((rows, heads, p), dtype=np.float32))
    dt = jnp.asarray(rng.uniform(0.01, 0.5, (rows, heads)).astype(np.float32))
    a = -jnp.asarray(rng.uniform(0.5, 2.0, heads).astype(np.float32))
    b, c = (jnp.asarray(rng.standard_normal((rows, groups, n), dtype=np.float32)) for _ in range(2))
    pool = jnp.asarray(rng.standard_normal((layers, slots, heads, p, n), dtype=np.float32))
    row_slots = jnp.asarray([4, 1, 2], jnp.int32)
    want_y, want_pool = ssd_decode_update(x, dt, a, b, c, pool, 1, row_slots)
    got_y, got_pool = jax.jit(cpu.ssd_decode_update_native)(x, dt, a, b, c, pool, 1, row_slots)
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_pool), np.asarray(want_pool), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_conv1d_decode_update_matches_reference(bias):
    from kernels.conv1d.reference import conv1d_decode_update

    rng = np.random.default_rng(4)
    rows, channels, k, layers, slots = 3, 40, 4, 2, 5
    x = jnp.asarray(rng.standard_normal((rows, channels), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((channels, k), dtype=np.float32))
    b = jnp.asarray(rng.standard_normal(channels, dtype=np.float32)) if bias else None
    pool = jnp.asarray(rng.standard_normal((layers, slots, channels, k - 1), dtype=np.float32))
    row_slots = jnp.asarray([2, 4, 0], jnp.int32)
    want_y, want_pool = conv1d_decode_update(x, w, b, pool, 1, row_slots)
    got_y, got_pool = jax.jit(cpu.conv1d_decode_update_native)(x, w, b, pool, 1, row_slots)
    np.testing.assert_allclose(np.asarray(got_y), np.asarray(want_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_pool), np.asarray(want_pool))


@pytest.mark.parametrize("vocab", [7, 50, 49152])
def test_argmax_and_logsumexp_match_references(vocab):
    """Ties (first index wins, also across vector lanes and the scalar tail), masked rows, a NaN row, rows of
    +-inf; logsumexp against float64."""
    from kernels.sampling.reference import argmax_first

    rng = np.random.default_rng(5)
    x = rng.integers(-3, 4, (9, vocab)).astype(np.float32)  # few distinct values: ties in every row
    x[1] = -np.inf  # every token masked: index 0, as argmax; logsumexp -inf
    x[2, -1] = 10.0  # the maximum at the last index (in the tail when vocab % 16)
    x[3, vocab // 2] = np.nan  # index 0, as the reference; logsumexp NaN
    x[4, 1:] = -np.inf  # only the first token left
    x[5] = rng.standard_normal(vocab) * 30  # spread: exponents far below the maximum's
    x[6, vocab - 1] = np.inf
    x[7, :] = 3.0  # one value: index 0
    x[8] = rng.standard_normal(vocab)
    got = np.asarray(jax.jit(cpu.argmax_first_native)(jnp.asarray(x)))
    # XLA:CPU's vectorised max may skip a NaN, so the reference's pick for the NaN row varies
    no_nan = np.delete(np.arange(9), 3)
    np.testing.assert_array_equal(got[no_nan], np.asarray(argmax_first(jnp.asarray(x)))[no_nan])
    np.testing.assert_array_equal(got[no_nan], np.argmax(x[no_nan], axis=-1))
    assert got[3] == 0

    lse = np.asarray(jax.jit(cpu.logsumexp_native)(jnp.asarray(x)))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        x64 = x.astype(np.float64)
        peak = np.max(x64, axis=-1, keepdims=True)
        want = (np.log(np.sum(np.exp(x64 - np.where(np.isfinite(peak), peak, 0)), axis=-1))
                + np.where(np.isfinite(peak), peak, 0)[:, 0])
    normal = [0, 2, 4, 5, 7, 8]
    np.testing.assert_allclose(lse[normal], want[normal], rtol=2e-7 * np.log(vocab) + 1e-7, atol=0)
    assert lse[1] == -np.inf and np.isnan(lse[3]) and lse[6] == np.inf


@pytest.mark.parametrize("shape", [(32, 3072), (3, 14), (1, 2, 3104)])
def test_silu_mul_matches_reference(shape):
    """Interleaved gate|up pairs (models/fused.py): vector body, scalar tail, rows split over the threads;
    large gates of both signs (exp's clamped range)."""
    from kernels.gated_act.reference import silu_mul

    rng = np.random.default_rng(6)
    y = rng.standard_normal(shape, dtype=np.float32) * 4
    y.reshape(-1)[:8] = [100.0, 1.0, -100.0, 1.0, 30.0, -2.0, -30.0, 3.0]
    got = jax.jit(cpu.silu_mul_native)(jnp.asarray(y))
    want = silu_mul(jnp.asarray(y))
    assert got.shape == want.shape == (*shape[:-1], shape[-1] // 2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)


def test_sampling_and_activation_ops_dispatch_to_native():
    x = jnp.zeros((4, 100), jnp.float32)
    from kernels.gated_act import silu_mul
    from kernels.sampling import argmax_first, logsumexp

    for op, target in ((argmax_first, "xlaserve_cpu_argmax"), (logsumexp, "xlaserve_cpu_logsumexp"),
                       (silu_mul, "xlaserve_cpu_silu_mul")):
        with use_kernels(KernelBackends("auto")):
            assert target in jax.jit(lambda a: op(a)).lower(x).as_text()  # fresh functions: see _custom_calls
        with use_kernels(KernelBackends("reference")):
            assert target not in jax.jit(lambda a: op(a)).lower(x).as_text()


@pytest.mark.parametrize("family", ["qwen3", "mamba2"])
@pytest.mark.slow
def test_native_kernels_serve_as_the_references_do(tmp_path, family):
    """A served model with the native kernels (default on CPU) against `--kernel-backend reference`: same
    greedy tokens, output logprobs within 1e-4; the native decode program has its custom calls and no
    pool-sized copy (the KV pool is read in place, the SSM state pool updated in place)."""
    import re

    from serve import Engine

    if family == "qwen3":
        from tests.models.test_hf_parity import CASES, save_checkpoint

        save_checkpoint(str(tmp_path), CASES["qwen3_qk_norm_head_dim"])
        targets = ("xlaserve_cpu_matmul", "xlaserve_cpu_decode_attention", "xlaserve_cpu_silu_mul",
                   "xlaserve_cpu_write_rows")
    else:
        from tests.models.test_mamba2_parity import CASES, save_checkpoint

        save_checkpoint(str(tmp_path), CASES["groups2_bias"])
        targets = ("xlaserve_cpu_matmul", "xlaserve_cpu_ssd_decode", "xlaserve_cpu_conv_decode")
    targets += ("xlaserve_cpu_argmax", "xlaserve_cpu_logsumexp")  # sampling
    prompts = [[5, 9, 23, 7, 81, 14, 3], [44, 2, 19]]
    results = {}
    for backend in ("reference", "auto"):
        engine = Engine(model=str(tmp_path), in_process=True, dtype="float32", max_running_requests=2,
                        chunked_prefill_size=32, context_length=128, page_size=16, skip_tokenizer_init=True,
                        kernel_backend=backend)
        try:
            sp = greedy(8)
            results[backend] = [engine.generate(input_ids=p, sampling_params=sp, return_logprob=True)
                                for p in prompts]  # one at a time too: the single-row decode path
            results[backend] += engine.generate(input_ids=prompts, sampling_params=sp, return_logprob=True)
            runner = engine.runner
            pools = [x for x in jax.tree.leaves(runner.pools) if x.ndim >= 4]
            decode = [c.as_text() for k, c in runner._compiled.items()
                      if k[0] == "step" and k[1].prefill_blocks == 0]
            assert decode
            for hlo in decode:
                for target in targets:
                    assert (target in hlo) == (backend == "auto"), (backend, target)
            if family == "qwen3":  # prefill: the blocks of queries against the pages, read in place
                prefill = [c.as_text() for k, c in runner._compiled.items()
                           if k[0] == "step" and k[1].prefill_blocks > 0]
                assert prefill and all(("xlaserve_cpu_prefill_attention" in hlo) == (backend == "auto")
                                       for hlo in prefill), backend
                for pool in pools:
                    dims = ",".join(map(str, pool.shape))
                    assert not re.search(rf"= f32\[{dims}\]\S* copy\(", hlo), (backend, pool.shape)
        finally:
            engine.shutdown()
    for ours, ref in zip(results["auto"], results["reference"]):
        assert ours["output_ids"] == ref["output_ids"]
        np.testing.assert_allclose([lp for lp, _ in ours["meta_info"]["output_token_logprobs"]],
                                   [lp for lp, _ in ref["meta_info"]["output_token_logprobs"]],
                                   atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("pool_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows_dtype", [jnp.float32, jnp.bfloat16])
def test_write_rows_matches_the_scatter(pool_dtype, rows_dtype):
    """The native pool write against the reference scatter, bit for bit: f32 -> bf16 rounding to nearest even
    (ties and a NaN included), a slot past the pool dropped, the other layers and slots untouched."""
    from kernels.paged_attention.reference import write_rows

    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.standard_normal((3, 64, 2, 8)), pool_dtype)
    rows = rng.standard_normal((5, 2, 8)) * 1e3
    rows[1, 0, :3] = [1 + 2**-8, 1 + 3 * 2**-8, np.nan]  # halfway between two bf16 values: to even
    rows = jnp.asarray(rows, rows_dtype)
    slots = jnp.asarray([3, 0, 63, 64, 10], jnp.int32)
    for layer in (0, 2):
        want = write_rows(pool, layer, rows, slots)
        got = jax.jit(cpu.write_rows_native, donate_argnums=0)(pool + 0, layer, rows, slots)
        assert got.dtype == pool_dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
