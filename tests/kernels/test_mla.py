"""MLA reference: expanded prefill and absorbed decode against dense per-head attention, NaN-padded pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.mla import mla_decode_attention, mla_prefill_attention, write_latent
from tests.kernels.test_paged_attention import dense_attention

RANK, ROPE, NOPE, V, HEADS = 6, 4, 5, 3, 2


def _setup(rng, seq_len, pages, page_size, num_pages=8, layers=2):
    """A NaN pool with one sequence's latents written to layer 1, and the dense per-head K/V they imply."""
    pool = jnp.full((layers, num_pages * page_size, 1, RANK + ROPE), jnp.nan, jnp.float32)
    latent = rng.standard_normal((seq_len, RANK + ROPE)).astype(np.float32)
    pos = np.arange(seq_len)
    pool = write_latent(pool, 1, latent, pages[pos // page_size] * page_size + pos % page_size)
    assert np.isnan(np.asarray(pool[0])).all(), "layer 0 must be untouched"
    w_uk = rng.standard_normal((RANK, HEADS, NOPE)).astype(np.float32)
    w_uv = rng.standard_normal((RANK, HEADS, V)).astype(np.float32)
    c, k_pe = latent[:, :RANK], latent[:, RANK:]
    k = np.concatenate([np.einsum("sc,chn->shn", c, w_uk), np.repeat(k_pe[:, None], HEADS, axis=1)], axis=-1)
    v = np.einsum("sc,chv->shv", c, w_uv)
    return pool, w_uk, w_uv, k, v


@pytest.mark.parametrize("block_size", [1, 4])
def test_expanded_prefill_matches_dense_attention(block_size):
    rng = np.random.default_rng(0)
    page_size, seq_len, pages = 4, 10, np.array([5, 2, 7, 0], np.int32)  # the 4th page is unused
    pool, w_uk, w_uv, k, v = _setup(rng, seq_len, pages, page_size)
    n = 2 * block_size  # the last n positions, as two blocks of one sequence
    q_pos = np.arange(seq_len)[-n:]
    q = rng.standard_normal((n, HEADS, NOPE + ROPE)).astype(np.float32)
    out = mla_prefill_attention(
        jnp.asarray(q[..., :NOPE]),
        jnp.asarray(q[..., NOPE:]),
        pool,
        1,
        np.tile(pages, (2, 1)),
        q_pos,
        w_uk,
        w_uv,
        page_size=page_size,
        block_size=block_size,
        scale=0.3,
    )
    np.testing.assert_allclose(np.asarray(out), dense_attention(q, k, v, q_pos, 0.3), atol=1e-4, rtol=1e-4)


def test_absorbed_decode_matches_dense_attention_for_several_sequences():
    rng = np.random.default_rng(1)
    page_size = 4
    pool, w_uk, w_uv, k, v = _setup(rng, 10, np.array([5, 2, 7, 0], np.int32), page_size)
    # Three decode rows of the same sequence at different positions (each sees a prefix), one padding row.
    positions = np.array([9, 3, 0, 0])
    pages = np.array([[5, 2, 7, 0]] * 3 + [[0, 0, 0, 0]], np.int32)
    q = rng.standard_normal((4, HEADS, NOPE + ROPE)).astype(np.float32)
    out = np.asarray(
        mla_decode_attention(
            jnp.asarray(q[..., :NOPE]),
            jnp.asarray(q[..., NOPE:]),
            pool,
            1,
            pages,
            positions,
            w_uk,
            w_uv,
            page_size=page_size,
            scale=0.3,
        )
    )
    for row in range(3):
        expected = dense_attention(q[row : row + 1], k, v, positions[row : row + 1], 0.3)
        np.testing.assert_allclose(out[row : row + 1], expected, atol=1e-4, rtol=1e-4)


def test_single_latent_attends_to_itself():
    # Position 0 sees only its own latent: the output is exactly c @ W_UV per head, whatever the query.
    pool = write_latent(
        jnp.zeros((1, 4, 1, 3), jnp.float32), 0, np.array([[2.0, -1.0, 5.0]], np.float32), np.array([2])
    )
    w_uk = np.ones((2, 1, 1), np.float32)
    w_uv = np.array([[[1.0]], [[3.0]]], np.float32)  # value = 2 * 1 + (-1) * 3 = -1
    for fn, extra in ((mla_decode_attention, {}), (mla_prefill_attention, {"block_size": 1})):
        out = fn(
            jnp.ones((1, 1, 1)),
            jnp.ones((1, 1, 1)),
            pool,
            0,
            np.array([[1, 0]]),
            np.array([0]),
            w_uk,
            w_uv,
            page_size=2,
            scale=1.0,
            **extra,
        )
        np.testing.assert_allclose(np.asarray(out)[0, 0], [-1.0])
