"""Causal conv1d reference over block-laid-out sequences vs a direct per-sequence convolution."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels.conv1d import causal_conv1d_decode, causal_conv1d_prefill


def _direct(u, weight, bias):
    """y[t] = bias + sum_k w[:, k] u[t + k - (K-1)] over one sequence u[T, C] (zeros before its start)."""
    k = weight.shape[1]
    padded = np.concatenate([np.zeros((k - 1, u.shape[1])), u])
    return np.stack([(padded[t : t + k] * weight.T).sum(0) + bias for t in range(len(u))])


def test_prefill_in_pieces_then_decode_matches_direct_conv():
    rng = np.random.default_rng(0)
    c, k, bs, slots = 5, 4, 4, 4
    weight, bias = rng.normal(size=(c, k)), rng.normal(size=c)
    seqs = {1: rng.normal(size=(11, c)), 3: rng.normal(size=(2, c))}  # slot -> full input sequence
    pool = jnp.full((2, slots, c, k - 1), jnp.nan)  # layer 1; stale NaN state must never be read
    pool = pool.at[1, 0].set(0.0)
    outputs = {s: [] for s in seqs}

    def prefill(pieces, pool):
        """pieces: [(slot, start, n)]: lay out like the batch builder, 3 padding blocks at the end."""
        blocks, meta = [], []
        for slot, start, n in pieces:
            nblk = -(-n // bs)
            data = np.zeros((nblk * bs, c))
            data[:n] = seqs[slot][start : start + n]
            blocks.append(data.reshape(nblk, bs, c))
            for j in range(nblk):
                meta.append((slot, min(bs, n - j * bs), j == 0, j == nblk - 1, start > 0))
        blocks.append(np.full((3, bs, c), 7.0))
        meta += [(0, 0, True, True, False)] * 3
        sl, ln, st, en, hi = map(np.array, zip(*meta))
        y, pool = causal_conv1d_prefill(jnp.asarray(np.concatenate(blocks)), jnp.asarray(weight), jnp.asarray(bias),
                                        pool, 1, jnp.asarray(sl), jnp.asarray(ln), jnp.asarray(st), jnp.asarray(en),
                                        jnp.asarray(hi))
        y = np.asarray(y).reshape(-1, c)
        row = 0
        for slot, start, n in pieces:
            outputs[slot].append(y[row : row + n])
            row += -(-n // bs) * bs
        return pool

    pool = prefill([(1, 0, 6), (3, 0, 1)], pool)
    pool = prefill([(3, 1, 1), (1, 6, 3)], pool)  # 1-token continuation: history comes from the pool
    for t in (9, 10):
        y, pool = causal_conv1d_decode(jnp.asarray(seqs[1][t][None]), jnp.asarray(weight), jnp.asarray(bias), pool, 1,
                                       jnp.asarray([1]))
        outputs[1].append(np.asarray(y))
    for slot, u in seqs.items():
        np.testing.assert_allclose(np.concatenate(outputs[slot]), _direct(u, weight, bias), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pool[1, 1]), seqs[1][-3:].T, rtol=1e-6)
    assert np.isnan(np.asarray(pool[0])).all()  # other layers untouched
