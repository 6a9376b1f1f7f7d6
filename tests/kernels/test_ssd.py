"""Chunked SSD reference over block-laid-out sequences vs a per-token recurrence, and a hand-computed case."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels.ssd import ssd_decode, ssd_prefill

H, P, N, G, BS = 4, 3, 5, 2, 8
SLOTS, LAYER = 6, 1


def _recurrence(x, dt, A, B, C, h0):
    """h[t] = exp(dt[t] A) h[t-1] + dt[t] x[t] B[t]^T, y[t] = h[t] C[t], head h reading group h // (H/G)."""
    groups = np.arange(x.shape[1]) // (x.shape[1] // B.shape[1])
    h, ys = h0.copy(), []
    for t in range(len(x)):
        bh, ch = B[t][groups], C[t][groups]  # [H, N]
        h = np.exp(dt[t] * A)[:, None, None] * h + (dt[t][:, None] * x[t])[:, :, None] * bh[:, None, :]
        ys.append(np.einsum("hpn,hn->hp", h, ch))
    return np.stack(ys), h


def _f32(a) -> jnp.ndarray:
    return jnp.asarray(np.asarray(a), jnp.float32)


def _pool_prefill(x, dt, A, b, c, pool, layer, slots, starts, ends, has_init):
    """ssd_prefill with its states kept in a slot pool, as models/recurrent.py does: a block that starts a
    sequence reads its slot (or zeros), other blocks get NaN (never to be read); ends write back."""
    read = starts & has_init
    init = jnp.where(read[:, None, None, None], pool[layer, jnp.where(read, slots, 0)], 0.0)
    init = jnp.where(starts[:, None, None, None], init, jnp.nan)
    y, final = ssd_prefill(x, dt, A, b, c, init, starts)
    return y, pool.at[layer, jnp.where(ends, slots, 0)].set(final)


def _pool_decode(x, dt, A, b, c, pool, layer, slots):
    y, new = ssd_decode(x, dt, A, b, c, pool[layer, slots])
    return y, pool.at[layer, slots].set(new)


def _prefill(pieces, data, A, pool, num_padding_blocks):
    """pieces: [(slot, n, has_init)], each the first n tokens of data[slot], laid out like the batch builder
    (a sequence's blocks consecutive, the last one padded), then padding blocks on the dummy slot 0."""
    rng = np.random.default_rng(1)
    parts, meta = [], []

    def padding(n):
        # Large finite x, B, C on padding tokens: dt = 0 alone must keep them out of every state.
        return (100 * rng.normal(size=(n, H, P)), np.zeros((n, H)), 100 * rng.normal(size=(n, G, N)),
                rng.normal(size=(n, G, N)))

    for slot, n, init in pieces:
        num_blocks = -(-n // BS)
        pad = padding(num_blocks * BS - n)
        parts.append([np.concatenate([a[:n], b]) for a, b in zip(data[slot], pad, strict=True)])
        meta += [(slot, j == 0, j == num_blocks - 1, init) for j in range(num_blocks)]
    parts.append(padding(num_padding_blocks * BS))
    meta += [(0, j == 0, j == num_padding_blocks - 1, False) for j in range(num_padding_blocks)]
    x, dt, b, c = (_f32(np.concatenate(a).reshape(-1, BS, *a[0].shape[1:])) for a in zip(*parts, strict=True))
    slots, starts, ends, has_init = (jnp.asarray(np.array(v)) for v in zip(*meta, strict=True))
    y, pool = _pool_prefill(x, dt, _f32(A), b, c, pool, LAYER, slots, starts, ends, has_init)
    y = np.asarray(y).reshape(-1, H, P)
    out, row = {}, 0
    for slot, n, _ in pieces:
        out[slot] = y[row : row + n]
        row += -(-n // BS) * BS
    return out, pool


def test_prefill_then_decode_matches_recurrence():
    rng = np.random.default_rng(0)
    A = -np.exp(rng.normal(size=H))
    # slot -> full length; the prefill gives all but the last 2 tokens of slots 1 and 4, decoded after.
    # 21 prefill tokens cross two block boundaries and end mid-block, 8 fill one block exactly, 3 are a
    # lone partial block; slot 4 continues a state already in its slot (prefilled in an earlier step).
    lens = {1: 23, 2: 8, 3: 3, 4: 15}
    data = {
        s: (rng.normal(size=(n, H, P)), rng.uniform(0.05, 1.0, size=(n, H)), rng.normal(size=(n, G, N)),
            rng.normal(size=(n, G, N)))
        for s, n in lens.items()
    }
    h0 = {s: np.zeros((H, P, N)) for s in lens} | {4: rng.normal(size=(H, P, N))}
    pool = jnp.full((2, SLOTS, H, P, N), jnp.nan, jnp.float32)  # NaN: slots that must never be read
    pool = pool.at[LAYER, 4].set(h0[4])

    pieces = [(1, 21, False), (2, 8, False), (3, 3, False), (4, 13, True)]
    got, pool = _prefill(pieces, data, A, pool, num_padding_blocks=2)
    outputs = {s: [got[s]] for s in lens}
    for step in range(2):  # decode rows: slot 1, a padding row on the dummy slot 0, slot 4
        rows = [(1, 21 + step), (0, 0), (4, 13 + step)]
        x, dt, b, c = (np.stack([data[s or 1][i][t] for s, t in rows]) for i in range(4))
        y, pool = _pool_decode(_f32(x), _f32(dt), _f32(A), _f32(b), _f32(c), pool, LAYER,
                             jnp.asarray([s for s, _ in rows]))
        outputs[1].append(np.asarray(y[:1]))
        outputs[4].append(np.asarray(y[2:]))

    for slot in lens:
        want_y, want_h = _recurrence(*data[slot][:2], A, *data[slot][2:], h0[slot])
        got_y = np.concatenate(outputs[slot])
        np.testing.assert_allclose(got_y, want_y, rtol=1e-4, atol=1e-4, err_msg=f"slot {slot}")
        got_h = np.asarray(pool[LAYER, slot])
        np.testing.assert_allclose(got_h, want_h, rtol=1e-4, atol=1e-4, err_msg=f"slot {slot}")
    assert np.isnan(np.asarray(pool[0])).all()  # other layers untouched
    assert np.isnan(np.asarray(pool[LAYER, 5])).all()  # a slot no sequence owns is never written


def test_hand_computed_case():
    # H = P = N = G = 1, A = -ln 2, dt = (1, 1, 2): per-token decays 1/2, 1/2, 1/4; x = (1, 2, 3),
    # B = (1, 2, 1), C = (1, 1, 2). h1 = h0/2 + 1*1*1, h2 = h1/2 + 1*2*2, h3 = h2/4 + 2*3*1, y = h * C:
    # h0 = 0 -> h = (1, 4.5, 7.125), y = (1, 4.5, 14.25); h0 = 2 -> h = (2, 5, 7.25), y = (2, 5, 14.5).
    # Block size 2 splits them into [t1 t2] [t3 pad]: the inter-block pass must carry the state across.
    def blocks(values, *trailing):  # the 4th value is a padding token's (garbage x, B, C; dt = 0)
        return _f32(np.reshape(values, (2, 2, *trailing)))

    x, b, c = blocks([1, 2, 3, 7], 1, 1), blocks([1, 2, 1, 5], 1, 1), blocks([1, 1, 2, 5], 1, 1)
    dt = blocks([1, 1, 2, 0], 1)
    a = _f32([-np.log(2.0)])
    for h0, want_y, want_h in ((0.0, [1, 4.5, 14.25], 7.125), (2.0, [2, 5, 14.5], 7.25)):
        pool = jnp.full((1, 2, 1, 1, 1), h0, jnp.float32)
        y, pool = _pool_prefill(x, dt, a, b, c, pool, 0, jnp.asarray([1, 1]), jnp.asarray([True, False]),
                              jnp.asarray([False, True]), jnp.asarray([h0 != 0.0] * 2))
        np.testing.assert_allclose(np.asarray(y).reshape(-1)[:3], want_y, rtol=1e-6)
        np.testing.assert_allclose(float(pool[0, 1, 0, 0, 0]), want_h, rtol=1e-6)
        # One decode step more (x = B = dt = 1, C = 3): h4 = h3 / 2 + 1, y4 = 3 h4.
        one = jnp.ones((1, 1, 1), jnp.float32)
        y, pool = _pool_decode(one, one[0], a, one, 3 * one, pool, 0, jnp.asarray([1]))
        np.testing.assert_allclose(float(y[0, 0, 0]), 3 * (want_h / 2 + 1), rtol=1e-6)
