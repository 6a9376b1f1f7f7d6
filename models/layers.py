"""Building blocks shared by decoder families: linear, RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.cpu import matmul
from kernels.gated_act import silu_mul
from models.fused import split_gate_up


class PerLayer:
    """One parameter of layer `index` of a layer scan whose parameters are stored as one array per layer.

    XLA:CPU cannot feed a dot from a dynamic slice of a stacked [layers, ...] array: it copies the
    slice out first, and those copies were half of a batch-1 decode step. With one array per layer, a
    `lax.switch` on the layer index picks the array inside each branch, so the dot reads the chosen
    layer's weights in place (`dot`), while the scan still compiles one layer body (unrolling the
    layers instead compiles `num_layers` copies, 8x slower to compile). Other reads (`x[...]`, for
    norm weights, biases, conv weights) pick the layer's array the same way.
    """

    def __init__(self, arrays: Sequence[jax.Array], index: jax.Array):
        self.arrays = tuple(arrays)  # one per layer, all of one shape and dtype
        self.index = index  # i32[] layer index (a traced scan index)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.arrays[0].shape

    @property
    def dtype(self):
        return self.arrays[0].dtype

    @property
    def ndim(self) -> int:
        return self.arrays[0].ndim

    def __getitem__(self, key) -> jax.Array:
        # Switched too: stacking the layers' vectors and indexing them measured no faster to start, and made
        # a Mamba-2 batch-1 decode step 38 -> 51 ms.
        return jax.lax.switch(self.index, [lambda a=a: a[key] for a in self.arrays])

    def dot(self, x: jax.Array) -> jax.Array:
        """f32 `x @ array` of the selected layer, for a kernel stored [in, out]."""
        def branch(w):
            return lambda x: matmul(x, w)

        return jax.lax.switch(self.index, [branch(w) for w in self.arrays], x.astype(self.dtype))


def select_layer(layer_states: Sequence, index: jax.Array):
    """The state of layer `index` out of per-layer nnx states of one structure: each leaf a `PerLayer`."""
    return jax.tree.map(lambda *arrays: PerLayer(arrays, index), *layer_states)


def per_layer_weights() -> bool:
    """Whether decoders keep each layer's weights as separate arrays (`PerLayer`) instead of stacked on a
    leading layer axis. Per layer on CPU, where XLA copies a dynamic slice of stacked weights out before
    every dot; stacked on GPU/TPU, where the slice feeds the dot directly and a `lax.switch` per matmul would
    add a conditional per layer (on GPU a device-to-host read of the branch index each time).
    `XLASERVE_LAYER_WEIGHTS=stacked|per_layer` overrides the choice (the tests run both on CPU)."""
    choice = os.environ.get("XLASERVE_LAYER_WEIGHTS") or (
        "per_layer" if jax.default_backend() == "cpu" else "stacked"
    )
    if choice not in ("stacked", "per_layer"):
        raise ValueError(f"XLASERVE_LAYER_WEIGHTS={choice!r}: use stacked or per_layer")
    return choice == "per_layer"


def layer_stack(make: Callable[[], nnx.Module], num_layers: int) -> nnx.Module:
    """A decoder's `num_layers` layers built by `make`: an `nnx.List` of them (per-layer weights), or one
    module whose every parameter is stacked on a leading layer axis (see `per_layer_weights`). The loader
    fills either from name maps that give layer i's parameters under (..., "layers", i, ...)."""
    if per_layer_weights():
        return nnx.List([make() for _ in range(num_layers)])
    graphdef, state = nnx.split(make())
    return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.zeros((num_layers, *x.shape), x.dtype), state))


def scan_layers(layers: nnx.Module, num_layers: int, step: Callable, carry):
    """Runs `step(layer, index, carry) -> carry` for every layer of a `layer_stack` in one `lax.scan` (one
    compiled layer body for every layer); returns the final carry."""
    if isinstance(layers, nnx.List):
        graphdef = nnx.graphdef(layers[0])
        states = [nnx.state(layer) for layer in layers]

        def body(carry, index):
            return step(nnx.merge(graphdef, select_layer(states, index)), index, carry), None

        return jax.lax.scan(body, carry, jnp.arange(num_layers))[0]
    graphdef, stacked = nnx.split(layers)

    def stacked_body(carry, scanned):
        index, state = scanned
        return step(nnx.merge(graphdef, state), index, carry), None

    return jax.lax.scan(stacked_body, carry, (jnp.arange(num_layers), stacked))[0]


class Linear(nnx.Module):
    """`x @ kernel (+ bias)`, kernel stored [in, out] in the compute dtype (or a `PerLayer` of kernels)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype):
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel.get_value()
        if isinstance(kernel, PerLayer):
            y = kernel.dot(x)
        else:
            y = matmul(x, kernel)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y


class RMSNorm(nnx.Module):
    """RMSNorm with float32 statistics; the output is cast back to `out_dtype` before the weight, as HF
    does."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        out_dtype = out_dtype or self.weight.dtype
        return self.weight[...].astype(out_dtype) * normed.astype(out_dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> jax.Array:
    """Rotates the first 2*len(inv_freq) channels of x f[T, heads, head_dim] (HF rotate_half layout).

    `scale` multiplies cos and sin (YaRN's `attention_scaling`; `RopeConfig.attention_scaling`).
    """
    rot = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # f32[T, rot/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x32 = x[..., :rot].astype(jnp.float32)
    x1, x2 = x32[..., : rot // 2], x32[..., rot // 2 :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return rotated if rot == x.shape[-1] else jnp.concatenate([rotated, x[..., rot:]], axis=-1)


ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)); gate and up are fused into one matmul, channels interleaved
    (models/fused.py)."""

    def __init__(self, hidden: int, intermediate: int, *, act: str, bias: bool, dtype):
        self.gate_up = Linear(hidden, 2 * intermediate, bias=bias, dtype=dtype)
        self.down = Linear(intermediate, hidden, bias=bias, dtype=dtype)
        self.act = ACTIVATIONS[act]

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.gate_up(x)
        if self.act is jax.nn.silu:
            return self.down(silu_mul(y))  # one native pass on CPU
        gate, up = split_gate_up(y)
        return self.down(self.act(gate) * up)


def lm_logits(hidden: jax.Array, embed: jax.Array, lm_head: jax.Array | None,
              scale: float = 1.0) -> jax.Array:
    """f32[N, vocab] logits (times `scale`) for hidden rows f[N, hidden]; `lm_head=None`: tied to `embed`."""
    if lm_head is None:  # tied: contract with the embedding rows, no transposed copy
        out = matmul(hidden, embed, transpose_w=True)
    else:
        out = matmul(hidden, lm_head)
    return out * scale if scale != 1.0 else out
