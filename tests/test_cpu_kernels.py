"""The native CPU matmul (kernels/cpu): built here, exact against float64 numpy, picked only where it applies."""

from __future__ import annotations

import concurrent.futures
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import cpu
from kernels.backend import KernelBackends, use_kernels


def test_builds_where_a_compiler_exists():
    # CI and this machine have a C++ compiler: a failed build must fail here, not quietly fall back.
    assert shutil.which("c++") or shutil.which("g++")
    assert cpu.available(), "the CPU matmul kernel did not build (see the warning logged above)"


def _reference64(x, w, transpose_w):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x64 @ (w64.T if transpose_w else w64)


@pytest.mark.parametrize("transpose_w", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (2, 5, 3), (3, 33, 70), (4, 1536, 576), (1, 100, 4097),
                                   (4, 17, 16), (1, 1, 1)])
def test_matches_float64(m, k, n, transpose_w):
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k) if transpose_w else (k, n), dtype=np.float32)
    got = np.asarray(jax.jit(lambda x, w: cpu.matmul_native(x, w, transpose_w=transpose_w))(x, w))
    want = _reference64(x, w, transpose_w)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_inside_a_layer_scan_with_switched_weights():
    """How the models call it: a `lax.switch` picks each layer's weights inside a `lax.scan`."""
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((64, 64), dtype=np.float32) / 8) for _ in range(3)]

    def run(matmul):
        def body(x, i):
            return jax.lax.switch(i, [lambda x, w=w: jnp.tanh(matmul(x, w)) for w in ws], x), None

        return jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(3))[0])

    x = jnp.asarray(rng.standard_normal((2, 64), dtype=np.float32))
    np.testing.assert_allclose(run(cpu.matmul_native)(x), run(cpu.matmul_reference)(x), rtol=1e-5, atol=1e-6)


def test_concurrent_calls_from_several_threads():
    """Programs running at once share the helper threads: a caller that finds them busy works alone."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((512, 1024), dtype=np.float32))
    f = jax.jit(lambda x: cpu.matmul_native(x, w))
    xs = [jnp.asarray(rng.standard_normal((3, 512), dtype=np.float32)) for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda x: np.asarray(f(x)), xs * 4))
    for x, got in zip(xs * 4, results):
        np.testing.assert_allclose(got, _reference64(x, w, False), rtol=1e-5, atol=1e-4)


def _custom_calls(fn, *args) -> int:
    # A fresh function each time: jit's trace cache does not know about the active kernel backends.
    return jax.jit(lambda *a: fn(*a)).lower(*args).as_text().count("xlaserve_cpu_matmul")


def test_dispatch_only_where_it_applies():
    w = jnp.zeros((64, 32), jnp.float32)
    small, big = jnp.zeros((cpu.MAX_NATIVE_ROWS, 64)), jnp.zeros((cpu.MAX_NATIVE_ROWS + 1, 64))
    assert _custom_calls(cpu.matmul, small, w) == 1  # default backends on CPU: auto = native
    assert _custom_calls(cpu.matmul, big, w) == 0  # prefill-sized: XLA's dot
    assert _custom_calls(cpu.matmul, small, w.astype(jnp.bfloat16)) == 0  # f32 only
    with use_kernels(KernelBackends.parse("auto,matmul=reference")):
        assert _custom_calls(cpu.matmul, small, w) == 0
    assert KernelBackends().choice("matmul", "gpu") == ("reference", False)
    assert KernelBackends("pallas").choice("matmul", "tpu") == ("reference", False)


@pytest.mark.parametrize("heads,kv_heads,window,soft_cap", [(6, 2, None, None), (4, 4, 5, None), (8, 1, None, 2.0)])
def test_decode_attention_matches_reference(heads, kv_heads, window, soft_cap):
    """Against the jnp reference (tests/test_paged_attention.py checks both against dense attention):
    GQA groups, pages in a random order, a padding row (position -1, no visible key: zeros), a layer index."""
    from kernels.paged_attention.reference import decode_attention_reference

    rng = np.random.default_rng(heads + kv_heads)
    layers, page_size, num_pages, d = 3, 4, 16, 32
    k_pool = jnp.asarray(rng.standard_normal((layers, num_pages * page_size, kv_heads, d), dtype=np.float32))
    v_pool = jnp.asarray(rng.standard_normal((layers, num_pages * page_size, kv_heads, d), dtype=np.float32))
    pages = jnp.asarray(rng.permutation(np.arange(1, num_pages))[:12].reshape(4, 3), jnp.int32)
    positions = jnp.asarray([0, 7, 11, -1], jnp.int32)
    q = jnp.asarray(rng.standard_normal((4, heads, d), dtype=np.float32))
    kw = dict(page_size=page_size, scale=d**-0.5, sliding_window=window, soft_cap=soft_cap)
    for layer in (0, 2):
        got = jax.jit(lambda *a: cpu.decode_attention_native(*a, **kw))(q, k_pool, v_pool, layer, pages, positions)
        want = decode_attention_reference(q, k_pool, v_pool, layer, pages, positions, **kw)
        np.testing.assert_allclose(np.asarray(got)[:3], np.asarray(want)[:3], rtol=1e-5, atol=1e-5)
        assert not np.asarray(got)[3].any()
