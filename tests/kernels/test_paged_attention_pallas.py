"""Pallas ragged paged attention and KV write (TPU interpreter) against the jnp reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.paged_attention import pallas, reference

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
SEQ_LENS = (45, 19, 5)  # cached tokens per sequence: several pages, last pages partly filled
WINDOW, SOFT_CAP, SCALE = 7, 1.5, 0.5  # scores ~ N(0, 1.4): the cap bends them


def build_case(rng, *, block_size, group, page_size, dtype):
    """Pools, queries and page tables for SEQ_LENS, as the engine lays them out.

    Every pool slot starts as NaN except the dummy page 0 (padding rows read it); each sequence's
    written slots get K/V, its unused page-table entries point at never-written (NaN) pages, and its
    last page is NaN past its length. Prefill (block_size > 1): each sequence's last tokens in blocks
    (the long one continues from its cache, the others start at 0; last blocks partial) and one
    padding block. Decode: each sequence's last token, then a padding row.
    """
    layers, kv_heads, head_dim = 2, 2, 8
    pages_per_seq = 48 // page_size
    seq_pages = [-(-n // page_size) for n in SEQ_LENS]
    num_pages = 1 + sum(seq_pages) + 4  # dummy page 0, the sequences', 4 never written
    k_pool = np.full((layers, num_pages * page_size, kv_heads, head_dim), np.nan, np.float32)
    v_pool = k_pool.copy()
    k_pool[:, :page_size] = rng.standard_normal((layers, page_size, kv_heads, head_dim))
    v_pool[:, :page_size] = rng.standard_normal((layers, page_size, kv_heads, head_dim))
    owned = 1 + rng.permutation(sum(seq_pages))  # pages 1.. shuffled among the sequences
    never_written = np.arange(1 + sum(seq_pages), num_pages)

    positions, tables = [], []
    for seq_len, n_pages in zip(SEQ_LENS, seq_pages):
        pages, owned = owned[:n_pages], owned[n_pages:]
        slots = pages[np.arange(seq_len) // page_size] * page_size + np.arange(seq_len) % page_size
        k_pool[:, slots] = rng.standard_normal((layers, seq_len, kv_heads, head_dim))
        v_pool[:, slots] = rng.standard_normal((layers, seq_len, kv_heads, head_dim))
        table = np.concatenate([pages, rng.choice(never_written, pages_per_seq - n_pages)])
        if block_size == 1:
            query_pos = np.array([seq_len - 1])
        else:
            num_queries = block_size + 3 if seq_len > 2 * block_size else seq_len
            query_pos = np.arange(seq_len - num_queries, seq_len)
            query_pos = np.concatenate([query_pos, np.zeros(-num_queries % block_size, int)])
        positions.append(query_pos)
        tables += [table] * (len(query_pos) // block_size)
    positions.append(np.zeros(block_size, int))  # a padding block / decode row
    tables.append(np.zeros(pages_per_seq, int))
    positions = np.concatenate(positions).astype(np.int32)
    block_pages = np.stack(tables).astype(np.int32)
    q = rng.standard_normal((len(positions), kv_heads * group, head_dim))
    as_dtype = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return as_dtype(q), as_dtype(k_pool), as_dtype(v_pool), block_pages, positions


CASES = [  # a pairwise cover of block_size x group x page_size x dtype x window x soft cap
    # (block_size, group, page_size, dtype, window, soft_cap, pages_per_chunk)
    (1, 1, 4, jnp.float32, None, None, 2),
    (1, 2, 16, jnp.bfloat16, WINDOW, SOFT_CAP, 1),
    (8, 1, 4, jnp.float32, WINDOW, SOFT_CAP, 3),
    (8, 2, 16, jnp.bfloat16, None, None, None),  # one chunk holding the whole table
    (16, 1, 4, jnp.bfloat16, None, SOFT_CAP, 3),
    (16, 2, 16, jnp.float32, WINDOW, None, 1),
    (1, 1, 16, jnp.bfloat16, WINDOW, None, 1),
    (8, 2, 4, jnp.float32, None, SOFT_CAP, None),
]


@pytest.mark.parametrize("block_size, group, page_size, dtype, window, soft_cap, pages_per_chunk", CASES)
@pytest.mark.slow
def test_matches_reference(block_size, group, page_size, dtype, window, soft_cap, pages_per_chunk):
    rng = np.random.default_rng(block_size * 100 + group * 10 + page_size)
    q, k_pool, v_pool, block_pages, positions = build_case(
        rng, block_size=block_size, group=group, page_size=page_size, dtype=dtype
    )
    options = dict(page_size=page_size, block_size=block_size, scale=SCALE)

    def attend(fn, **extra):
        # `layer` is traced, as in the models' scan over layers.
        call = jax.jit(lambda q, k, v, layer, pages, pos: fn(q, k, v, layer, pages, pos, **options, **extra))
        return np.asarray(call(q, k_pool, v_pool, jnp.int32(1), block_pages, positions).astype(jnp.float32))

    expected = attend(reference.paged_attention, sliding_window=window, soft_cap=soft_cap)
    out = attend(
        pallas.paged_attention,
        sliding_window=window,
        soft_cap=soft_cap,
        pages_per_chunk=pages_per_chunk,
        interpret=True,
    )
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])

    # Guards: the tables do reach NaN slots, and each option on changes the result.
    kv_len = block_pages.shape[1] * page_size
    paged = np.asarray(k_pool[1], np.float32).reshape(-1, page_size, *k_pool.shape[2:])[block_pages]
    assert np.isnan(paged.reshape(len(block_pages), kv_len, -1)).any(axis=(1, 2))[:-1].all()
    if window is not None:
        assert np.abs(expected - attend(reference.paged_attention, soft_cap=soft_cap)).max() > 0.1
        chunk_keys = (pages_per_chunk or block_pages.shape[1]) * page_size
        start, first, _, _ = np.asarray(
            pallas._chunk_range(jnp.asarray(positions).reshape(-1, block_size), chunk_keys, window)
        ).T
        assert (first > 0).any(), "the window must let some block skip its leading chunks"
        if block_size > 1:
            assert (start < first).any(), "a partial block must revisit chunk 0 for its padding rows"
    if soft_cap is not None:
        assert np.abs(expected - attend(reference.paged_attention, sliding_window=window)).max() > 0.05


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_matches_reference(dtype):
    rng = np.random.default_rng(1)
    layers, num_slots, kv_heads, head_dim, num_tokens, real = 3, 40, 2, 8, 70, 30
    k_pool = jnp.asarray(rng.standard_normal((layers, num_slots, kv_heads, head_dim)), dtype)
    v_pool = jnp.asarray(rng.standard_normal((layers, num_slots, kv_heads, head_dim)), dtype)
    # 30 real tokens on distinct slots, then padding tokens that all write zeros to the dummy slot 0;
    # 70 tokens make two write steps, the second partial.
    slots = np.concatenate([1 + rng.permutation(num_slots - 1)[:real], np.zeros(num_tokens - real, int)])
    k = rng.standard_normal((num_tokens, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, kv_heads, head_dim)).astype(np.float32)
    k[real:], v[real:] = 0, 0
    expected = reference.write_kv(k_pool, v_pool, 2, k, v, slots)
    write = jax.jit(
        lambda kp, vp, layer: pallas.write_kv(kp, vp, layer, k, v, slots.astype(np.int32), interpret=True),
        donate_argnums=(0, 1),
    )
    out = write(k_pool, v_pool, jnp.int32(2))
    for got, want in zip(out, expected):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_lowers_for_tpu():
    # Guard from this CPU host: both kernels must lower to Mosaic (TPU) IR at serving shapes (head_dim 128,
    # bf16, GQA), so a primitive Mosaic cannot lower fails here. Compiling needs the device.
    num_slots, kv_heads, group, head_dim = 256 * 16, 2, 4, 128
    pool = jax.ShapeDtypeStruct((3, num_slots, kv_heads, head_dim), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    for block_size, window, soft_cap in [(1, None, None), (16, 128, 30.0)]:
        q = jax.ShapeDtypeStruct((4 * block_size, kv_heads * group, head_dim), jnp.bfloat16)
        attend = functools.partial(
            pallas.paged_attention,
            page_size=16,
            block_size=block_size,
            scale=0.1,
            sliding_window=window,
            soft_cap=soft_cap,
        )
        lowered = jax.jit(attend).trace(q, pool, pool, i32(), i32(4, 32), i32(4 * block_size))
        assert "tpu_custom_call" in lowered.lower(lowering_platforms=("tpu",)).as_text()
    rows = jax.ShapeDtypeStruct((100, kv_heads, head_dim), jnp.bfloat16)
    lowered = jax.jit(pallas.write_kv).trace(pool, pool, i32(), rows, rows, i32(100))
    assert "tpu_custom_call" in lowered.lower(lowering_platforms=("tpu",)).as_text()
