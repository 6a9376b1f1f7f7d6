"""Pallas chunked gated delta rule and KDA prefills (interpret mode) vs the plain-jnp references, and their
lowering."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.delta_rule import pallas, reference
from tests.helpers import assert_allclose_to_scale

H, DK, DV = 2, 16, 8
SCALE = DK**-0.5
TOL = 1e-4  # of the largest magnitude: two float32 orders of the same sums (UT solve vs triangular solve)


def _unit(rng, *shape):
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _batch(rng, lens, continues, bs, per_channel=False, max_decay=None):
    """Blocks of sequences of the given lengths laid out like the batch builder (a sequence's blocks
    consecutive, the last padded with g = beta = 0 and large finite garbage q, k, v), then one all-padding
    block. Unit q and k, g in [-2, 0] (per head, or with `per_channel` per key channel: KDA), beta in (0, 1).
    With `max_decay`, each sequence's key channels decay at rates log-uniform in [1e-3, max_decay] instead
    (times a per-token factor in [0.5, 1.5]): fast and slow channels side by side, as KDA's gates learn.

    continues: per sequence, whether it enters from a nonzero `init` (else zeros). Blocks that do not start
    a sequence get a NaN init, which must never be read.
    """
    q, k, v, g, beta, init, starts = [], [], [], [], [], [], []
    for n, cont in (*zip(lens, continues, strict=True), (0, False)):
        num_blocks = max(1, -(-n // bs))
        t = num_blocks * bs
        real = (np.arange(t) < n)[:, None]
        q.append(np.where(real[..., None], _unit(rng, t, H, DK), 100 * rng.normal(size=(t, H, DK))))
        k.append(np.where(real[..., None], _unit(rng, t, H, DK), 100 * rng.normal(size=(t, H, DK))))
        v.append(np.where(real[..., None], rng.normal(size=(t, H, DV)), -100.0))
        if max_decay is not None:
            rates = np.exp(rng.uniform(np.log(1e-3), np.log(max_decay), size=(H, DK)))
            g.append(np.where(real[..., None], -rates * rng.uniform(0.5, 1.5, size=(t, H, DK)), 0.0))
        elif per_channel:
            g.append(np.where(real[..., None], rng.uniform(-2.0, 0.0, size=(t, H, DK)), 0.0))
        else:
            g.append(np.where(real, rng.uniform(-2.0, 0.0, size=(t, H)), 0.0))
        beta.append(np.where(real, rng.uniform(0.01, 0.99, size=(t, H)), 0.0))
        s0 = rng.normal(size=(H, DK, DV)) if cont else np.zeros((H, DK, DV))
        init += [s0] + [np.full_like(s0, np.nan)] * (num_blocks - 1)
        starts += [True] + [False] * (num_blocks - 1)

    def blocks(parts):
        a = np.concatenate(parts)
        return a.reshape(-1, bs, *a.shape[1:])

    real = blocks([b > 0 for b in beta])[..., 0]  # bool[nb, bs]
    arrays = (blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta), np.stack(init), np.asarray(starts))
    return arrays, real


CASES = {
    # 16-token blocks: sequences crossing blocks and ending mid-block, one exactly a block, a lone partial
    # block; two continue from a nonzero init.
    "bs16": dict(lens=(37, 16, 5, 20), continues=(True, False, True, False), bs=16),
    # 8-token blocks: a long sequence from init spanning several blocks, then short ones.
    "bs8": dict(lens=(29, 3, 8, 11), continues=(True, True, False, True), bs=8),
    # 12-token blocks (not a power of two): sequences ending mid-block and on a block boundary.
    "bs12": dict(lens=(30, 12, 7, 25), continues=(True, False, True, True), bs=12),
}
OPS = {"gated_delta": False, "kda": True}  # op -> per-key-channel decay


def _check_against_reference(op, arrays, real, dtype):
    """The Pallas `op` prefill in the interpreter equals the reference on the real tokens' outputs and on
    every block's final state."""
    q, k, v, g, beta, init, starts = arrays
    assert np.abs(init[starts]).max() > 0  # a sequence really enters from a nonzero state
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(g, jnp.float32),
        jnp.asarray(beta, jnp.float32),
        jnp.asarray(init, jnp.float32),
        jnp.asarray(starts),
    )
    want_fn = jax.jit(getattr(reference, f"{op}_prefill"), static_argnames="scale")
    want_o, want_final = want_fn(*args, scale=SCALE)
    got_o, got_final = getattr(pallas, f"{op}_prefill")(*args, scale=SCALE, interpret=True)
    assert got_o.dtype == got_final.dtype == jnp.float32
    assert got_o.shape == want_o.shape and got_final.shape == want_final.shape
    # Padding outputs are garbage by contract (garbage inputs); compare the real tokens' outputs. Both
    # compute in float32 from the same (possibly bf16-rounded) inputs, so one tolerance serves both dtypes.
    want_o = np.asarray(want_o)
    assert np.isfinite(want_o[real]).all() and np.isfinite(np.asarray(want_final)).all()
    assert_allclose_to_scale(np.asarray(got_o)[real], want_o[real], TOL)
    assert_allclose_to_scale(got_final, want_final, TOL)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", list(OPS))
def test_matches_reference(op, case, dtype):
    spec = CASES[case]
    rng = np.random.default_rng(sorted(CASES).index(case))
    arrays, real = _batch(rng, **spec, per_channel=OPS[op])
    starts = arrays[-1]
    assert starts.sum() == len(spec["lens"]) + 1 and (~starts).any()  # several sequences, some multi-block
    assert any(n % spec["bs"] for n in spec["lens"])  # a sequence ends mid-block: padding in its last block
    _check_against_reference(op, arrays, real, dtype)


def test_kda_long_block_strong_decays():
    # 128-token blocks and channels decaying at rates from 1e-3 to 8 a token: within a block, fast channels
    # forget everything a few tokens back (their pairwise decays underflow) next to slow ones that carry the
    # state across blocks, where the exponents must stay exact.
    rng = np.random.default_rng(7)
    spec = dict(lens=(300, 90), continues=(True, True), bs=128, per_channel=True, max_decay=8.0)
    arrays, real = _batch(rng, **spec)
    first_block_decay = np.exp(arrays[3][0].sum(axis=0))  # [H, Dk] over the first (full) block
    assert first_block_decay.min() < 1e-30 and first_block_decay.max() > 0.5
    _check_against_reference("kda", arrays, real, "float32")


def test_kda_rejects_a_decay_per_head():
    rng = np.random.default_rng(0)
    (q, k, v, g, beta, init, starts), _ = _batch(rng, **CASES["bs8"])  # g f32[nb, bs, H]: Gated DeltaNet's
    with pytest.raises(ValueError, match="one log decay per key channel"):
        pallas.kda_prefill(q, k, v, g, beta, init, starts, scale=SCALE, interpret=True)


@pytest.mark.parametrize(
    "platform, backend, marker", [("tpu", "tpu", "tpu_custom_call"), ("cuda", "gpu", "triton")]
)
@pytest.mark.parametrize("op", list(OPS))
def test_lowers_for_tpu_and_gpu(monkeypatch, op, platform, backend, marker):
    # Portability guard from this CPU host: the kernel must lower to Mosaic (TPU) and Triton (GPU) IR, so a
    # primitive neither supports (cumsum or a triangular solve in Mosaic, say) fails here. Compiling needs
    # the device.
    monkeypatch.setattr(jax, "default_backend", lambda: backend)  # picks the backend's compiler params
    nb, bs, h, dk, dv = 2, 64, 4, 128, 128
    shapes = [
        ((nb, bs, h, dk), jnp.bfloat16),
        ((nb, bs, h, dk), jnp.bfloat16),
        ((nb, bs, h, dv), jnp.bfloat16),
        ((nb, bs, h, dk) if OPS[op] else (nb, bs, h), jnp.float32),
        ((nb, bs, h), jnp.float32),
        ((nb, h, dk, dv), jnp.float32),
        ((nb,), jnp.bool_),
    ]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    # A fresh function each time: jit caches traces per function, and the trace holds the compiler params.
    fn = functools.partial(getattr(pallas, f"{op}_prefill").__wrapped__, scale=dk**-0.5)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text
