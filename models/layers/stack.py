"""A decoder's layers in one `lax.scan`, their weights one array per layer (CPU) or stacked (GPU/TPU)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.cpu import matmul

LAYER_WEIGHTS = ("auto", "stacked", "per_layer")


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


class LayerList(nnx.List):
    """A decoder's layers built by `layer_stack`, one module (and one array per parameter) each."""


def layer_stack(make: Callable[[], nnx.Module], num_layers: int) -> LayerList:
    """A decoder's `num_layers` layers built by `make`, each with its own weights; `stack_layers` turns
    them into one module whose parameters are stacked on a leading layer axis. The loader fills either
    from name maps that give layer i's parameters under (..., "layers", i, ...)."""
    return LayerList([make() for _ in range(num_layers)])


def stacked_layer_stack(make: Callable[[], nnx.Module], num_layers: int) -> nnx.Module:
    """`num_layers` layers built by `make` as one module, parameters stacked on a leading layer axis
    whatever the backend. The MoE decoders use it: `PerLayer` has not been measured on expert weights
    (which `moe_ffn` reads whole, not through `Linear`), so they keep the layout they were tuned in."""
    graphdef, state = nnx.split(make())
    return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.zeros((num_layers, *x.shape), x.dtype), state))


def resolve_layer_weights(choice: str) -> str:
    """"stacked" or "per_layer" for a `LAYER_WEIGHTS` choice; "auto" picks by the default backend.

    Per layer on CPU, where XLA copies a dynamic slice of stacked weights out before every dot; stacked
    on GPU/TPU, where the slice feeds the dot directly and a `lax.switch` per matmul would add a
    conditional per layer (on GPU a device-to-host read of the branch index each time).
    """
    if choice not in LAYER_WEIGHTS:
        raise ValueError(f"layer_weights={choice!r}: use one of {', '.join(LAYER_WEIGHTS)}")
    if choice == "auto":
        return "per_layer" if jax.default_backend() == "cpu" else "stacked"
    return choice


def stack_layers(model: nnx.Module) -> nnx.Module:
    """Replaces, in place, every `LayerList` inside `model` by one module of the same structure whose
    parameters are stacked on a leading layer axis; returns `model`. Call it on a freshly built model
    (the loader does it inside `nnx.eval_shape`, so nothing is allocated)."""
    found = []
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            found += [(node, name, v) for name, v in vars(node).items() if isinstance(v, LayerList)]
    for node, name, layers in found:
        graphdef = nnx.graphdef(layers[0])
        state = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layer) for layer in layers])
        setattr(node, name, nnx.merge(graphdef, state))
    return model


def scan_layers(layers: nnx.Module, num_layers: int, step: Callable, carry):
    """Runs `step(layer, index, carry) -> carry` for every layer of a `layer_stack` (stacked or not) in one
    `lax.scan` (one compiled layer body for every layer); returns the final carry."""
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
