"""Sparse mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama attention, top-k experts."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.moe import moe_ffn
from memory import KVPool, MemoryPools
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.fused import gate_up_rows, qkv_rows
from models.layers import GatedMLP, Linear, RMSNorm, lm_logits
from models.llama import Attention


@dataclasses.dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """A Llama-family decoder whose MLPs are sparse mixtures of experts, except in dense layers.

    `intermediate_size` is the width of the dense MLP of layers where `sparse_layers[i]` is False
    (Qwen's `mlp_only_layers` / `decoder_sparse_step`); each expert is `moe_intermediate_size` wide.
    """

    num_experts: int = 1
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 1
    norm_topk_prob: bool = True  # renormalise the chosen experts' softmax weights to sum to one
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none), sigmoid-gated
    sparse_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or the dense gated MLP (False)

    def __post_init__(self):
        super().__post_init__()
        if len(self.sparse_layers) != self.num_layers:
            raise ValueError(
                f"sparse_layers={self.sparse_layers} needs one entry per layer ({self.num_layers})"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts=}]"
            )
        if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"bad expert widths: moe_intermediate_size={self.moe_intermediate_size}, "
                f"shared_expert_intermediate_size={self.shared_expert_intermediate_size}"
            )

    @property
    def layers_alike(self) -> bool:
        """All layers have the same parameter shapes, so they can be stacked and scanned."""
        return len(set(self.sparse_layers)) == 1

    @property
    def num_params(self) -> int:
        d = self.hidden_size
        sparse = self.num_experts * (3 * d * self.moe_intermediate_size + d)  # experts and router rows
        if self.shared_expert_intermediate_size:
            sparse += 3 * d * self.shared_expert_intermediate_size + d
        return super().num_params + sum(self.sparse_layers) * (sparse - 3 * d * self.intermediate_size)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoeConfig:
        base = ModelConfig.from_hf(hf)
        arch, num_layers = base.architecture, base.num_layers
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        if arch == "MixtralForCausalLM":
            window = hf.get("sliding_window")
            moe = dict(
                num_experts=int(hf["num_local_experts"]),
                moe_intermediate_size=base.intermediate_size,
                norm_topk_prob=True,
                sparse_layers=(True,) * num_layers,
            )
            fields.update(attention_bias=False, o_bias=False, qk_norm=False)
        elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            # transformers 5 writes Qwen3-MoE's expert count as `num_local_experts` (an attribute_map alias).
            num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
            mlp_only, step = set(hf.get("mlp_only_layers") or ()), int(hf.get("decoder_sparse_step", 1))
            moe = dict(
                num_experts=num_experts,
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                sparse_layers=tuple(
                    i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
                ),
            )
            window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
            if arch == "Qwen2MoeForCausalLM":
                moe["shared_expert_intermediate_size"] = int(hf.get("shared_expert_intermediate_size") or 0)
                layer_types = hf.get("layer_types")
                if layer_types and "sliding_attention" not in layer_types:
                    window = None
                fields.update(attention_bias=bool(hf.get("qkv_bias", True)), o_bias=False, qk_norm=False)
            else:
                bias = bool(hf.get("attention_bias", False))  # on q, k, v and o alike
                fields.update(attention_bias=bias, o_bias=bias, qk_norm=True)
        else:
            raise ValueError(f"models.moe does not implement {arch!r}")
        if window and window < base.max_position_embeddings:
            raise ValueError(
                f"{arch}: sliding_window={window} < max_position_embeddings={base.max_position_embeddings} "
                "is not supported: paged attention always attends to the whole context"
            )
        return cls(**fields, num_experts_per_tok=int(hf["num_experts_per_tok"]), **moe)


config_from_hf = MoeConfig.from_hf


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
    """Softmax top-k routing over gated-MLP experts (dropless); Jamba and Granite-MoE-hybrid share it.

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
        dtype,
    ):
        self.router = Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.experts = Experts(num_experts, hidden, intermediate, dtype=dtype)
        self.top_k, self.normalize_topk, self.act = top_k, normalize_topk, act

    def __call__(self, x: jax.Array) -> jax.Array:
        """f32[T, hidden] for the normed input x f[T, hidden]."""
        return self.experts(
            x,
            self.router(x),
            top_k=self.top_k,
            act=self.act,
            scoring="softmax",
            normalize_topk=self.normalize_topk,
        )


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
    get, prefix: str, num_experts: int, *, bias_name: str, shared: bool
) -> dict[tuple[str, ...], np.ndarray]:
    """A `GroupedMoE` from `{prefix}gate.weight`, `{prefix}gate.{bias_name}` (the correction bias), the
    experts (`experts_from_hf`) and, with `shared`, `{prefix}shared_experts.{gate,up,down}_proj`."""
    from models.hybrid import gated_mlp_params_from_hf

    out = {
        ("router", "kernel"): get(prefix + "gate.weight").T,
        ("correction_bias",): get(f"{prefix}gate.{bias_name}"),
        **experts_from_hf(get, prefix, num_experts),
    }
    if shared:
        mlp = gated_mlp_params_from_hf(get, prefix + "shared_experts", bias=False)
        out.update({("shared", *path): value for path, value in mlp.items()})
    return out


class SparseMoeBlock(nnx.Module):
    """Softmax top-k routing over the experts (dropless), plus Qwen2-MoE's sigmoid-gated shared expert."""

    def __init__(self, cfg: MoeConfig, *, dtype):
        d = cfg.hidden_size
        self.cfg = cfg
        self.router = Linear(d, cfg.num_experts, bias=False, dtype=dtype)  # HF's `gate`
        self.experts = Experts(cfg.num_experts, d, cfg.moe_intermediate_size, dtype=dtype)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(
                d, cfg.shared_expert_intermediate_size, act=cfg.hidden_act, bias=False, dtype=dtype
            )
            self.shared_expert_gate = Linear(d, 1, bias=False, dtype=dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def __call__(self, x: jax.Array) -> jax.Array:
        """f32[T, hidden] for the normed input x f[T, hidden]."""
        cfg = self.cfg
        y = self.experts(
            x,
            self.router(x),
            top_k=cfg.num_experts_per_tok,
            act=cfg.hidden_act,
            scoring="softmax",
            normalize_topk=cfg.norm_topk_prob,
        )
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class MoeDecoderLayer(nnx.Module):
    def __init__(self, cfg: MoeConfig, sparse: bool, *, dtype):
        eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        if sparse:
            self.mlp = SparseMoeBlock(cfg, dtype=dtype)
        else:
            self.mlp = GatedMLP(
                cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act, bias=False, dtype=dtype
            )

    def __call__(self, x, batch: ForwardBatch, kv: KVPool, layer) -> tuple[jax.Array, KVPool]:
        # The residual stream `x` stays float32 whatever the compute dtype.
        with jax.named_scope("attention"):
            h, kv = self.attn(self.input_norm(x), batch, kv, layer)
        x = x + h
        with jax.named_scope("moe" if isinstance(self.mlp, SparseMoeBlock) else "mlp"):
            x = x + self.mlp(self.post_attn_norm(x))
        return x, kv


class MoeForCausalLM(nnx.Module):
    """Decoder of MoE layers; stacked and run by one `lax.scan` when all layers are alike (as in llama.py).

    With dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`) the parameter
    shapes differ between layers, so the layers are kept apart and run by a Python loop.
    """

    def __init__(self, cfg: MoeConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        if cfg.layers_alike:
            graphdef, state = nnx.split(MoeDecoderLayer(cfg, cfg.sparse_layers[0], dtype=dtype))
            stacked = jax.tree.map(lambda x: jnp.zeros((cfg.num_layers, *x.shape), x.dtype), state)
            self.layers = nnx.merge(graphdef, stacked)
        else:
            self.layers = nnx.Dict(
                {
                    str(i): MoeDecoderLayer(cfg, sparse, dtype=dtype)
                    for i, sparse in enumerate(cfg.sparse_layers)
                }
            )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Param(jnp.zeros((cfg.hidden_size, cfg.vocab_size), dtype))
        )

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        kv = pools.kv
        x = self.embed[...][batch.input_ids].astype(jnp.float32)
        if self.cfg.layers_alike:
            graphdef, layer_state = nnx.split(self.layers)

            def body(carry, scanned):
                x, kv = carry
                index, state = scanned
                x, kv = nnx.merge(graphdef, state)(x, batch, kv, index)
                return (x, kv), None

            (x, kv), _ = jax.lax.scan(body, (x, kv), (jnp.arange(self.cfg.num_layers), layer_state))
        else:
            for i in range(self.cfg.num_layers):
                x, kv = self.layers[str(i)](x, batch, kv, i)
        return self.norm(x, self.dtype), pools._replace(kv=kv)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """f32[N, vocab] logits for hidden rows f[N, hidden]."""
        return lm_logits(hidden, self.embed[...], None if self.lm_head is None else self.lm_head[...])


def experts_from_hf(get, prefix: str, num_experts: int) -> dict[tuple[str, ...], np.ndarray]:
    """Stacked experts of one `TopKMoE` from `prefix + experts...`, in either on-disk layout.

    Per expert (hub checkpoints, transformers' default save):
    `{prefix}experts.{j}.{gate,up,down}_proj.weight`; fused (transformers' in-memory layout):
    `{prefix}experts.gate_up_proj` f[E, 2F, hidden] (gate rows first) and `{prefix}experts.down_proj`
    f[E, hidden, F].
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
    experts = [f"{prefix}experts.{j}." for j in range(num_experts)]
    return {
        ("experts", "gate_up"): np.stack(
            [np.concatenate([get(e + "gate_proj.weight"), get(e + "up_proj.weight")]).T for e in experts]
        ),
        ("experts", "down"): np.stack([get(e + "down_proj.weight").T for e in experts]),
    }


def _experts_from_hf(cfg: MoeConfig, get, prefix: str) -> dict[tuple[str, ...], np.ndarray]:
    """Router and stacked experts of one layer, from either on-disk layout.

    Hub checkpoints (and transformers 5's `save_pretrained`, which converts back) hold one tensor per
    expert: `{block}.experts.{j}.{gate,up,down}` with Mixtral's block `block_sparse_moe` and names w1, w3,
    w2. transformers 5 keeps experts fused in memory, and `save_pretrained(save_original_format=False)`
    writes that: `mlp.experts.gate_up_proj` [E, 2F, hidden] (gate rows first) and `mlp.experts.down_proj`
    [E, hidden, F].
    """
    try:
        fused_gate_up = get(prefix + "mlp.experts.gate_up_proj")  # f[E, 2F, hidden]
    except KeyError:  # not fused: the per-expert layout
        fused_gate_up = None
    if fused_gate_up is not None:
        router = get(prefix + "mlp.gate.weight")
        gate_up = fused_gate_up.transpose(0, 2, 1)
        down = get(prefix + "mlp.experts.down_proj").transpose(0, 2, 1)
    else:
        mixtral = cfg.architecture == "MixtralForCausalLM"
        block, gate_name, up_name, down_name = (
            ("block_sparse_moe", "w1", "w3", "w2")
            if mixtral
            else ("mlp", "gate_proj", "up_proj", "down_proj")
        )
        experts = [f"{prefix}{block}.experts.{j}." for j in range(cfg.num_experts)]
        router = get(f"{prefix}{block}.gate.weight")
        gate_up = np.stack(
            [
                np.concatenate([get(e + gate_name + ".weight"), get(e + up_name + ".weight")]).T
                for e in experts
            ]
        )
        down = np.stack([get(e + down_name + ".weight").T for e in experts])
    out = {
        ("mlp", "router", "kernel"): router.T,
        ("mlp", "experts", "gate_up"): gate_up,
        ("mlp", "experts", "down"): down,
    }
    if cfg.shared_expert_intermediate_size:
        shared = prefix + "mlp.shared_expert."
        out[("mlp", "shared_expert", "gate_up", "kernel")] = gate_up_rows(
            get(shared + "gate_proj.weight"), get(shared + "up_proj.weight")
        ).T
        out[("mlp", "shared_expert", "down", "kernel")] = get(shared + "down_proj.weight").T
        out[("mlp", "shared_expert_gate", "kernel")] = get(prefix + "mlp.shared_expert_gate.weight").T
    return out


def _layer_from_hf(cfg: MoeConfig, get, i: int) -> dict[tuple[str, ...], np.ndarray]:
    prefix = f"model.layers.{i}."
    attn = prefix + "self_attn."
    out = {
        ("input_norm", "weight"): get(prefix + "input_layernorm.weight"),
        ("post_attn_norm", "weight"): get(prefix + "post_attention_layernorm.weight"),
        ("attn", "qkv", "kernel"): qkv_rows(
            get(attn + "q_proj.weight"), get(attn + "k_proj.weight"), get(attn + "v_proj.weight"),
            cfg.num_kv_heads,
        ).T,
        ("attn", "o", "kernel"): get(attn + "o_proj.weight").T,
    }
    if cfg.attention_bias:
        out[("attn", "qkv", "bias")] = qkv_rows(
            get(attn + "q_proj.bias"), get(attn + "k_proj.bias"), get(attn + "v_proj.bias"), cfg.num_kv_heads
        )
    if cfg.o_bias:
        out[("attn", "o", "bias")] = get(attn + "o_proj.bias")
    if cfg.qk_norm:
        out[("attn", "q_norm", "weight")] = get(attn + "q_norm.weight")
        out[("attn", "k_norm", "weight")] = get(attn + "k_norm.weight")
    if cfg.sparse_layers[i]:
        out.update(_experts_from_hf(cfg, get, prefix))
    else:
        mlp = prefix + "mlp."
        out[("mlp", "gate_up", "kernel")] = gate_up_rows(
            get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")
        ).T
        out[("mlp", "down", "kernel")] = get(mlp + "down_proj.weight").T
    return out


def params_from_hf(cfg: MoeConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF tensors (fetched by name with `get`) to our parameter paths.

    HF linear weights are [out, in]; ours are [in, out], q/k/v and gate/up concatenated on `out`, experts
    stacked on a leading expert axis, and layers stacked on a leading layer axis when they are alike
    (else kept per layer under their index).
    """
    layers = [_layer_from_hf(cfg, get, i) for i in range(cfg.num_layers)]
    if cfg.layers_alike:
        out = {("layers", *path): np.stack([layer[path] for layer in layers]) for path in layers[0]}
    else:
        out = {
            ("layers", str(i), *path): value
            for i, layer in enumerate(layers)
            for path, value in layer.items()
        }
    out[("embed",)] = get("model.embed_tokens.weight")
    out[("norm", "weight")] = get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
