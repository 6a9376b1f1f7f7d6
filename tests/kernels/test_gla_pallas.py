"""Pallas chunked Lightning / simple-GLA prefill (interpret mode) vs the plain-jnp reference over shapes,
decay forms and dtypes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.gla import pallas, reference
from tests.helpers import SCAN_KERNEL_TOLERANCE, assert_allclose_to_scale

SCALE = 0.7


def _batch(rng, lens, *, continues, heads, dk, dv, block_size):
    """Blocks of sequences of the given lengths laid out like the batch builder (a sequence's blocks
    consecutive, the last padded with k = 0, g = 0 and large garbage q, v), then one all-padding block.

    continues: per sequence, whether it enters from a nonzero `init` (else zeros). Blocks that do not
    start a sequence get a NaN init, which must never be read.
    """
    q, k, v, g, init, starts = [], [], [], [], [], []
    for n, cont in (*zip(lens, continues, strict=True), (0, False)):
        num_blocks = max(1, -(-n // block_size))
        t = num_blocks * block_size
        real = (np.arange(t) < n)[:, None]
        q.append(np.where(real[..., None], rng.normal(size=(t, heads, dk)), 100.0))
        k.append(np.where(real[..., None], rng.normal(size=(t, heads, dk)), 0.0))
        v.append(np.where(real[..., None], rng.normal(size=(t, heads, dv)), -100.0))
        g.append(np.where(real, -rng.uniform(0.0, 1.0, size=(t, heads)), 0.0))
        s0 = rng.normal(size=(heads, dk, dv)) if cont else np.zeros((heads, dk, dv))
        init += [s0] + [np.full_like(s0, np.nan)] * (num_blocks - 1)
        starts += [True] + [False] * (num_blocks - 1)

    def blocks(parts):
        a = np.concatenate(parts)
        return a.reshape(-1, block_size, *a.shape[1:])

    return blocks(q), blocks(k), blocks(v), blocks(g), np.stack(init), np.asarray(starts)


CASES = {
    # Several sequences in one batch: lengths crossing blocks and ending mid-block, one exactly a block,
    # a lone partial block; two continue from a nonzero init. Per-token decay (0 on padding), as callers pass.
    "mixed_per_token": dict(
        lens=(21, 8, 3, 13),
        continues=(False, True, False, True),
        heads=3,
        dk=4,
        dv=5,
        block_size=8,
        per_head=False,
    ),
    # One decay per head (MiniMax's slopes before padding is masked): it decays padding tokens too, in
    # both implementations alike; 16-token blocks, a long sequence continuing from init.
    "long_per_head": dict(
        lens=(40, 17), continues=(True, False), heads=2, dk=8, dv=4, block_size=16, per_head=True
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, dtype):
    spec = dict(CASES[case])
    per_head = spec.pop("per_head")
    rng = np.random.default_rng(sorted(CASES).index(case))
    q, k, v, g, init, starts = _batch(rng, **spec)
    assert starts.sum() == len(spec["lens"]) + 1 and (~starts).any()  # several sequences, some multi-block
    assert np.abs(init[starts]).max() > 0  # a sequence really enters from a nonzero state
    log_decay = -rng.uniform(0.05, 1.0, size=spec["heads"]) if per_head else g
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(log_decay, jnp.float32),
        jnp.asarray(init, jnp.float32),
        jnp.asarray(starts),
    )
    want_o, want_final = reference.gla_prefill(*args, scale=SCALE)
    got_o, got_final = pallas.gla_prefill(*args, scale=SCALE, interpret=True)
    assert got_o.dtype == got_final.dtype == jnp.float32
    assert got_o.shape == want_o.shape and got_final.shape == want_final.shape
    tol = SCAN_KERNEL_TOLERANCE[dtype]
    # Padding outputs are garbage by contract (garbage inputs); compare the real tokens' outputs.
    real = np.abs(k).sum(axis=(2, 3)) > 0  # bool[nb, bs]
    want_o = np.asarray(want_o)
    assert np.isfinite(want_o[real]).all() and np.isfinite(np.asarray(want_final)).all()
    assert_allclose_to_scale(np.asarray(got_o)[real], want_o[real], tol)
    assert_allclose_to_scale(got_final, want_final, tol)


@pytest.mark.parametrize(
    "platform, backend, marker", [("tpu", "tpu", "tpu_custom_call"), ("cuda", "gpu", "triton")]
)
def test_lowers_for_tpu_and_gpu(monkeypatch, platform, backend, marker):
    # Portability guard from this CPU host: the kernel must lower to Mosaic (TPU) and Triton (GPU) IR, so a
    # primitive neither supports (cumsum in Mosaic, say) fails here. Compiling needs the device.
    monkeypatch.setattr(jax, "default_backend", lambda: backend)  # picks the backend's compiler params
    nb, bs, h, dk, dv = 2, 64, 4, 64, 128
    shapes = [
        ((nb, bs, h, dk), jnp.bfloat16),
        ((nb, bs, h, dk), jnp.bfloat16),
        ((nb, bs, h, dv), jnp.bfloat16),
        ((nb, bs, h), jnp.float32),
        ((nb, h, dk, dv), jnp.float32),
        ((nb,), jnp.bool_),
    ]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    # A fresh function each time: jit caches traces per function, and the trace holds the compiler params.
    fn = functools.partial(pallas.gla_prefill.__wrapped__, scale=0.125)
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert marker in text
