import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import products
from kernels import cpu
from kernels.quant.reference import PANEL, from_panels, qmatmul_reference

pytestmark = pytest.mark.skipif(not cpu.available() or cpu.panel_width() != PANEL,
                                reason="the native library has no stored-panel kernel here")


def test_the_chain_is_the_layers_products_one_after_the_other():
    """`chain` over 2 layers against the reference products of the same weights, fed the same way."""
    rng = np.random.default_rng(0)
    weights = products.make_weights(2, rng)
    x = jnp.asarray(rng.standard_normal((3, products.HIDDEN), dtype=np.float32))
    want = x
    for i, (q, scale, zero) in enumerate(weights):
        k = products.SHAPES[i % 4][1]
        k_next = products.SHAPES[(i + 1) % 4][1]
        y = qmatmul_reference(want, *from_panels(q, scale, zero), activations="int8")
        want = y[:, :k_next] / (products.WEIGHT_STD * np.sqrt(k))
    got = jax.jit(products.chain, static_argnums=2)(weights, x, 2)
    np.testing.assert_allclose(float(got), float(want.sum()), rtol=1e-3)


def test_a_run_counts_the_weights_it_reads():
    rng = np.random.default_rng(0)
    weights = products.make_weights(2, rng)
    r = products.run(2, 2, weights, weights[:4], repeats=1, rng=rng)
    per_layer = sum(n * k // 2 + 2 * 2 * n * k // 32 for n, k in products.SHAPES)  # nibbles, f16 scale + zero
    assert r["mb"] == pytest.approx(2 * per_layer / 1e6)
    assert 0 < r["dram_best_ms"] <= r["dram_median_ms"] and r["cache_best_ms"] > 0
