"""Chunked Lightning / simple-GLA reference over block-laid-out sequences vs a per-token recurrence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kernels.gla import gla_decode, gla_prefill

H, K, V, BS = 3, 4, 5, 8
SLOTS, LAYER = 6, 1
SCALE = 0.7


def _recurrence(q, k, v, g, s0):
    """S[t] = exp(g[t]) S[t-1] + k[t]^T v[t], o[t] = SCALE * q[t] S[t]; q, k f[T, H, K], g f[T, H]."""
    s, outs = s0.copy(), []
    for t in range(len(q)):
        s = np.exp(g[t])[:, None, None] * s + k[t][:, :, None] * v[t][:, None, :]
        outs.append(SCALE * np.einsum("hk,hkv->hv", q[t], s))
    return np.stack(outs), s


def _f32(a) -> jnp.ndarray:
    return jnp.asarray(np.asarray(a), jnp.float32)


def _pool_prefill(q, k, v, g, pool, layer, slots, starts, ends, has_init):
    """gla_prefill with its states kept in a slot pool, as models/recurrent.py does: a block that starts a
    sequence reads its slot (or zeros), other blocks get NaN (never to be read); ends write back."""
    read = starts & has_init
    init = jnp.where(read[:, None, None, None], pool[layer, jnp.where(read, slots, 0)], 0.0)
    init = jnp.where(starts[:, None, None, None], init, jnp.nan)
    o, final = gla_prefill(q, k, v, g, init, starts, scale=SCALE)
    return o, pool.at[layer, jnp.where(ends, slots, 0)].set(final)


def _pool_decode(q, k, v, g, pool, layer, slots):
    o, new = gla_decode(q, k, v, g, pool[layer, slots], scale=SCALE)
    return o, pool.at[layer, slots].set(new)


def _prefill(pieces, data, pool, num_padding_blocks):
    """pieces: [(slot, n, has_init)], each the first n tokens of data[slot], laid out like the batch builder
    (a sequence's blocks consecutive, the last one padded), then padding blocks on the dummy slot 0."""
    rng = np.random.default_rng(1)
    parts, meta = [], []

    def padding(n):
        # Large finite q and v on padding tokens: k = 0 and g = 0 alone must keep them out of every state.
        return (100 * rng.normal(size=(n, H, K)), np.zeros((n, H, K)), 100 * rng.normal(size=(n, H, V)),
                np.zeros((n, H)))

    for slot, n, init in pieces:
        num_blocks = -(-n // BS)
        pad = padding(num_blocks * BS - n)
        parts.append([np.concatenate([a[:n], b]) for a, b in zip(data[slot], pad, strict=True)])
        meta += [(slot, j == 0, j == num_blocks - 1, init) for j in range(num_blocks)]
    parts.append(padding(num_padding_blocks * BS))
    meta += [(0, j == 0, j == num_padding_blocks - 1, False) for j in range(num_padding_blocks)]
    q, k, v, g = (_f32(np.concatenate(a).reshape(-1, BS, *a[0].shape[1:])) for a in zip(*parts, strict=True))
    slots, starts, ends, has_init = (jnp.asarray(np.array(m)) for m in zip(*meta, strict=True))
    o, pool = _pool_prefill(q, k, v, g, pool, LAYER, slots, starts, ends, has_init)
    o = np.asarray(o).reshape(-1, H, V)
    out, row = {}, 0
    for slot, n, _ in pieces:
        out[slot] = o[row : row + n]
        row += -(-n // BS) * BS
    return out, pool


def test_prefill_then_decode_matches_recurrence():
    rng = np.random.default_rng(0)
    # slot -> full length; the prefill gives all but the last 2 tokens of slots 1 and 4, decoded after.
    # 21 prefill tokens cross two block boundaries and end mid-block, 8 fill one block exactly, 3 are a
    # lone partial block; slot 4 continues a state already in its slot (prefilled in an earlier step).
    lens = {1: 23, 2: 8, 3: 3, 4: 15}
    data = {
        s: (rng.normal(size=(n, H, K)), rng.normal(size=(n, H, K)), rng.normal(size=(n, H, V)),
            -rng.uniform(0.0, 1.5, size=(n, H)))
        for s, n in lens.items()
    }
    s0 = {s: np.zeros((H, K, V)) for s in lens} | {4: rng.normal(size=(H, K, V))}
    pool = jnp.full((2, SLOTS, H, K, V), jnp.nan, jnp.float32)  # NaN: slots that must never be read
    pool = pool.at[LAYER, 4].set(s0[4])

    pieces = [(1, 21, False), (2, 8, False), (3, 3, False), (4, 13, True)]
    got, pool = _prefill(pieces, data, pool, num_padding_blocks=2)
    outputs = {s: [got[s]] for s in lens}
    for step in range(2):  # decode rows: slot 1, a padding row on the dummy slot 0, slot 4
        rows = [(1, 21 + step), (0, 0), (4, 13 + step)]
        q, k, v, g = (np.stack([data[s or 1][i][t] for s, t in rows]) for i in range(4))
        slots = jnp.asarray([s for s, _ in rows])
        o, pool = _pool_decode(_f32(q), _f32(k), _f32(v), _f32(g), pool, LAYER, slots)
        outputs[1].append(np.asarray(o[:1]))
        outputs[4].append(np.asarray(o[2:]))

    for slot in lens:
        want_o, want_s = _recurrence(*data[slot], s0[slot])
        np.testing.assert_allclose(np.concatenate(outputs[slot]), want_o, rtol=1e-4, atol=1e-4,
                                   err_msg=f"slot {slot}")
        np.testing.assert_allclose(np.asarray(pool[LAYER, slot]), want_s, rtol=1e-4, atol=1e-4,
                                   err_msg=f"slot {slot}")
    assert np.isnan(np.asarray(pool[0])).all()  # other layers untouched
    assert np.isnan(np.asarray(pool[LAYER, 5])).all()  # a slot no sequence owns is never written


def test_per_head_decay_matches_recurrence():
    """A per-head constant decay g f32[H] (Lightning's slopes) over full blocks, prefill then decode."""
    rng = np.random.default_rng(2)
    n = 2 * BS
    q, k = rng.normal(size=(n + 1, H, K)), rng.normal(size=(n + 1, H, K))
    v, g = rng.normal(size=(n + 1, H, V)), -np.array([0.05, 0.5, 2.0])
    s0 = rng.normal(size=(H, K, V))
    blocks = [_f32(a[:n].reshape(2, BS, *a.shape[1:])) for a in (q, k, v)]
    init = _f32(np.stack([s0, np.full_like(s0, np.nan)]))
    o, final = gla_prefill(*blocks, _f32(g), init, jnp.asarray([True, False]), scale=SCALE)
    o_last, state = gla_decode(*(_f32(a[n:]) for a in (q, k, v)), _f32(g), final[1:], scale=SCALE)
    want_o, want_s = _recurrence(q, k, v, np.broadcast_to(g, (n + 1, H)), s0)
    got_o = np.concatenate([np.asarray(o).reshape(n, H, V), np.asarray(o_last)])
    np.testing.assert_allclose(got_o, want_o, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(state[0]), want_s, rtol=1e-4, atol=1e-4)


def test_hand_computed_case():
    # H = K = V = 1, scale 1, g = -ln 2 (decay 1/2) on real tokens; q = (1, 1, 2), k = (1, 2, 1),
    # v = (1, 2, 3): S1 = S0/2 + 1, S2 = S1/2 + 4, S3 = S2/2 + 3, o = q S.
    # S0 = 0 -> S = (1, 4.5, 5.25), o = (1, 4.5, 10.5); S0 = 2 -> S = (2, 5, 5.5), o = (2, 5, 11).
    # Block size 2 splits them into [t1 t2] [t3 pad]: the inter-block pass must carry the state across.
    def blocks(values):  # the 4th value is a padding token's (garbage q, v; k = 0, g = 0)
        return _f32(np.reshape(values, (2, 2, 1, 1)))

    q, k, v = blocks([1, 1, 2, 7]), blocks([1, 2, 1, 0]), blocks([1, 2, 3, 9])
    g = _f32(np.reshape([-np.log(2.0)] * 3 + [0.0], (2, 2, 1)))
    for s0, want_o, want_s in ((0.0, [1, 4.5, 10.5], 5.25), (2.0, [2, 5, 11], 5.5)):
        init = jnp.asarray([[[[s0]]], [[[np.nan]]]], jnp.float32)
        o, final = gla_prefill(q, k, v, g, init, jnp.asarray([True, False]), scale=1.0)
        np.testing.assert_allclose(np.asarray(o).reshape(-1)[:3], want_o, rtol=1e-6)
        np.testing.assert_allclose(float(final[1, 0, 0, 0]), want_s, rtol=1e-6)
        # One decode step more (q = 3, k = v = 1): S4 = S3 / 2 + 1, o4 = 3 S4.
        one = jnp.ones((1, 1, 1), jnp.float32)
        o, state = gla_decode(3 * one, one, one, _f32([-np.log(2.0)]), final[1:], scale=1.0)
        np.testing.assert_allclose(float(o[0, 0, 0]), 3 * (want_s / 2 + 1), rtol=1e-6)
        np.testing.assert_allclose(float(state[0, 0, 0, 0]), want_s / 2 + 1, rtol=1e-6)
