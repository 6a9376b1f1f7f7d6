"""Selective scan reference over block-laid-out sequences vs a naive per-token recurrence, and a hand case."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels.selective_scan import selective_scan_decode, selective_scan_prefill


def _naive(h, u, dt, A, B, C):
    """Token by token from state h f[Dn, N]: h = exp(dt A) h + dt B u, y = C . h; returns (y f[T, Dn], h)."""
    ys = []
    for t in range(len(u)):
        h = np.exp(dt[t][:, None] * A) * h + (dt[t] * u[t])[:, None] * B[t][None, :]
        ys.append(h @ C[t])
    return np.stack(ys), h


def _prefill(pieces, seqs, A, states, bs, num_padding_blocks=2):
    """pieces: [(slot, start, n)] laid out as the batch builder does, then padding blocks.

    `states` (slot -> state, as a pool would keep it) gives each sequence's initial state and receives its
    final one. Returns each piece's outputs.
    """
    dn, n = A.shape
    rng = np.random.default_rng(1)
    fields = {"u": dn, "dt": dn, "B": n, "C": n}
    blocks = {k: [] for k in fields}
    inits, starts, owners = [], [], []
    for slot, start, count in pieces:
        nblk = -(-count // bs)
        for k, width in fields.items():
            # Junk in the padding rows (u, B, C) must not matter: dt = 0 there is what keeps the state.
            data = rng.normal(size=(nblk * bs, width)) if k != "dt" else np.zeros((nblk * bs, width))
            data[:count] = seqs[slot][k][start : start + count]
            blocks[k].append(data.reshape(nblk, bs, width))
        for j in range(nblk):
            # Only a sequence's first block reads its init; later blocks get NaN, which must not leak.
            first = states[slot] if start > 0 else np.zeros((dn, n))
            inits.append(first if j == 0 else np.full((dn, n), np.nan))
            starts.append(j == 0)
            owners.append(slot if j == nblk - 1 else None)
    for k, width in fields.items():
        blocks[k].append(np.full((num_padding_blocks, bs, width), 0.0 if k == "dt" else 7.0))
    inits += [np.zeros((dn, n))] * num_padding_blocks
    starts += [True] * num_padding_blocks
    u, dt, B, C = (jnp.asarray(np.concatenate(blocks[k]), jnp.float32) for k in fields)
    y, final = selective_scan_prefill(u, dt, jnp.asarray(A, jnp.float32), B, C,
                                      jnp.asarray(np.stack(inits), jnp.float32), jnp.asarray(starts))
    y, final = np.asarray(y).reshape(-1, dn), np.asarray(final)
    for b, slot in enumerate(owners):
        if slot is not None:
            states[slot] = final[b]
    ys, row = [], 0
    for _, _, count in pieces:
        ys.append(y[row : row + count])
        row += -(-count // bs) * bs
    return ys


def test_prefill_in_pieces_then_decode_matches_naive_recurrence():
    rng = np.random.default_rng(0)
    dn, n, bs = 6, 4, 8
    A = -np.exp(rng.normal(size=(dn, n)))
    lens = {1: 40, 2: 3, 3: 8}  # slot -> full sequence length
    seqs = {
        s: {"u": rng.normal(size=(t, dn)), "dt": np.log1p(np.exp(rng.normal(size=(t, dn)))),
            "B": rng.normal(size=(t, n)), "C": rng.normal(size=(t, n))}
        for s, t in lens.items()
    }
    states = {}  # slot -> SSM state after the last call
    outputs = {s: [] for s in lens}

    def run_prefill(pieces):
        for (slot, _, _), y in zip(pieces, _prefill(pieces, seqs, A, states, bs)):
            outputs[slot].append(y)

    run_prefill([(1, 0, 21), (3, 0, 5)])  # 21: two full blocks and a partial one
    # Continuations: a 1-token chunk, a chunk of exactly two blocks; slot 2 starts from zeros.
    run_prefill([(3, 5, 1), (2, 0, 3), (1, 21, 16)])
    run_prefill([(1, 37, 1), (3, 6, 1)])
    for t in (38, 39):  # two decode steps for slot 1, slot 3 has one more token, then a padding row
        rows = [(1, t)] + ([(3, 7)] if t == 38 else []) + [(0, None)]
        u, dt, B, C = (
            jnp.asarray(np.stack([seqs[s][k][i] if s else np.zeros_like(seqs[1][k][0]) for s, i in rows]),
                        jnp.float32)
            for k in ("u", "dt", "B", "C")
        )
        state = jnp.asarray(np.stack([states[s] if s else np.zeros((dn, n)) for s, _ in rows]), jnp.float32)
        y, new = selective_scan_decode(u, dt, jnp.asarray(A, jnp.float32), B, C, state)
        for r, (s, _) in enumerate(rows[:-1]):
            outputs[s].append(np.asarray(y[r : r + 1]))
            states[s] = np.asarray(new[r])
    for slot in lens:
        s = seqs[slot]
        y_ref, h_ref = _naive(np.zeros((dn, n)), s["u"], s["dt"], A, s["B"], s["C"])
        np.testing.assert_allclose(np.concatenate(outputs[slot]), y_ref, rtol=1e-5, atol=1e-5,
                                   err_msg=f"slot {slot}")
        np.testing.assert_allclose(states[slot], h_ref, rtol=1e-5, atol=1e-5)


def test_hand_computed_case():
    # One channel, one state, decay exp(dt A) = 1/2 per token, B = 1, C = 2, from an initial state of 4:
    # h = 4/2 + 1 = 3, 3/2 + 2 = 3.5, 3.5/2 + 3 = 4.75; y = 2h. Blocks of 2, so the third token is in a
    # second, partial block whose padding row (dt = 0) must leave h at 4.75; that block continues the first
    # (its NaN init is not read). One decode token u = 1 then gives h = 4.75/2 + 1 = 3.375.
    A = jnp.asarray([[-np.log(2.0)]], jnp.float32)
    u = jnp.asarray([[[1.0], [2.0]], [[3.0], [9.0]]], jnp.float32)
    dt = jnp.asarray([[[1.0], [1.0]], [[1.0], [0.0]]], jnp.float32)
    B = jnp.ones((2, 2, 1), jnp.float32)
    C = 2 * B
    init = jnp.asarray([[[4.0]], [[np.nan]]], jnp.float32)
    y, final = selective_scan_prefill(u, dt, A, B, C, init, jnp.asarray([True, False]))
    np.testing.assert_allclose(np.asarray(y).ravel()[:3], [6.0, 7.0, 9.5], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(final).ravel(), [3.5, 4.75], rtol=1e-6)
    y, state = selective_scan_decode(jnp.ones((1, 1)), jnp.ones((1, 1)), A, B[0, :1], C[0, :1], final[1:])
    np.testing.assert_allclose(float(state[0, 0, 0]), 3.375, rtol=1e-6)
    np.testing.assert_allclose(float(y[0, 0]), 6.75, rtol=1e-6)
