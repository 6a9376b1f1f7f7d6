"""Feed-forward blocks: the gated MLP (gate and up fused) and Nemotron-H's ungated relu^2 MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.gated_act import silu_mul
from models.fused import gate_up_rows, split_gate_up
from models.layers.linear import Linear

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


def gated_mlp_params_from_hf(
    get, prefix: str, *, bias: bool, gate_scale: float = 1.0, down_scale: float = 1.0
) -> dict[tuple[str, ...], np.ndarray]:
    """HF gate/up/down_proj under `prefix` -> our `GatedMLP` (gate and up fused, kernels [in, out]).

    `gate_scale` multiplies the gate projection's output and `down_scale` the MLP's output (Falcon-H1's
    mlp_multipliers), folded into kernels and biases.
    """
    gate, up = get(f"{prefix}.gate_proj.weight") * gate_scale, get(f"{prefix}.up_proj.weight")
    out = {
        ("gate_up", "kernel"): gate_up_rows(gate, up).T,
        ("down", "kernel"): get(f"{prefix}.down_proj.weight").T * down_scale,
    }
    if bias:
        out[("gate_up", "bias")] = gate_up_rows(
            get(f"{prefix}.gate_proj.bias") * gate_scale, get(f"{prefix}.up_proj.bias")
        )
        out[("down", "bias")] = get(f"{prefix}.down_proj.bias") * down_scale
    return out


class ReluSquaredMLP(nnx.Module):
    """down(relu(up(x))^2): Nemotron-H's MLP has no gate."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool, dtype):
        self.up = Linear(hidden, intermediate, bias=bias, dtype=dtype)
        self.down = Linear(intermediate, hidden, bias=bias, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jnp.square(jax.nn.relu(self.up(x))))
