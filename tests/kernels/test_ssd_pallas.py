"""Pallas chunked SSD prefill (interpret mode) vs the plain-jnp reference over shapes, groups and dtypes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.ssd import pallas, reference
from tests.helpers import SCAN_KERNEL_TOLERANCE, assert_allclose_to_scale


def _batch(rng, lens, *, continues, heads, head_dim, groups, state, block_size):
    """Blocks of sequences of the given lengths laid out like the batch builder (a sequence's blocks
    consecutive, the last padded with dt = 0 and large garbage x, B, C), then one all-padding block.

    continues: per sequence, whether it enters from a nonzero `init` (else zeros). Blocks that do not
    start a sequence get a NaN init, which must never be read.
    """
    x, dt, b, c, init, starts = [], [], [], [], [], []
    for n, cont in (*zip(lens, continues, strict=True), (0, False)):
        num_blocks = max(1, -(-n // block_size))
        t = num_blocks * block_size
        real = (np.arange(t) < n)[:, None]
        x.append(np.where(real[..., None], rng.normal(size=(t, heads, head_dim)), 100.0))
        dt.append(np.where(real, rng.uniform(0.05, 1.0, size=(t, heads)), 0.0))
        b.append(np.where(real[..., None], rng.normal(size=(t, groups, state)), 100.0))
        c.append(np.where(real[..., None], rng.normal(size=(t, groups, state)), -100.0))
        h0 = rng.normal(size=(heads, head_dim, state)) if cont else np.zeros((heads, head_dim, state))
        init += [h0] + [np.full_like(h0, np.nan)] * (num_blocks - 1)
        starts += [True] + [False] * (num_blocks - 1)

    def blocks(parts):
        a = np.concatenate(parts)
        return a.reshape(-1, block_size, *a.shape[1:])

    return blocks(x), blocks(dt), blocks(b), blocks(c), np.stack(init), np.asarray(starts)


CASES = {
    # Several sequences in one batch: lengths crossing blocks and ending mid-block, one exactly a block,
    # a lone partial block; the second continues from a nonzero init (its first block reads it).
    "mixed_g2": dict(
        lens=(21, 8, 3, 13),
        continues=(False, True, False, True),
        heads=4,
        head_dim=3,
        groups=2,
        state=5,
        block_size=8,
    ),
    # One group shared by all heads, 16-token blocks, a long sequence continuing from init.
    "long_g1": dict(
        lens=(40, 17), continues=(True, False), heads=2, head_dim=4, groups=1, state=8, block_size=16
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype):
    spec = CASES[case]
    rng = np.random.default_rng(sorted(CASES).index(case))
    x, dt, b, c, init, starts = _batch(rng, **spec)
    assert starts.sum() == len(spec["lens"]) + 1 and (~starts).any()  # several sequences, some multi-block
    assert np.abs(init[starts]).max() > 0  # a sequence really enters from a nonzero state
    A = -np.exp(rng.normal(size=spec["heads"]))
    args = (
        jnp.asarray(x, dtype),
        jnp.asarray(dt, jnp.float32),
        jnp.asarray(A, jnp.float32),
        jnp.asarray(b, dtype),
        jnp.asarray(c, dtype),
        jnp.asarray(init, jnp.float32),
        jnp.asarray(starts),
    )
    want_y, want_final = reference.ssd_prefill(*args)
    got_y, got_final = pallas.ssd_prefill(*args, interpret=True)
    assert got_y.dtype == got_final.dtype == jnp.float32
    assert got_y.shape == want_y.shape and got_final.shape == want_final.shape
    tol = SCAN_KERNEL_TOLERANCE[dtype]
    # Padding outputs are garbage by contract (garbage inputs); compare the real tokens' outputs.
    real = np.asarray(dt[..., 0] > 0)  # bool[nb, bs]
    want_y = np.asarray(want_y)
    assert np.isfinite(want_y[real]).all() and np.isfinite(np.asarray(want_final)).all()
    assert_allclose_to_scale(np.asarray(got_y)[real], want_y[real], tol)
    assert_allclose_to_scale(got_final, want_final, tol)


@pytest.mark.parametrize(
    "platform, backend, marker", [("tpu", "tpu", "tpu_custom_call"), ("cuda", "gpu", "triton")]
)
def test_lowers_for_tpu_and_gpu(monkeypatch, platform, backend, marker):
    # Portability guard from this CPU host: the kernel must lower to Mosaic (TPU) and Triton (GPU) IR, so a
    # primitive neither supports (cumsum in Mosaic, say) fails here. Compiling needs the device.
    monkeypatch.setattr(jax, "default_backend", lambda: backend)  # picks the backend's compiler params
    nb, bs, h, p, g, n = 2, 64, 4, 64, 2, 128
    shapes = [
        ((nb, bs, h, p), jnp.bfloat16),
        ((nb, bs, h), jnp.float32),
        ((h,), jnp.float32),
        ((nb, bs, g, n), jnp.bfloat16),
        ((nb, bs, g, n), jnp.bfloat16),
        ((nb, h, p, n), jnp.float32),
        ((nb,), jnp.bool_),
    ]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    # A fresh function each time: jit caches traces per function, and the trace holds the compiler params.
    fn = functools.partial(pallas.ssd_prefill.__wrapped__)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text
