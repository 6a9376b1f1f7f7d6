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
    c, k, bs = 5, 4, 4
    weight, bias = rng.normal(size=(c, k)), rng.normal(size=c)
    seqs = {1: rng.normal(size=(11, c)), 3: rng.normal(size=(2, c))}  # slot -> full input sequence
    states = {}  # slot -> conv state after the last call, as a pool would keep it
    outputs = {s: [] for s in seqs}

    def prefill(pieces):
        """pieces: [(slot, start, n)]: laid out like the batch builder, 3 padding blocks (NaN state) at the
        end."""
        blocks, inits, starts, lens, owners = [], [], [], [], []
        for slot, start, n in pieces:
            nblk = -(-n // bs)
            data = np.zeros((nblk * bs, c))
            data[:n] = seqs[slot][start : start + n]
            blocks.append(data.reshape(nblk, bs, c))
            for j in range(nblk):
                # Only a sequence's first block reads its init; later blocks get NaN, which must not leak.
                inits.append(states[slot] if j == 0 and start > 0 else np.zeros((c, k - 1)) if j == 0
                             else np.full((c, k - 1), np.nan))
                starts.append(j == 0)
                lens.append(min(bs, n - j * bs))
                owners.append(slot if j == nblk - 1 else None)
        blocks.append(np.full((3, bs, c), 7.0))
        inits += [np.zeros((c, k - 1))] * 3
        starts += [True] * 3
        lens += [0] * 3
        y, final = causal_conv1d_prefill(jnp.asarray(np.concatenate(blocks)), jnp.asarray(weight),
                                         jnp.asarray(bias), jnp.asarray(np.stack(inits)), jnp.asarray(starts),
                                         jnp.asarray(lens))
        y, final = np.asarray(y).reshape(-1, c), np.asarray(final)
        for b, slot in enumerate(owners):
            if slot is not None:
                states[slot] = final[b]
        row = 0
        for slot, start, n in pieces:
            outputs[slot].append(y[row : row + n])
            row += -(-n // bs) * bs

    prefill([(1, 0, 6), (3, 0, 1)])
    prefill([(3, 1, 1), (1, 6, 3)])  # a 1-token continuation: its whole history comes from the state
    for t in (9, 10):
        y, new = causal_conv1d_decode(jnp.asarray(seqs[1][t][None]), jnp.asarray(weight), jnp.asarray(bias),
                                      jnp.asarray(states[1][None]))
        states[1] = np.asarray(new)[0]
        outputs[1].append(np.asarray(y))
    for slot, u in seqs.items():
        np.testing.assert_allclose(np.concatenate(outputs[slot]), _direct(u, weight, bias), rtol=1e-5,
                                   atol=1e-5)
    np.testing.assert_allclose(states[1], seqs[1][-3:].T, rtol=1e-6)
    np.testing.assert_allclose(states[3], np.concatenate([np.zeros((c, 1)), seqs[3].T], axis=1), rtol=1e-6)
