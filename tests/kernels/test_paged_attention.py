"""Paged attention reference: against dense causal attention on a hand-built case, NaN-padded pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.paged_attention import paged_attention, write_kv


def dense_attention(q, k, v, positions, scale):
    """q f[n, H, D] at `positions`; k/v f[L, KVH, D] for positions 0..L-1 of one sequence."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = np.repeat(k, heads // kv_heads, axis=1)
    v = np.repeat(v, heads // kv_heads, axis=1)
    scores = np.einsum("qhd,shd->hqs", q, k) * scale
    scores = np.where(np.arange(k.shape[0])[None, None, :] <= positions[None, :, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqs,shd->qhd", probs, v)


@pytest.mark.parametrize("block_size", [1, 4])
def test_matches_dense_attention_with_nan_padding(block_size):
    rng = np.random.default_rng(0)
    layers, num_pages, page_size, kv_heads, heads, d = 2, 8, 4, 2, 4, 8
    # Every slot starts as NaN: any read of a slot that the sequence did not write shows up.
    k_pool = jnp.full((layers, num_pages * page_size, kv_heads, d), jnp.nan, jnp.float32)
    v_pool = jnp.full((layers, num_pages * page_size, kv_heads, d), jnp.nan, jnp.float32)
    seq_len, pages = 10, np.array([5, 2, 7, 0], np.int32)  # 10 tokens over 3 pages; the 4th is unused
    k = rng.standard_normal((seq_len, kv_heads, d)).astype(np.float32)
    v = rng.standard_normal((seq_len, kv_heads, d)).astype(np.float32)
    pos = np.arange(seq_len)
    slots = pages[pos // page_size] * page_size + pos % page_size
    k_pool, v_pool = write_kv(k_pool, v_pool, 1, k, v, slots)
    assert np.isnan(np.asarray(k_pool[0])).all(), "layer 0 must be untouched"

    # Queries for the last `block_size * 2` positions, as two blocks of one sequence.
    n = 2 * block_size
    q_pos = pos[-n:]
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    block_pages = np.tile(pages, (2, 1))
    out = paged_attention(jnp.asarray(q), k_pool, v_pool, 1, block_pages, q_pos, page_size=page_size,
                          block_size=block_size, scale=0.3)
    expected = dense_attention(q, k, v, q_pos, 0.3)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)


def test_single_key_attends_to_itself():
    # Position 0 sees only its own key: the output is exactly its value.
    k_pool = jnp.zeros((1, 4, 1, 2), jnp.float32)  # 2 pages of 2 slots
    v_pool = jnp.zeros((1, 4, 1, 2), jnp.float32)
    k_pool, v_pool = write_kv(k_pool, v_pool, 0, np.ones((1, 1, 2), np.float32),
                              np.array([[[3.0, -1.0]]], np.float32), np.array([2]))
    out = paged_attention(jnp.ones((1, 1, 2)), k_pool, v_pool, 0, np.array([[1, 0]]), np.array([0]),
                          page_size=2, block_size=1, scale=1.0)
    np.testing.assert_allclose(np.asarray(out)[0, 0], [3.0, -1.0])


def dense_attention_with_options(q, k, v, positions, scale, window, soft_cap):
    """dense_attention with HF's sliding window (key j seen iff pos - window < j <= pos) and logit soft
    cap."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = np.repeat(k, heads // kv_heads, axis=1)
    v = np.repeat(v, heads // kv_heads, axis=1)
    scores = np.einsum("qhd,shd->hqs", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * np.tanh(scores / soft_cap)
    keys, pos = np.arange(k.shape[0])[None, None, :], positions[None, :, None]
    visible = (keys <= pos) & (True if window is None else keys > pos - window)
    scores = np.where(visible, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqs,shd->qhd", probs, v)


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("window, soft_cap", [(3, None), (None, 1.5), (4, 2.0)])
def test_sliding_window_and_soft_cap_match_dense(block_size, window, soft_cap):
    rng = np.random.default_rng(1)
    layers, num_pages, page_size, kv_heads, heads, d = 1, 8, 4, 2, 4, 8
    k_pool = jnp.full((layers, num_pages * page_size, kv_heads, d), jnp.nan, jnp.float32)
    v_pool = jnp.full((layers, num_pages * page_size, kv_heads, d), jnp.nan, jnp.float32)
    seq_len, pages = 11, np.array([3, 6, 1, 0], np.int32)
    k = rng.standard_normal((seq_len, kv_heads, d)).astype(np.float32) * 2  # scores large enough to cap
    v = rng.standard_normal((seq_len, kv_heads, d)).astype(np.float32)
    pos = np.arange(seq_len)
    k_pool, v_pool = write_kv(k_pool, v_pool, 0, k, v, pages[pos // page_size] * page_size + pos % page_size)
    n = 2 * block_size
    q_pos = pos[-n:]
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    out = paged_attention(jnp.asarray(q), k_pool, v_pool, 0, np.tile(pages, (2, 1)), q_pos,
                          page_size=page_size, block_size=block_size, scale=0.5, sliding_window=window,
                          soft_cap=soft_cap)
    expected = dense_attention_with_options(q, k, v, q_pos, 0.5, window, soft_cap)
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-5, rtol=1e-5)
    # Guard: the option changes the result (else this case would test nothing).
    assert np.abs(expected - dense_attention(q, k, v, q_pos, 0.5)).max() > 1e-2
