"""Mixture-of-experts blocks: stacked gated-MLP experts, softmax top-k and DeepSeek's grouped routing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.moe import moe_ffn
from models.layers.linear import Linear
from models.layers.mlp import GatedMLP, gated_mlp_params_from_hf


class Experts(nnx.Module):
    """`num_experts` gated MLPs stacked: gate_up f[E, hidden, 2F] (gate, then up), down f[E, F, hidden].

    With `--quantization` (models/quantization.py) gate_up and down are int8 / fp8 and the module also holds
    their per-output-channel scales `gate_up_scale` f32[E, 2F] and `down_scale` f32[E, hidden].
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, dtype):
        self.gate_up = nnx.Param(jnp.zeros((num_experts, hidden, 2 * intermediate), dtype))
        self.down = nnx.Param(jnp.zeros((num_experts, intermediate, hidden), dtype))
        self.gate_up_scale = self.down_scale = None

    def __call__(
        self, x: jax.Array, router_logits: jax.Array, *, top_k: int, act: str, **routing
    ) -> jax.Array:
        """f32[T, hidden]: each token x f[T, hidden] through its `top_k` experts by `router_logits` f32[T, E]
        (`routing`: the options of kernels.moe.route)."""
        scales = {}
        if self.gate_up_scale is not None:
            scales = dict(gate_up_scale=self.gate_up_scale[...], down_scale=self.down_scale[...])
        return moe_ffn(
            x, router_logits, self.gate_up[...], self.down[...], top_k=top_k, act=act, **scales, **routing
        )


class TopKMoE(nnx.Module):
    """Softmax top-k routing over gated-MLP experts (dropless), plus an optional sigmoid-gated shared expert
    (Qwen2-MoE's `shared_intermediate`). Mixtral, Qwen-MoE, Jamba, Granite-MoE-hybrid and MiniMax use it.

    `normalize_topk`: the chosen weights are renormalised to sum to one (Granite's softmax over the top-k
    logits is exactly that); Jamba keeps the full softmax's weights.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        *,
        normalize_topk: bool,
        act: str,
        shared_intermediate: int = 0,
        dtype,
    ):
        self.router = Linear(hidden, num_experts, bias=False, dtype=dtype)  # HF's `gate`
        self.experts = Experts(num_experts, hidden, intermediate, dtype=dtype)
        self.top_k, self.normalize_topk, self.act = top_k, normalize_topk, act
        if shared_intermediate:
            self.shared_expert = GatedMLP(hidden, shared_intermediate, act=act, bias=False, dtype=dtype)
            self.shared_expert_gate = Linear(hidden, 1, bias=False, dtype=dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def __call__(self, x: jax.Array) -> jax.Array:
        """f32[T, hidden] for the normed input x f[T, hidden]."""
        y = self.experts(
            x,
            self.router(x),
            top_k=self.top_k,
            act=self.act,
            scoring="softmax",
            normalize_topk=self.normalize_topk,
        )
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


@dataclasses.dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3's `noaux_tc` choice of `top_k` of `num_experts` (kernels.moe.route): sigmoid scores, a
    correction bias for the choice only, within the best `topk_group` of `n_group` expert groups."""

    num_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                f"num_experts={self.num_experts} must split into n_group={self.n_group} >= "
                f"topk_group={self.topk_group}"
            )
        if not 0 < self.top_k <= self.topk_group * self.num_experts // self.n_group:
            raise ValueError(f"top_k={self.top_k} exceeds the experts of the chosen groups")


class GroupedMoE(nnx.Module):
    """Grouped sigmoid routing over gated-MLP experts plus always-on shared experts fused into one MLP
    (DeepSeek-V3, Ling 2.5). The router runs in float32, as HF's does."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        shared_intermediate: int,
        routing: GroupedRouting,
        *,
        act: str,
        dtype,
    ):
        self.routing, self.act = routing, act
        self.router = Linear(hidden, routing.num_experts, bias=False, dtype=jnp.float32)
        self.correction_bias = nnx.Param(jnp.zeros((routing.num_experts,), jnp.float32))
        self.experts = Experts(routing.num_experts, hidden, intermediate, dtype=dtype)
        self.shared = (
            GatedMLP(hidden, shared_intermediate, act=act, bias=False, dtype=dtype)
            if shared_intermediate
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """f32[T, hidden] for the normed input x f[T, hidden]."""
        r = self.routing
        y = self.experts(
            x,
            self.router(x.astype(jnp.float32)),
            top_k=r.top_k,
            act=self.act,
            scoring="sigmoid",
            normalize_topk=r.norm_topk_prob,
            correction_bias=self.correction_bias[...],
            num_groups=r.n_group,
            topk_groups=r.topk_group,
            routed_scaling_factor=r.routed_scaling_factor,
        )
        return y if self.shared is None else y + self.shared(x)


def grouped_moe_from_hf(
    get, prefix: str, num_experts: int, *, bias_name: str, shared: bool,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> dict[tuple[str, ...], np.ndarray]:
    """A `GroupedMoE` from `{prefix}gate.weight`, `{prefix}gate.{bias_name}` (the correction bias), the
    experts (`experts_from_hf`, per-expert tensors named `names`) and, with `shared`,
    `{prefix}shared_experts.{gate,up,down}_proj`."""
    out = {
        ("router", "kernel"): get(prefix + "gate.weight").T,
        ("correction_bias",): get(f"{prefix}gate.{bias_name}"),
        **experts_from_hf(get, prefix, num_experts, names=names),
    }
    if shared:
        mlp = gated_mlp_params_from_hf(get, prefix + "shared_experts", bias=False)
        out.update({("shared", *path): value for path, value in mlp.items()})
    return out


def experts_from_hf(
    get, prefix: str, num_experts: int, *, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> dict[tuple[str, ...], np.ndarray]:
    """Stacked experts of one MoE block from `prefix + experts...`, in either on-disk layout.

    Per expert (hub checkpoints, transformers' default save): `{prefix}experts.{j}.{gate}.weight` and
    likewise up and down, their names given by `names` (Mixtral's are w1, w3, w2); fused (transformers'
    in-memory layout, `save_pretrained(save_original_format=False)`): `{prefix}experts.gate_up_proj`
    f[E, 2F, hidden] (gate rows first) and `{prefix}experts.down_proj` f[E, hidden, F].
    """
    try:
        fused = get(prefix + "experts.gate_up_proj")
    except KeyError:
        fused = None
    if fused is not None:
        return {
            ("experts", "gate_up"): fused.transpose(0, 2, 1),
            ("experts", "down"): get(prefix + "experts.down_proj").transpose(0, 2, 1),
        }
    gate, up, down = names
    experts = [f"{prefix}experts.{j}." for j in range(num_experts)]
    return {
        ("experts", "gate_up"): np.stack(
            [np.concatenate([get(f"{e}{gate}.weight"), get(f"{e}{up}.weight")]).T for e in experts]
        ),
        ("experts", "down"): np.stack([get(f"{e}{down}.weight").T for e in experts]),
    }
