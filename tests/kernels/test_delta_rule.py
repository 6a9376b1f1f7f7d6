"""Chunked gated delta rule reference over block-laid-out sequences vs a float64 per-token recurrence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta_rule import gated_delta_decode, gated_delta_prefill

H, K, V = 2, 4, 5
SCALE = K**-0.5

# Jitted: eager dispatch of every op costs more than compiling these tiny shapes.
_prefill = jax.jit(gated_delta_prefill, static_argnames="scale")
_decode = jax.jit(gated_delta_decode, static_argnames="scale")


def _recurrence(q, k, v, g, beta, s0, scale=SCALE):
    """Per token: S = exp(g) S; S += k^T beta (v - k S); o = scale * q S. q, k f[T, H, K], g, beta f[T, H]."""
    s, outs = np.array(s0, np.float64), []
    for t in range(len(q)):
        s = np.exp(g[t])[:, None, None] * s
        delta = beta[t][:, None] * (v[t] - np.einsum("hk,hkv->hv", k[t], s))
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append(scale * np.einsum("hk,hkv->hv", q[t], s))
    return np.stack(outs), s


def _f32(a) -> jnp.ndarray:
    return jnp.asarray(np.asarray(a), jnp.float32)


def _unit(rng, *shape):
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _sequence(rng, n, k=K, v=V, h=H, g_low=-2.0):
    """Random (q, k, v, g, beta) of n tokens: unit q and k, g in [g_low, 0], beta in (0, 1)."""
    return (_unit(rng, n, h, k), _unit(rng, n, h, k), rng.normal(size=(n, h, v)),
            rng.uniform(g_low, 0.0, size=(n, h)), rng.uniform(0.01, 0.99, size=(n, h)))


def _layout(seqs, bs, rng):
    """seqs: [(data, s0 or None)] laid out in blocks of bs tokens (each sequence's last block padded with
    large finite garbage q, k, v and g = beta = 0); init is s0 (or zeros) on a sequence's first block and NaN
    on the others, never to be read. Returns the prefill arguments and each sequence's last block."""
    parts, inits, starts, last = [], [], [], []
    for data, s0 in seqs:
        n = len(data[0])
        nb = -(-n // bs)
        pad = nb * bs - n
        garbage = (100 * rng.normal(size=(pad, H, K)), 100 * rng.normal(size=(pad, H, K)),
                   100 * rng.normal(size=(pad, H, V)), np.zeros((pad, H)), np.zeros((pad, H)))
        parts.append([np.concatenate([a, b]) for a, b in zip(data, garbage, strict=True)])
        first = np.zeros((H, K, V)) if s0 is None else s0
        inits += [first] + [np.full((H, K, V), np.nan)] * (nb - 1)
        starts += [True] + [False] * (nb - 1)
        last.append(len(starts) - 1)
    q, k, v, g, beta = (_f32(np.concatenate(a).reshape(-1, bs, *a[0].shape[1:]))
                        for a in zip(*parts, strict=True))
    return (q, k, v, g, beta, _f32(np.stack(inits)), jnp.asarray(starts)), last


@pytest.mark.parametrize("bs", [4, 3, 1])
def test_prefill_matches_recurrence(bs):
    rng = np.random.default_rng(0)
    # With bs = 4: 4 tokens fill exactly one block (from a state), 10 span 3 blocks ending mid-block (from
    # zeros), 3 are a lone partial block (from a state), 7 span 2 blocks (from a state).
    lens_inits = [(4, True), (10, False), (3, True), (7, True)]
    seqs = [(_sequence(rng, n), rng.normal(size=(H, K, V)) if has_init else None)
            for n, has_init in lens_inits]
    args, last = _layout(seqs, bs, rng)
    o, final = _prefill(*args, scale=SCALE)
    o, final = np.asarray(o).reshape(-1, H, V), np.asarray(final)
    row = 0
    for i, (data, s0) in enumerate(seqs):
        n = len(data[0])
        want_o, want_s = _recurrence(*data, np.zeros((H, K, V)) if s0 is None else s0)
        np.testing.assert_allclose(o[row : row + n], want_o, rtol=1e-4, atol=1e-4, err_msg=f"seq {i}")
        np.testing.assert_allclose(final[last[i]], want_s, rtol=1e-4, atol=1e-4, err_msg=f"seq {i}")
        row += -(-n // bs) * bs


def test_chained_decode_matches_prefill_and_recurrence():
    rng = np.random.default_rng(1)
    rows, steps = 3, 6
    seqs = [_sequence(rng, steps) for _ in range(rows)]
    s0 = rng.normal(size=(rows, H, K, V))
    q, k, v, g, beta = (np.stack(a, axis=0) for a in zip(*seqs, strict=True))  # [rows, steps, ...]

    state, outs = _f32(s0), []
    for t in range(steps):
        o, state = _decode(*(_f32(a[:, t]) for a in (q, k, v, g, beta)), state, scale=SCALE)
        outs.append(np.asarray(o))
    got_o, got_s = np.stack(outs, axis=1), np.asarray(state)  # [rows, steps, H, V], [rows, H, K, V]

    # The same tokens as one prefill block per row, each row its own sequence.
    o_pre, s_pre = _prefill(*(_f32(a) for a in (q, k, v, g, beta)), _f32(s0), jnp.ones(rows, bool),
                            scale=SCALE)
    np.testing.assert_allclose(got_o, np.asarray(o_pre), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_s, np.asarray(s_pre), rtol=1e-5, atol=1e-5)
    for r in range(rows):
        want_o, want_s = _recurrence(*seqs[r], s0[r])
        np.testing.assert_allclose(got_o[r], want_o, rtol=1e-5, atol=1e-5, err_msg=f"row {r}")
        np.testing.assert_allclose(got_s[r], want_s, rtol=1e-5, atol=1e-5, err_msg=f"row {r}")


@pytest.mark.parametrize("g_low", [-2.0, -0.05])
def test_long_block_stays_accurate(g_low):
    """bs = 64, K = V = 32: g down to -2 sums to about -64 over a block (decays underflow to 0 in float32,
    never overflow), g near 0 keeps the whole block's keys in play (the UT solve's widest reach)."""
    rng = np.random.default_rng(2)
    bs, h, d = 64, 2, 32
    data = _sequence(rng, 2 * bs, k=d, v=d, h=h, g_low=g_low)
    s0 = rng.normal(size=(h, d, d))
    blocks = [_f32(a.reshape(2, bs, *a.shape[1:])) for a in data]
    init = _f32(np.stack([s0, np.full_like(s0, np.nan)]))
    o, final = _prefill(*blocks, init, jnp.asarray([True, False]), scale=d**-0.5)
    want_o, want_s = _recurrence(*data, s0, scale=d**-0.5)
    np.testing.assert_allclose(np.asarray(o).reshape(2 * bs, h, d), want_o, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(final[1]), want_s, rtol=1e-4, atol=1e-4)
