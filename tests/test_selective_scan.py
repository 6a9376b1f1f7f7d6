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


def _prefill(pieces, seqs, A, pool, bs, layer, num_padding_blocks=2):
    """pieces: [(slot, start, n)] laid out as the batch builder does, then padding blocks; returns (ys, pool)."""
    dn, n = A.shape
    rng = np.random.default_rng(1)
    fields = {"u": dn, "dt": dn, "B": n, "C": n}
    blocks = {k: [] for k in fields}
    meta = []
    for slot, start, count in pieces:
        nblk = -(-count // bs)
        for k, width in fields.items():
            # Junk in the padding rows (u, B, C) must not matter: dt = 0 there is what keeps the state.
            data = rng.normal(size=(nblk * bs, width)) if k != "dt" else np.zeros((nblk * bs, width))
            data[:count] = seqs[slot][k][start : start + count]
            blocks[k].append(data.reshape(nblk, bs, width))
        meta += [(slot, j == 0, j == nblk - 1, start > 0) for j in range(nblk)]
    for k, width in fields.items():
        blocks[k].append(np.full((num_padding_blocks, bs, width), 0.0 if k == "dt" else 7.0))
    meta += [(0, True, True, False)] * num_padding_blocks
    sl, st, en, hi = (jnp.asarray(np.array(x)) for x in zip(*meta))
    u, dt, B, C = (jnp.asarray(np.concatenate(blocks[k]), jnp.float32) for k in fields)
    y, pool = selective_scan_prefill(u, dt, jnp.asarray(A, jnp.float32), B, C, pool, layer, sl, st, en, hi)
    y = np.asarray(y).reshape(-1, dn)
    ys, row = [], 0
    for _, _, count in pieces:
        ys.append(y[row : row + count])
        row += -(-count // bs) * bs
    return ys, pool


def test_prefill_in_pieces_then_decode_matches_naive_recurrence():
    rng = np.random.default_rng(0)
    dn, n, bs, num_slots, layer = 6, 4, 8, 5, 1
    A = -np.exp(rng.normal(size=(dn, n)))
    lens = {1: 40, 2: 3, 3: 8}  # slot -> full sequence length
    seqs = {
        s: {"u": rng.normal(size=(t, dn)), "dt": np.log1p(np.exp(rng.normal(size=(t, dn)))),
            "B": rng.normal(size=(t, n)), "C": rng.normal(size=(t, n))}
        for s, t in lens.items()
    }
    # Stale NaN state in every slot but the dummy (decode padding rows read slot 0): a slot that starts from
    # zeros must never read it, and other layers must stay untouched.
    pool = jnp.full((2, num_slots, dn, n), jnp.nan, jnp.float32).at[layer, 0].set(0.0)
    outputs = {s: [] for s in lens}

    def run_prefill(pieces, pool):
        ys, pool = _prefill(pieces, seqs, A, pool, bs, layer)
        for (slot, _, _), y in zip(pieces, ys):
            outputs[slot].append(y)
        return pool

    pool = run_prefill([(1, 0, 21), (3, 0, 5)], pool)  # 21: two full blocks and a partial one
    # Continuations: a 1-token chunk, a chunk of exactly two blocks; slot 2 (NaN) starts from zeros.
    pool = run_prefill([(3, 5, 1), (2, 0, 3), (1, 21, 16)], pool)
    pool = run_prefill([(1, 37, 1), (3, 6, 1)], pool)
    for t in (38, 39):  # two decode steps for slot 1, slot 3 has one more token, then a padding row
        rows = [(1, t)] + ([(3, 7)] if t == 38 else []) + [(0, None)]
        u, dt, B, C = (
            jnp.asarray(np.stack([seqs[s][k][i] if s else np.zeros_like(seqs[1][k][0]) for s, i in rows]),
                        jnp.float32)
            for k in ("u", "dt", "B", "C")
        )
        y, pool = selective_scan_decode(u, dt, jnp.asarray(A, jnp.float32), B, C, pool, layer,
                                        jnp.asarray([s for s, _ in rows]))
        for r, (s, _) in enumerate(rows[:-1]):
            outputs[s].append(np.asarray(y[r : r + 1]))
    for slot in lens:
        s = seqs[slot]
        y_ref, h_ref = _naive(np.zeros((dn, n)), s["u"], s["dt"], A, s["B"], s["C"])
        np.testing.assert_allclose(np.concatenate(outputs[slot]), y_ref, rtol=1e-5, atol=1e-5, err_msg=f"slot {slot}")
        np.testing.assert_allclose(np.asarray(pool[layer, slot]), h_ref, rtol=1e-5, atol=1e-5)
    assert np.isnan(np.asarray(pool[0])).all()  # other layer untouched
    assert np.isnan(np.asarray(pool[layer, 4])).all()  # unused slot untouched


def test_hand_computed_case():
    # One channel, one state, decay exp(dt A) = 1/2 per token, B = 1, C = 2, from an initial state of 4:
    # h = 4/2 + 1 = 3, 3/2 + 2 = 3.5, 3.5/2 + 3 = 4.75; y = 2h. Blocks of 2, so the third token is in a
    # second, partial block whose padding row (dt = 0) must leave h at 4.75. One decode token u = 1 then
    # gives h = 4.75/2 + 1 = 3.375.
    A = jnp.asarray([[-np.log(2.0)]], jnp.float32)
    u = jnp.asarray([[[1.0], [2.0]], [[3.0], [9.0]]], jnp.float32)
    dt = jnp.asarray([[[1.0], [1.0]], [[1.0], [0.0]]], jnp.float32)
    B = jnp.ones((2, 2, 1), jnp.float32)
    C = 2 * B
    pool = jnp.zeros((1, 2, 1, 1), jnp.float32).at[0, 1].set(4.0)
    slots, starts, ends = jnp.asarray([1, 1]), jnp.asarray([True, False]), jnp.asarray([False, True])
    y, pool = selective_scan_prefill(u, dt, A, B, C, pool, 0, slots, starts, ends, jnp.asarray([True, True]))
    np.testing.assert_allclose(np.asarray(y).ravel()[:3], [6.0, 7.0, 9.5], rtol=1e-6)
    np.testing.assert_allclose(float(pool[0, 1, 0, 0]), 4.75, rtol=1e-6)
    y, pool = selective_scan_decode(jnp.ones((1, 1)), jnp.ones((1, 1)), A, B[0, :1], C[0, :1], pool, 0,
                                    jnp.asarray([1]))
    np.testing.assert_allclose(float(pool[0, 1, 0, 0]), 3.375, rtol=1e-6)
    np.testing.assert_allclose(float(y[0, 0]), 6.75, rtol=1e-6)
