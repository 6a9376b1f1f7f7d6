"""The gated delta rule decode step in place on the state pool, with a decay per head (Gated DeltaNet) or per
key channel (KDA): the native kernel (kernels/cpu/delta_rule.cc, one for both) and the gathered references
(`gated_delta_decode_update`, `kda_decode_update`) against the plain recurrence applied row after row in
float64 numpy, with the states read from and written to the slots the rows name: chained draft rows
(kernels/chains.py) and plain rows that read and write their own slot. The native kernel gives the same bits
whichever thread runs which head."""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu
from kernels.cpu.build import DELTA_TARGET
from kernels.delta_rule.reference import gated_delta_decode_update, kda_decode_update

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
    ("gated", "reference"): gated_delta_decode_update,
    ("gated", "native"): cpu.gated_delta_decode_update_native,
    ("kda", "reference"): kda_decode_update,
    ("kda", "native"): cpu.kda_decode_update_native,
}


def _inputs(rng, rows, heads, dk, dv, form="gated"):
    def unit(shape):
        x = rng.standard_normal(shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    q, k = unit((rows, heads, dk)), unit((rows, heads, dk))
    v = rng.standard_normal((rows, heads, dv)).astype(np.float32)
    # KDA: a decay per key channel, some near 1 and some near 0 (as trained layers' are)
    g_shape = (rows, heads, dk) if form == "kda" else (rows, heads)
    g = -rng.uniform(0.05, 1.0, g_shape).astype(np.float32)
    if form == "kda":
        g *= rng.choice(np.array([0.01, 1.0, 8.0], np.float32), g_shape)
    beta = rng.uniform(0.0, 1.0, (rows, heads)).astype(np.float32)
    pool = rng.standard_normal((LAYERS, SLOTS, heads, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, pool


def _sequential(q, k, v, g, beta, pool, read, write):
    """The rows one at a time in order, float64: row r's state from pool[read[r]], its new one to write[r]."""
    q, k, v, g, beta = (t.astype(np.float64) for t in (q, k, v, g, beta))
    pool = pool.astype(np.float64).copy()
    outs = []
    for r in range(len(read)):
        decay = np.exp(g[r])  # [H] or [H, Dk]
        s = (decay[:, None, None] if decay.ndim == 1 else decay[:, :, None]) * pool[read[r]]  # [H, Dk, Dv]
        delta = beta[r][:, None] * (v[r] - np.einsum("hk,hkv->hv", k[r], s))
        new = s + k[r][:, :, None] * delta[:, None, :]
        outs.append(SCALE * np.einsum("hk,hkv->hv", q[r], new))
        pool[write[r]] = new
    return np.stack(outs), pool


# (heads, Dk, Dv): Dv in blocks of 4 vectors and one vector (80), with a scalar tail (85), only a tail (7); Dk
# (KDA's decays, exp'd a vector at a time) in vectors (32), with a tail (20), only a tail (8).
@pytest.mark.parametrize("heads,dk,dv", [(4, 32, 80), (3, 20, 85), (2, 8, 7)])
@pytest.mark.parametrize("layout", ["chained", "plain"])
@pytest.mark.parametrize("impl", ["reference", "native"])
@pytest.mark.parametrize("form", ["gated", "kda"])
def test_matches_the_rows_in_order(form, impl, layout, heads, dk, dv):
    read = READ if layout == "chained" else PLAIN
    write = WRITE if layout == "chained" else None
    q, k, v, g, beta, pool = _inputs(np.random.default_rng(dv), len(read), heads, dk, dv, form)
    want_o, want_pool = _sequential(q, k, v, g, beta, pool[LAYER], read, read if write is None else write)
    fn = jax.jit(functools.partial(_IMPLS[form, impl], scale=SCALE))
    o, got = fn(*map(jnp.asarray, (q, k, v, g, beta, pool)), LAYER, jnp.asarray(read),
                None if write is None else jnp.asarray(write))
    o, got = np.asarray(o), np.asarray(got)
    assert o.shape == (len(read), heads, dv) and o.dtype == np.float32
    real = read > 0  # the padding row reads the dummy slot's garbage
    np.testing.assert_allclose(o[real], want_o[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[LAYER, 1:], want_pool[1:], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1 - LAYER], pool[1 - LAYER])  # the other layer untouched


@pytest.mark.parametrize("form", ["gated", "kda"])
def test_native_gives_the_same_bits_whichever_thread_runs_a_head(form):
    """Each chain's rows of a head run on one thread, in order, with that thread's own scratch: repeated
    calls, and calls from several Python threads at once (a caller that finds the helper threads busy works
    alone, so heads land on other threads), agree exactly."""
    read, write = jnp.asarray(READ), jnp.asarray(WRITE)
    fn = jax.jit(functools.partial(_IMPLS[form, "native"], scale=SCALE))
    inputs = [_inputs(np.random.default_rng(10 + i), len(READ), 8, 32, 64, form) for i in range(3)]

    def run(i):
        *operands, pool = map(jnp.asarray, inputs[i])
        o, new = fn(*operands, jnp.array(pool, copy=True), LAYER, read, write)
        return np.asarray(o), np.asarray(new)

    first = [run(i) for i in range(len(inputs))]
    for _ in range(5):
        for got, want in zip(run(0), first[0]):
            np.testing.assert_array_equal(got, want)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        jobs = list(range(len(inputs))) * 4
        for i, result in zip(jobs, pool.map(run, jobs)):
            for got, want in zip(result, first[i]):
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("form", ["gated", "kda"])
def test_native_emits_the_custom_call(form):
    assert cpu.available()
    q, k, v, g, beta, pool = _inputs(np.random.default_rng(0), len(READ), 2, 16, 16, form)
    args = (*map(jnp.asarray, (q, k, v, g, beta, pool)), LAYER, jnp.asarray(READ), jnp.asarray(WRITE))

    def lowered(**kw):
        fn = functools.partial(_IMPLS[form, "native"], scale=SCALE, **kw)
        return jax.jit(fn).lower(*args).as_text()

    assert DELTA_TARGET in lowered()
    assert DELTA_TARGET not in lowered(interpret=True)  # the reference instead


@pytest.mark.parametrize("what", ["pool", "decays"])
def test_native_rejects_operands_of_the_wrong_shape(what):
    assert cpu.available()
    q, k, v, g, beta, pool = _inputs(np.random.default_rng(1), 2, 2, 8, 16, "kda")
    f32 = jnp.float32
    pool = jnp.zeros((LAYERS, SLOTS, 2, 8, 17 if what == "pool" else 16), f32)  # Dv 17, v's 16
    if what == "decays":
        g = g[..., :7]  # KDA's decays for 7 key channels of 8
    call = jax.ffi.ffi_call(DELTA_TARGET, (jax.ShapeDtypeStruct(v.shape, f32),
                                           jax.ShapeDtypeStruct(pool.shape, f32)))
    layer, slots = jnp.asarray([0], jnp.int32), jnp.asarray([1, 2], jnp.int32)
    with pytest.raises(Exception, match="xlaserve_cpu_delta_decode"):
        jax.block_until_ready(call(*map(jnp.asarray, (q, k, v, g, beta)), pool, layer, slots, slots,
                                   scale=np.float32(SCALE)))
