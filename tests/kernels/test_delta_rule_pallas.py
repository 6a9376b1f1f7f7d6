"""Pallas chunked gated delta rule prefill (interpret mode) vs the plain-jnp reference, and its lowering."""

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


def _batch(rng, lens, continues, bs):
    """Blocks of sequences of the given lengths laid out like the batch builder (a sequence's blocks
    consecutive, the last padded with g = beta = 0 and large finite garbage q, k, v), then one all-padding
    block. Unit q and k, g in [-2, 0], beta in (0, 1).

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
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype):
    spec = CASES[case]
    rng = np.random.default_rng(sorted(CASES).index(case))
    (q, k, v, g, beta, init, starts), real = _batch(rng, **spec)
    assert starts.sum() == len(spec["lens"]) + 1 and (~starts).any()  # several sequences, some multi-block
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
    want_o, want_final = jax.jit(reference.gated_delta_prefill, static_argnames="scale")(*args, scale=SCALE)
    got_o, got_final = pallas.gated_delta_prefill(*args, scale=SCALE, interpret=True)
    assert got_o.dtype == got_final.dtype == jnp.float32
    assert got_o.shape == want_o.shape and got_final.shape == want_final.shape
    # Padding outputs are garbage by contract (garbage inputs); compare the real tokens' outputs. Both
    # compute in float32 from the same (possibly bf16-rounded) inputs, so one tolerance serves both dtypes.
    want_o = np.asarray(want_o)
    assert np.isfinite(want_o[real]).all() and np.isfinite(np.asarray(want_final)).all()
    assert_allclose_to_scale(np.asarray(got_o)[real], want_o[real], TOL)
    assert_allclose_to_scale(got_final, want_final, TOL)


@pytest.mark.parametrize(
    "platform, backend, marker", [("tpu", "tpu", "tpu_custom_call"), ("cuda", "gpu", "triton")]
)
def test_lowers_for_tpu_and_gpu(monkeypatch, platform, backend, marker):
    # Portability guard from this CPU host: the kernel must lower to Mosaic (TPU) and Triton (GPU) IR, so a
    # primitive neither supports (cumsum or a triangular solve in Mosaic, say) fails here. Compiling needs
    # the device.
    monkeypatch.setattr(jax, "default_backend", lambda: backend)  # picks the backend's compiler params
    nb, bs, h, dk, dv = 2, 64, 4, 128, 128
    shapes = [
        ((nb, bs, h, dk), jnp.bfloat16),
        ((nb, bs, h, dk), jnp.bfloat16),
        ((nb, bs, h, dv), jnp.bfloat16),
        ((nb, bs, h), jnp.float32),
        ((nb, bs, h), jnp.float32),
        ((nb, h, dk, dv), jnp.float32),
        ((nb,), jnp.bool_),
    ]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    # A fresh function each time: jit caches traces per function, and the trace holds the compiler params.
    fn = functools.partial(pallas.gated_delta_prefill.__wrapped__, scale=dk**-0.5)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text
