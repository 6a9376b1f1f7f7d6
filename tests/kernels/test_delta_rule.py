"""The chunked delta rule references over block-laid-out sequences vs a float64 per-token recurrence, in both
forms: the gated delta rule (a decay per head, Gated DeltaNet) and Kimi Delta Attention (a decay per key
channel): prefill, decode steps, KDA's pooled decode update with chained rows, and KDA with equal channels
as the gated delta rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta_rule import (
    gated_delta_decode,
    gated_delta_prefill,
    kda_decode,
    kda_decode_update,
    kda_prefill,
)

H, V = 2, 6
K = {"gated": 4, "kda": 8}  # key width per form (KDA's gates differ per channel: more of them)

# Jitted: eager dispatch of every op costs more than compiling these tiny shapes.
PREFILL = {"gated": jax.jit(gated_delta_prefill, static_argnames="scale"),
           "kda": jax.jit(kda_prefill, static_argnames="scale")}
DECODE = {"gated": jax.jit(gated_delta_decode, static_argnames="scale"),
          "kda": jax.jit(kda_decode, static_argnames="scale")}


def _step(q, k, v, g, beta, s, scale):
    """One token on every head: S = exp(g) S (g f[H] per head, or f[H, K] per key channel: diag(exp(g)) S);
    S += k^T beta (v - k S); o = scale * q S. q, k f[H, K], v f[H, V], beta f[H], s f[H, K, V]."""
    decay = np.exp(g)
    s = (decay[:, None, None] if decay.ndim == 1 else decay[:, :, None]) * s
    delta = beta[:, None] * (v - np.einsum("hk,hkv->hv", k, s))
    s = s + k[:, :, None] * delta[:, None, :]
    return scale * np.einsum("hk,hkv->hv", q, s), s


def _recurrence(q, k, v, g, beta, s0, scale):
    """The tokens one at a time in float64."""
    s, outs = np.array(s0, np.float64), []
    for t in range(len(q)):
        o, s = _step(q[t], k[t], v[t], g[t], beta[t], s, scale)
        outs.append(o)
    return np.stack(outs), s


def _f32(a) -> jnp.ndarray:
    return jnp.asarray(np.asarray(a), jnp.float32)


def _unit(rng, *shape):
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _kda_gates(rng, *shape):
    """Log decays in [-2, 0] per key channel: channels 0, 1 near 0 (keep the whole block in play), 2, 3 near
    -2 (decay to ~e^-32 over a 16-token block), the rest anywhere in between."""
    g = rng.uniform(-2.0, 0.0, size=shape)
    g[..., :2] = rng.uniform(-0.02, 0.0, size=g[..., :2].shape)
    g[..., 2:4] = rng.uniform(-2.0, -1.9, size=g[..., 2:4].shape)
    return g


def _sequence(rng, form, n, k=None, v=V, h=H, g_low=-2.0):
    """Random (q, k, v, g, beta) of n tokens: unit q and k, g in [g_low, 0] per head or per key channel,
    beta in (0, 1)."""
    k = k or K[form]
    g = rng.uniform(g_low, 0.0, size=(n, h)) if form == "gated" else _kda_gates(rng, n, h, k)
    return (_unit(rng, n, h, k), _unit(rng, n, h, k), rng.normal(size=(n, h, v)), g,
            rng.uniform(0.01, 0.99, size=(n, h)))


def _layout(seqs, bs, rng):
    """seqs: [(data, s0 or None)] laid out in blocks of bs tokens (each sequence's last block padded with
    large finite garbage q, k, v and g = beta = 0); init is s0 (or zeros) on a sequence's first block and NaN
    on the others, never to be read. Returns the prefill arguments and each sequence's last block."""
    parts, inits, starts, last = [], [], [], []
    k = seqs[0][0][0].shape[-1]
    for data, s0 in seqs:
        n = len(data[0])
        nb = -(-n // bs)
        pad = nb * bs - n
        garbage = (100 * rng.normal(size=(pad, H, k)), 100 * rng.normal(size=(pad, H, k)),
                   100 * rng.normal(size=(pad, H, V)), np.zeros((pad, *data[3].shape[1:])),
                   np.zeros((pad, H)))
        parts.append([np.concatenate([a, b]) for a, b in zip(data, garbage, strict=True)])
        first = np.zeros((H, k, V)) if s0 is None else s0
        inits += [first] + [np.full((H, k, V), np.nan)] * (nb - 1)
        starts += [True] + [False] * (nb - 1)
        last.append(len(starts) - 1)
    q, k, v, g, beta = (_f32(np.concatenate(a).reshape(-1, bs, *a[0].shape[1:]))
                        for a in zip(*parts, strict=True))
    return (q, k, v, g, beta, _f32(np.stack(inits)), jnp.asarray(starts)), last


# KDA's pairs are built over the block padded to a power of two (kernels/delta_rule/reference.py:_kda_pairs):
# blocks of 1, 4, 16, 32 tokens and of 7 and 12 (padded inside to 8 and 16).
@pytest.mark.parametrize("form, bs", [("gated", 4), ("gated", 3), ("gated", 1), ("kda", 1), ("kda", 4),
                                      ("kda", 7), ("kda", 12), ("kda", 16), ("kda", 32)])
def test_prefill_matches_recurrence(form, bs):
    rng = np.random.default_rng(0)
    scale, k = K[form] ** -0.5, K[form]
    # bs = 4: 4 tokens fill one block (from a state), 10 span 3 blocks ending mid-block (from zeros), 3 are a
    # lone partial block (from a state), 35 span 9 blocks (from a state). bs = 16: 35 spans 3 blocks; bs = 32:
    # 35 spans 2 blocks, the others each a lone partial block.
    lens_inits = [(4, True), (10, False), (3, True), (35, True)]
    seqs = [(_sequence(rng, form, n), rng.normal(size=(H, k, V)) if has_init else None)
            for n, has_init in lens_inits]
    args, last = _layout(seqs, bs, rng)
    o, final = PREFILL[form](*args, scale=scale)
    o, final = np.asarray(o).reshape(-1, H, V), np.asarray(final)
    row = 0
    for i, (data, s0) in enumerate(seqs):
        n = len(data[0])
        want_o, want_s = _recurrence(*data, np.zeros((H, k, V)) if s0 is None else s0, scale)
        np.testing.assert_allclose(o[row : row + n], want_o, rtol=1e-4, atol=1e-4, err_msg=f"seq {i}")
        np.testing.assert_allclose(final[last[i]], want_s, rtol=1e-4, atol=1e-4, err_msg=f"seq {i}")
        row += -(-n // bs) * bs


@pytest.mark.parametrize("form", ["gated", "kda"])
def test_chained_decode_matches_prefill_and_recurrence(form):
    rng = np.random.default_rng(1)
    rows, steps, scale = 3, 6, K[form] ** -0.5
    seqs = [_sequence(rng, form, steps) for _ in range(rows)]
    s0 = rng.normal(size=(rows, H, K[form], V))
    q, k, v, g, beta = (np.stack(a, axis=0) for a in zip(*seqs, strict=True))  # [rows, steps, ...]

    state, outs = _f32(s0), []
    for t in range(steps):
        o, state = DECODE[form](*(_f32(a[:, t]) for a in (q, k, v, g, beta)), state, scale=scale)
        outs.append(np.asarray(o))
    got_o, got_s = np.stack(outs, axis=1), np.asarray(state)  # [rows, steps, H, V], [rows, H, K, V]

    # The same tokens as one prefill block per row, each row its own sequence.
    o_pre, s_pre = PREFILL[form](*(_f32(a) for a in (q, k, v, g, beta)), _f32(s0), jnp.ones(rows, bool),
                                 scale=scale)
    np.testing.assert_allclose(got_o, np.asarray(o_pre), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_s, np.asarray(s_pre), rtol=1e-5, atol=1e-5)
    for r in range(rows):
        want_o, want_s = _recurrence(*seqs[r], s0[r], scale)
        np.testing.assert_allclose(got_o[r], want_o, rtol=1e-5, atol=1e-5, err_msg=f"row {r}")
        np.testing.assert_allclose(got_s[r], want_s, rtol=1e-5, atol=1e-5, err_msg=f"row {r}")


@pytest.mark.parametrize("g_low", [-2.0, -0.05])
def test_long_block_stays_accurate(g_low):
    """bs = 64, K = V = 32: g down to -2 sums to about -64 over a block (decays underflow to 0 in float32,
    never overflow), g near 0 keeps the whole block's keys in play (the UT solve's widest reach)."""
    rng = np.random.default_rng(2)
    bs, h, d = 64, 2, 32
    data = _sequence(rng, "gated", 2 * bs, k=d, v=d, h=h, g_low=g_low)
    s0 = rng.normal(size=(h, d, d))
    blocks = [_f32(a.reshape(2, bs, *a.shape[1:])) for a in data]
    init = _f32(np.stack([s0, np.full_like(s0, np.nan)]))
    o, final = PREFILL["gated"](*blocks, init, jnp.asarray([True, False]), scale=d**-0.5)
    want_o, want_s = _recurrence(*data, s0, d**-0.5)
    np.testing.assert_allclose(np.asarray(o).reshape(2 * bs, h, d), want_o, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(final[1]), want_s, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bs", [128, 100])
def test_kda_long_block_with_strong_decays_stays_accurate(bs):
    """Two blocks of bs = 128 (and 100, padded inside to 128), K = V = 32, each key channel decaying at its
    own rate, log-uniform in [1e-3, 8] per token (times a per-token factor in [0.5, 1.5]): slow channels keep
    the whole block in play, fast ones sum to about -1000 over a block (their decays underflow to 0 in
    float32, never overflow or give NaN). Accurate to the gated form's tolerance."""
    rng = np.random.default_rng(4)
    h, d, n = 2, 32, 2 * bs
    rates = np.exp(rng.uniform(np.log(1e-3), np.log(8.0), size=(h, d)))
    rates[:, 0], rates[:, 1] = 1e-3, 8.0
    g = -rates * rng.uniform(0.5, 1.5, size=(n, h, d))
    data = (_unit(rng, n, h, d), _unit(rng, n, h, d), rng.normal(size=(n, h, d)), g,
            rng.uniform(0.01, 0.99, size=(n, h)))
    s0 = rng.normal(size=(h, d, d))
    blocks = [_f32(a.reshape(2, bs, *a.shape[1:])) for a in data]
    init = _f32(np.stack([s0, np.full_like(s0, np.nan)]))
    o, final = PREFILL["kda"](*blocks, init, jnp.asarray([True, False]), scale=d**-0.5)
    o, final = np.asarray(o), np.asarray(final)
    assert np.isfinite(o).all() and np.isfinite(final).all()
    want_o, want_s = _recurrence(*data, s0, d**-0.5)
    np.testing.assert_allclose(o.reshape(n, h, d), want_o, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final[1], want_s, rtol=1e-4, atol=1e-4)


def test_kda_with_equal_channels_is_the_gated_delta_rule():
    """g the same on every key channel: KDA is the per-head gated delta rule with that g."""
    rng = np.random.default_rng(2)
    nb, bs, k = 3, 8, K["kda"]
    q, kk = _unit(rng, nb, bs, H, k), _unit(rng, nb, bs, H, k)
    v = rng.normal(size=(nb, bs, H, V))
    g = rng.uniform(-2.0, 0.0, size=(nb, bs, H))
    beta = rng.uniform(0.01, 0.99, size=(nb, bs, H))
    init = rng.normal(size=(nb, H, k, V))
    init[1] = np.nan  # the second block continues the first
    starts = jnp.asarray([True, False, True])
    o, final = PREFILL["kda"](*map(_f32, (q, kk, v, np.repeat(g[..., None], k, -1), beta, init)), starts,
                              scale=k**-0.5)
    o_gd, final_gd = PREFILL["gated"](*map(_f32, (q, kk, v, g, beta, init)), starts, scale=k**-0.5)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_gd), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(final), np.asarray(final_gd), rtol=1e-5, atol=1e-5)


# The chained layout of tests/kernels/test_chains.py: request A (slot 1) with three drafts in scratch slots
# 6, 7, 8; B (slot 3) alone; C (slot 2) with one draft (scratch 9); a padding row on the dummy slot 0.
READ = np.array([1, 1, 6, 7, 3, 2, 2, 0], np.int32)
WRITE = np.array([1, 6, 7, 8, 3, 2, 9, 0], np.int32)
PLAIN = np.array([1, 4, 6, 7, 3, 2, 5, 0], np.int32)  # no drafts: each row reads and writes its own slot
SLOTS, LAYERS, LAYER = 10, 2, 1


@pytest.mark.parametrize("chains", [True, False])
def test_kda_decode_update_chained_rows(chains):
    """Rows one at a time in float64 (row r's state from pool[read[r]], its new one to write[r]) vs the
    pooled update: with chains (draft rows continue the row before) and without (write_slots None)."""
    rng = np.random.default_rng(3)
    read, write = (READ, WRITE) if chains else (PLAIN, PLAIN)
    rows, k = len(read), K["kda"]
    q, kk, v, g, beta = _sequence(rng, "kda", rows)
    pool = rng.normal(size=(LAYERS, SLOTS, H, k, V)).astype(np.float32)

    want_pool, want_o = pool[LAYER].astype(np.float64), []
    for r in range(rows):
        o, want_pool[write[r]] = _step(q[r], kk[r], v[r], g[r], beta[r], want_pool[read[r]], k**-0.5)
        want_o.append(o)
    o, got = jax.jit(kda_decode_update, static_argnames="scale")(
        *map(_f32, (q, kk, v, g, beta, pool)), LAYER, jnp.asarray(read),
        jnp.asarray(WRITE) if chains else None, scale=k**-0.5)
    real = read > 0  # the padding row reads the dummy slot's garbage
    np.testing.assert_allclose(np.asarray(o)[real], np.stack(want_o)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got)[LAYER, 1:], want_pool[1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[1 - LAYER], pool[1 - LAYER])  # the other layer untouched
