"""Chained decode rows (kernels/chains.py): speculative draft rows of a recurrent layer, each continuing the
state of the row before it. Every form (the gathered reference of SSD, conv, selective scan and GLA, and the
native in-place SSD, conv, gated delta rule and KDA kernels) against the plain one-row decode step applied
row after row in float64 numpy, with the states read from and written to the slots the rows name; and the
multi-step updates (SSD, the gated delta rule and KDA; reference and Pallas interpreted) the same way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu
from kernels.chains import chain_depth, chain_links, run_chained
from kernels.conv1d.reference import causal_conv1d_decode, conv1d_decode_update
from kernels.gla.reference import gla_decode
from kernels.selective_scan.reference import selective_scan_decode
from kernels.ssd.reference import ssd_decode, ssd_decode_update

# Rows: request A (slot 1) with three drafts in scratch slots 6, 7, 8; B (slot 3) alone; C (slot 2) with one
# draft (scratch 9); a padding row on the dummy slot 0. Row r reads READ[r] and writes WRITE[r].
READ = np.array([1, 1, 6, 7, 3, 2, 2, 0], np.int32)
WRITE = np.array([1, 6, 7, 8, 3, 2, 9, 0], np.int32)
CHAINED = [False, True, True, True, False, False, True, False]
SLOTS, LAYERS, LAYER = 10, 2, 1


def test_chain_links_and_depth():
    chained = chain_links(jnp.asarray(READ), jnp.asarray(WRITE))
    assert np.asarray(chained).tolist() == CHAINED
    assert int(chain_depth(chained)) == 3
    plain = jnp.asarray([4, 1, 2, 0], jnp.int32)  # no drafts: every row reads and writes its own slot
    assert not np.asarray(chain_links(plain, plain)).any()
    assert int(chain_depth(chain_links(plain, plain))) == 0


def _sequential(step, pool: np.ndarray, write: np.ndarray = WRITE, read: np.ndarray = READ):
    """The rows one at a time in order, float64: row r's state from pool[read[r]], its new one to write[r]."""
    pool = pool.astype(np.float64).copy()
    outs = []
    for r in range(len(read)):
        out, new = step(r, pool[read[r]])
        pool[write[r]] = new
        outs.append(out)
    return np.stack(outs), pool


def _ssd_inputs(rng, rows, heads=4, p=8, groups=2, n=16):
    x = rng.standard_normal((rows, heads, p)).astype(np.float32)
    dt = rng.uniform(0.01, 0.5, (rows, heads)).astype(np.float32)
    a = -rng.uniform(0.5, 2.0, heads).astype(np.float32)
    b, c = (rng.standard_normal((rows, groups, n)).astype(np.float32) for _ in range(2))
    pool = rng.standard_normal((LAYERS, SLOTS, heads, p, n)).astype(np.float32)
    return x, dt, a, b, c, pool


def _ssd_row(x, dt, a, b, c):
    heads, groups = x.shape[1], b.shape[1]

    def step(r, s):  # s [H, P, N]
        g = np.arange(heads) // (heads // groups)
        decay = np.exp(dt[r].astype(np.float64) * a)[:, None, None]
        new = decay * s + dt[r][:, None, None] * x[r][:, :, None] * b[r][g][:, None, :]
        return np.einsum("hpn,hn->hp", new, c[r][g].astype(np.float64)), new
    return step


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_ssd_chained_update(impl):
    rng = np.random.default_rng(0)
    x, dt, a, b, c, pool = _ssd_inputs(rng, len(READ))
    want_y, want_pool = _sequential(_ssd_row(x, dt, a, b, c), pool[LAYER])
    fn = ssd_decode_update if impl == "reference" else cpu.ssd_decode_update_native
    y, got = jax.jit(fn)(*map(jnp.asarray, (x, dt, a, b, c, pool)), LAYER, jnp.asarray(READ),
                         jnp.asarray(WRITE))
    real = READ > 0  # the padding row reads the dummy slot's garbage
    np.testing.assert_allclose(np.asarray(y)[real], want_y[real], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got)[LAYER, 1:], want_pool[1:], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got)[0], pool[0])  # the other layer untouched


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_conv_chained_update(impl):
    rng = np.random.default_rng(1)
    rows, channels, k = len(READ), 24, 4
    x = rng.standard_normal((rows, channels)).astype(np.float32)
    w = rng.standard_normal((channels, k)).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)
    pool = rng.standard_normal((LAYERS, SLOTS, channels, k - 1)).astype(np.float32)

    def step(r, s):  # s [C, K-1]
        window = np.concatenate([s, x[r][:, None]], axis=1)
        return (window * w).sum(1) + bias, window[:, 1:]
    want_y, want_pool = _sequential(step, pool[LAYER])
    fn = conv1d_decode_update if impl == "reference" else cpu.conv1d_decode_update_native
    y, got = jax.jit(fn)(*map(jnp.asarray, (x, w, bias, pool)), LAYER, jnp.asarray(READ), jnp.asarray(WRITE))
    real = READ > 0
    np.testing.assert_allclose(np.asarray(y)[real], want_y[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got)[LAYER, 1:], want_pool[1:], rtol=1e-6, atol=1e-6)


def _gathered(step_jnp, pool: np.ndarray):
    """The gathered form a model layer uses (models/recurrent.py): states gathered from READ, the rows run
    by `run_chained`, the final states scattered to WRITE."""
    out, new = run_chained(step_jnp, jnp.asarray(pool)[jnp.asarray(READ)],
                           chain_links(jnp.asarray(READ), jnp.asarray(WRITE)))
    return np.asarray(out), np.asarray(jnp.asarray(pool).at[jnp.asarray(WRITE)].set(new))


def _check(got, want):
    real = READ > 0
    np.testing.assert_allclose(got[0][real], want[0][real], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1][1:], want[1][1:], rtol=1e-4, atol=1e-4)


def test_run_chained_ssd_matches_the_rows_in_order():
    x, dt, a, b, c, pool = _ssd_inputs(np.random.default_rng(2), len(READ))
    got = _gathered(lambda s: ssd_decode(*map(jnp.asarray, (x, dt, a, b, c)), s), pool[LAYER])
    _check(got, _sequential(_ssd_row(x, dt, a, b, c), pool[LAYER]))


def test_run_chained_selective_scan_matches_the_rows_in_order():
    rng = np.random.default_rng(3)
    rows, dn, n = len(READ), 12, 8
    u = rng.standard_normal((rows, dn)).astype(np.float32)
    dt = rng.uniform(0.01, 0.5, (rows, dn)).astype(np.float32)
    a = -rng.uniform(0.5, 2.0, (dn, n)).astype(np.float32)
    b, c = (rng.standard_normal((rows, n)).astype(np.float32) for _ in range(2))
    pool = rng.standard_normal((SLOTS, dn, n)).astype(np.float32)

    def step(r, s):
        new = np.exp(dt[r][:, None] * a) * s + (dt[r] * u[r])[:, None] * b[r][None, :]
        return new @ c[r].astype(np.float64), new
    got = _gathered(lambda s: selective_scan_decode(*map(jnp.asarray, (u, dt, a, b, c)), s), pool)
    _check(got, _sequential(step, pool))


def test_run_chained_gla_and_conv_states_together():
    """A pytree of states (GLA state and a conv window, as LayerStates holds them) chained together."""
    rng = np.random.default_rng(4)
    rows, h, kd, vd = len(READ), 2, 4, 5
    q, k = (rng.standard_normal((rows, h, kd)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((rows, h, vd)).astype(np.float32)
    log_decay = -rng.uniform(0.1, 1.0, h).astype(np.float32)
    pool = rng.standard_normal((SLOTS, h, kd, vd)).astype(np.float32)
    conv_pool = rng.standard_normal((SLOTS, 3, 2)).astype(np.float32)
    cx, cw = rng.standard_normal((rows, 3)).astype(np.float32), rng.standard_normal((3, 3)).astype(np.float32)

    def step_jnp(states):
        s, conv = states
        o, new = gla_decode(*map(jnp.asarray, (q, k, v, log_decay)), s, scale=0.5)
        u, new_conv = causal_conv1d_decode(jnp.asarray(cx), jnp.asarray(cw), None, conv)
        return (o, u), (new, new_conv)

    read, write = jnp.asarray(READ), jnp.asarray(WRITE)
    (o, u), (new, new_conv) = run_chained(
        step_jnp, (jnp.asarray(pool)[read], jnp.asarray(conv_pool)[read]), chain_links(read, write))

    def gla_row(r, s):
        new = np.exp(log_decay)[:, None, None] * s + np.einsum("hk,hv->hkv", k[r], v[r])
        return 0.5 * np.einsum("hk,hkv->hv", q[r], new), new

    def conv_row(r, s):
        window = np.concatenate([s, cx[r][:, None]], axis=1)
        return (window * cw).sum(1), window[:, 1:]

    _check((np.asarray(o), np.asarray(jnp.asarray(pool).at[write].set(new))), _sequential(gla_row, pool))
    _check((np.asarray(u), np.asarray(jnp.asarray(conv_pool).at[write].set(new_conv))),
           _sequential(conv_row, conv_pool))


@pytest.mark.parametrize("chains", [True, False])
def test_ssd_decode_rows_pallas_matches_the_rows_in_order(chains):
    """The Pallas multi-step SSD update (interpret mode) against the rows one at a time: with chains (draft
    rows) and without (every row from its own state)."""
    from kernels.ssd import pallas

    x, dt, a, b, c, pool = _ssd_inputs(np.random.default_rng(5), len(READ))
    write = WRITE if chains else READ
    states = jnp.asarray(pool[LAYER])[jnp.asarray(READ)]
    chained = chain_links(jnp.asarray(READ), jnp.asarray(write))
    y, new = pallas.ssd_decode_rows(*map(jnp.asarray, (x, dt, a, b, c)), states, chained, interpret=True)
    got = np.asarray(y), np.asarray(jnp.asarray(pool[LAYER]).at[jnp.asarray(write)].set(new))
    want_y, want_pool = _sequential(_ssd_row(x, dt, a, b, c), pool[LAYER], write)
    _check(got, (want_y, want_pool))


def test_ssd_decode_rows_pallas_lowers_for_tpu(monkeypatch):
    import functools

    from kernels.ssd import pallas

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    d, h, p, g, n = 8, 4, 64, 2, 128
    shapes = [((d, h, p), jnp.bfloat16), ((d, h), jnp.float32), ((h,), jnp.float32),
              ((d, g, n), jnp.bfloat16), ((d, g, n), jnp.bfloat16), ((d, h, p, n), jnp.float32),
              ((d,), jnp.bool_)]
    args = [jax.ShapeDtypeStruct(s, t) for s, t in shapes]
    fn = functools.partial(pallas.ssd_decode_rows.__wrapped__)
    assert "tpu_custom_call" in jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


# Slot layouts for the multi-step delta rule: (read, write). "drafts": the rows above (chains of depth 3 and
# 1, a lone row, padding); "deep": a chain of depth 6, a lone row, a chain of depth 2 and padding; "plain":
# no chains (every row reads and writes its own slot).
DELTA_LAYOUTS = {
    "drafts": (READ, WRITE),
    "deep": (np.array([2, 2, 11, 12, 13, 14, 15, 4, 5, 5, 16, 0], np.int32),
             np.array([2, 11, 12, 13, 14, 15, 17, 4, 5, 16, 18, 0], np.int32)),
    "plain": (np.array([4, 1, 7, 3, 0, 2], np.int32), np.array([4, 1, 7, 3, 0, 2], np.int32)),
}
DELTA_SLOTS = 19


def _delta_inputs(rng, rows, kda: bool, heads=3, dk=16, dv=8):
    def unit(shape):
        x = rng.standard_normal(shape)
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    q, k = unit((rows, heads, dk)), unit((rows, heads, dk))
    v = rng.standard_normal((rows, heads, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (rows, heads, dk) if kda else (rows, heads)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (rows, heads)).astype(np.float32)
    pool = rng.standard_normal((DELTA_SLOTS, heads, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, pool


def _delta_row(q, k, v, g, beta, scale):
    """One delta-rule step of row r in float64 (HF's recurrence): S' = decay S, S = S' + k^T beta (v - k S'),
    o = scale q S; the decay per head (Gated DeltaNet) or per key channel (KDA)."""
    q, k, v, g, beta = (t.astype(np.float64) for t in (q, k, v, g, beta))

    def step(r, s):  # s [H, Dk, Dv]
        decay = np.exp(g[r])
        s = (decay[:, None, None] if decay.ndim == 1 else decay[:, :, None]) * s
        delta = beta[r][:, None] * (v[r] - np.einsum("hk,hkv->hv", k[r], s))
        s = s + k[r][:, :, None] * delta[:, None, :]
        return scale * np.einsum("hk,hkv->hv", q[r], s), s
    return step


@pytest.mark.parametrize("layout", list(DELTA_LAYOUTS))
@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("form", ["gated", "kda"])
def test_delta_rule_decode_rows_match_the_rows_in_order(form, impl, layout):
    """The multi-step gated delta rule and KDA updates (reference, and Pallas in interpret mode): every row's
    output and final state as the rows run one at a time, chained rows continuing the row before."""
    from kernels.delta_rule import pallas_rows, reference

    kda = form == "kda"
    read, write = DELTA_LAYOUTS[layout]
    q, k, v, g, beta, pool = _delta_inputs(np.random.default_rng(6), len(read), kda)
    name = "kda_decode_rows" if kda else "gated_delta_decode_rows"
    fn = getattr(reference if impl == "reference" else pallas_rows, name)
    kw = {"interpret": True} if impl == "pallas" else {}
    read_j, write_j = jnp.asarray(read), jnp.asarray(write)
    chained = chain_links(read_j, write_j)
    o, new = jax.jit(lambda *a: fn(*a, scale=0.25, **kw))(*map(jnp.asarray, (q, k, v, g, beta)),
                                                          jnp.asarray(pool)[read_j], chained)
    want_o, want_pool = _sequential(_delta_row(q, k, v, g, beta, 0.25), pool, write, read)
    real = read > 0  # a padding row reads the dummy slot's garbage
    np.testing.assert_allclose(np.asarray(o)[real], want_o[real], rtol=1e-5, atol=1e-5)
    got_pool = np.asarray(jnp.asarray(pool).at[write_j].set(new))
    np.testing.assert_allclose(got_pool[1:], want_pool[1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["gated", "kda"])
def test_delta_rule_decode_rows_pallas_lowers_for_tpu(monkeypatch, form):
    import functools

    from kernels.delta_rule import pallas_rows

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    d, h, dk, dv = 8, 4, 128, 128
    shapes = [((d, h, dk), jnp.bfloat16), ((d, h, dk), jnp.bfloat16), ((d, h, dv), jnp.bfloat16),
              ((d, h, dk) if form == "kda" else (d, h), jnp.float32), ((d, h), jnp.float32),
              ((d, h, dk, dv), jnp.float32), ((d,), jnp.bool_)]
    args = [jax.ShapeDtypeStruct(s, t) for s, t in shapes]
    fn = {"gated": pallas_rows.gated_delta_decode_rows, "kda": pallas_rows.kda_decode_rows}[form]
    fn = functools.partial(fn.__wrapped__, scale=dk**-0.5)
    assert "tpu_custom_call" in jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("layout", list(DELTA_LAYOUTS))
@pytest.mark.parametrize("form", ["gated", "kda"])
def test_delta_rule_native_update_matches_the_rows_in_order(form, layout):
    """The native in-place gated delta rule and KDA updates (kernels/cpu/delta_rule.cc) on the same layouts:
    each chain's rows run in order on the pool itself. Dk and Dv of 20: the kernel's vector code and its
    scalar tails."""
    kda = form == "kda"
    read, write = DELTA_LAYOUTS[layout]
    q, k, v, g, beta, pool = _delta_inputs(np.random.default_rng(6), len(read), kda, dk=20, dv=20)
    fn = cpu.kda_decode_update_native if kda else cpu.gated_delta_decode_update_native
    o, got = jax.jit(lambda *a: fn(*a, scale=0.25))(*map(jnp.asarray, (q, k, v, g, beta)),
                                                    jnp.asarray(pool)[None], 0, jnp.asarray(read),
                                                    jnp.asarray(write))
    want_o, want_pool = _sequential(_delta_row(q, k, v, g, beta, 0.25), pool, write, read)
    real = read > 0  # a padding row reads the dummy slot's garbage
    np.testing.assert_allclose(np.asarray(o)[real], want_o[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got)[0, 1:], want_pool[1:], rtol=1e-5, atol=1e-5)
