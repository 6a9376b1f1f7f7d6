"""The gated delta rule decode step in place on the state pool: the native kernel (kernels/cpu/delta_rule.cc)
and the gathered reference (`gated_delta_decode_update`) against the plain recurrence applied row after row in
float64 numpy, with the states read from and written to the slots the rows name: chained draft rows
(kernels/chains.py) and plain rows that read and write their own slot."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu
from kernels.cpu.build import DELTA_TARGET
from kernels.delta_rule.reference import gated_delta_decode_update

# As tests/kernels/test_chains.py: request A (slot 1) with three drafts in scratch slots 6, 7, 8; B (slot 3)
# alone; C (slot 2) with one draft (scratch 9); a padding row on the dummy slot 0. Row r reads READ[r] and
# writes WRITE[r].
READ = np.array([1, 1, 6, 7, 3, 2, 2, 0], np.int32)
WRITE = np.array([1, 6, 7, 8, 3, 2, 9, 0], np.int32)
# Plain rows (no drafts): each reads and writes its own slot.
PLAIN = np.array([4, 1, 3, 5, 2, 0], np.int32)
SLOTS, LAYERS, LAYER = 10, 2, 1
SCALE = 0.3

_IMPLS = {
    "reference": gated_delta_decode_update,
    "native": cpu.gated_delta_decode_update_native,
}


def _inputs(rng, rows, heads, dk, dv):
    def unit(shape):
        x = rng.standard_normal(shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    q, k = unit((rows, heads, dk)), unit((rows, heads, dk))
    v = rng.standard_normal((rows, heads, dv)).astype(np.float32)
    g = -rng.uniform(0.05, 1.0, (rows, heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (rows, heads)).astype(np.float32)
    pool = rng.standard_normal((LAYERS, SLOTS, heads, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, pool


def _sequential(q, k, v, g, beta, pool, read, write):
    """The rows one at a time in order, float64: row r's state from pool[read[r]], its new one to write[r]."""
    q, k, v, g, beta = (t.astype(np.float64) for t in (q, k, v, g, beta))
    pool = pool.astype(np.float64).copy()
    outs = []
    for r in range(len(read)):
        s = np.exp(g[r])[:, None, None] * pool[read[r]]  # [H, Dk, Dv]
        delta = beta[r][:, None] * (v[r] - np.einsum("hk,hkv->hv", k[r], s))
        new = s + k[r][:, :, None] * delta[:, None, :]
        outs.append(SCALE * np.einsum("hk,hkv->hv", q[r], new))
        pool[write[r]] = new
    return np.stack(outs), pool


# (heads, Dk, Dv): Dv in blocks of 4 vectors and one vector (80), with a scalar tail (85), only a tail (7).
@pytest.mark.parametrize("heads,dk,dv", [(4, 32, 80), (3, 16, 85), (2, 8, 7)])
@pytest.mark.parametrize("layout", ["chained", "plain"])
@pytest.mark.parametrize("impl", ["reference", "native"])
def test_matches_the_rows_in_order(impl, layout, heads, dk, dv):
    read = READ if layout == "chained" else PLAIN
    write = WRITE if layout == "chained" else None
    q, k, v, g, beta, pool = _inputs(np.random.default_rng(dv), len(read), heads, dk, dv)
    want_o, want_pool = _sequential(q, k, v, g, beta, pool[LAYER], read, read if write is None else write)
    fn = jax.jit(functools.partial(_IMPLS[impl], scale=SCALE))
    o, got = fn(*map(jnp.asarray, (q, k, v, g, beta, pool)), LAYER, jnp.asarray(read),
                None if write is None else jnp.asarray(write))
    o, got = np.asarray(o), np.asarray(got)
    assert o.shape == (len(read), heads, dv) and o.dtype == np.float32
    real = read > 0  # the padding row reads the dummy slot's garbage
    np.testing.assert_allclose(o[real], want_o[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[LAYER, 1:], want_pool[1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1 - LAYER], pool[1 - LAYER])  # the other layer untouched


def test_native_emits_the_custom_call():
    assert cpu.available()
    q, k, v, g, beta, pool = _inputs(np.random.default_rng(0), len(READ), 2, 16, 16)
    args = (*map(jnp.asarray, (q, k, v, g, beta, pool)), LAYER, jnp.asarray(READ), jnp.asarray(WRITE))

    def lowered(**kw):
        fn = functools.partial(cpu.gated_delta_decode_update_native, scale=SCALE, **kw)
        return jax.jit(fn).lower(*args).as_text()

    assert DELTA_TARGET in lowered()
    assert DELTA_TARGET not in lowered(interpret=True)  # the reference instead


def test_native_rejects_a_pool_of_the_wrong_shape():
    assert cpu.available()
    q, k, v, g, beta, pool = _inputs(np.random.default_rng(1), 2, 2, 8, 16)
    f32 = jnp.float32
    bad_pool = jnp.zeros((LAYERS, SLOTS, 2, 8, 17), f32)  # Dv 17, v's 16
    call = jax.ffi.ffi_call(DELTA_TARGET, (jax.ShapeDtypeStruct(v.shape, f32),
                                           jax.ShapeDtypeStruct(bad_pool.shape, f32)))
    layer, slots = jnp.asarray([0], jnp.int32), jnp.asarray([1, 2], jnp.int32)
    with pytest.raises(Exception, match="xlaserve_cpu_delta_decode"):
        jax.block_until_ready(call(*map(jnp.asarray, (q, k, v, g, beta)), bad_pool, layer, slots, slots,
                                   scale=np.float32(SCALE)))
