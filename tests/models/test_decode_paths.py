"""Per-layer weights in a layer scan (models/layers/stack.py:PerLayer): as unrolled layers, no copies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.layers.linear import Linear
from models.layers.norm import RMSNorm
from models.layers.stack import PerLayer, select_layer
from tests.helpers import RECOMPUTE_ATOL, greedy

NUM_LAYERS, DIM = 3, 16


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = RMSNorm(DIM, eps=1e-6, dtype=jnp.float32)
        self.up = Linear(DIM, 2 * DIM, bias=True, dtype=jnp.float32)
        self.down = Linear(2 * DIM, DIM, bias=False, dtype=jnp.float32)
        # Distinct random weights per layer, so a wrong layer choice changes the result.
        for p in (self.norm.weight, self.up.kernel, self.up.bias, self.down.kernel):
            p[...] = jax.random.normal(rngs.params(), p.shape)

    def __call__(self, x):
        return x + self.down(jax.nn.silu(self.up(self.norm(x))))


def _layers():
    rngs = nnx.Rngs(0)
    return nnx.List([Block(rngs) for _ in range(NUM_LAYERS)])


def _scanned(layers, x):
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer) for layer in layers]

    def body(x, index):
        return nnx.merge(graphdef, select_layer(states, index))(x), None

    return jax.lax.scan(body, x, jnp.arange(NUM_LAYERS))[0]


def test_scan_over_per_layer_weights_equals_unrolled_layers():
    layers = _layers()
    x = jax.random.normal(jax.random.key(1), (5, DIM))
    unrolled = x
    for layer in layers:
        unrolled = layer(unrolled)
    scanned = nnx.jit(_scanned)(layers, x)
    # Tolerance: jitted vs eager rounding only.
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), rtol=1e-5, atol=1e-5)
    # Guard: the layers differ, so picking one layer's weights for all would not pass.
    first_only = x
    for _ in layers:
        first_only = layers[0](first_only)
    assert np.abs(np.asarray(first_only) - np.asarray(unrolled)).max() > 1e-2


def test_per_layer_kernel_is_read_in_place():
    # The point of PerLayer: XLA reads each layer's kernel where it lies. A dynamic slice of a stacked
    # kernel would show in the optimized HLO as a dynamic-slice of the kernel's shape (a copy per step).
    layers = _layers()
    x = jnp.ones((1, DIM))
    hlo = nnx.jit(_scanned).lower(layers, x).compile().as_text()
    kernel_shapes = ("16,32]", "32,16]")  # f32[16,32] or f32[1,16,32]: the kernels, stacked or not
    lines = hlo.splitlines()
    copies = [line for line in lines if "dynamic-slice" in line and any(k in line for k in kernel_shapes)]
    assert not copies, copies[:3]
    assert "conditional(" in hlo


def test_per_layer_reads_pick_the_index():
    arrays = [jnp.full((4,), float(i)) for i in range(NUM_LAYERS)]
    kernels = [jnp.eye(4) * (i + 1) for i in range(NUM_LAYERS)]
    x = jnp.arange(4.0)[None]
    for i in range(NUM_LAYERS):
        index = jnp.int32(i)
        np.testing.assert_array_equal(PerLayer(arrays, index)[...], arrays[i])
        np.testing.assert_array_equal(PerLayer(kernels, index).dot(x), x * (i + 1))


@pytest.mark.parametrize("family", ["qwen3", "mamba2"])
@pytest.mark.slow
def test_stacked_and_per_layer_weights_serve_the_same(tmp_path, family):
    """GPU/TPU keep layer weights stacked, CPU per layer (`--layer-weights`, models/layers/stack.py): both,
    loaded from the same checkpoint by the same name map, give the same tokens and logprobs."""
    from serve import Engine

    if family == "qwen3":
        from tests.models.test_hf_parity import CASES, save_checkpoint

        save_checkpoint(str(tmp_path), CASES["qwen3_qk_norm_head_dim"])
    else:
        from tests.models.test_mamba2_parity import CASES, save_checkpoint

        save_checkpoint(str(tmp_path), CASES["groups2_bias"])
    prompts = [[5, 9, 23, 7, 81, 14, 3], [44, 2, 19]]
    results = {}
    for layout in ("stacked", "per_layer"):
        engine = Engine(model=str(tmp_path), in_process=True, dtype="float32", max_running_requests=2,
                        layer_weights=layout,
                        chunked_prefill_size=32, context_length=128, page_size=16, skip_tokenizer_init=True)
        try:
            results[layout] = engine.generate(
                input_ids=prompts,
                sampling_params=greedy(8),
                return_logprob=True, logprob_start_len=0)
            layers = engine.runner.params["layers"]
            stacked = all(x.shape[0] == 2 for x in jax.tree.leaves(layers)) and 0 not in layers
            assert stacked == (layout == "stacked"), jax.tree.map(jnp.shape, layers)
        finally:
            engine.shutdown()
    for a, b in zip(results["stacked"], results["per_layer"]):
        assert a["output_ids"] == b["output_ids"]
        ours = [lp for lp, _ in a["meta_info"]["input_token_logprobs"][1:]]
        theirs = [lp for lp, _ in b["meta_info"]["input_token_logprobs"][1:]]
        np.testing.assert_allclose(ours, theirs, atol=RECOMPUTE_ATOL, rtol=0)
