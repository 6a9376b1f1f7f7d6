"""Granite-4.0-H (GraniteMoeHybrid): Mamba-2 and attention layers, each with experts and a shared MLP."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from memory import CacheSpec, KVPool, MemoryPools
from models import hybrid
from models.batch import ForwardBatch
from models.config import AttentionConfig, eos_ids_from_hf
from models.fused import gate_up_rows
from models.layers.attention import Attention, attention_params_from_hf
from models.layers.causal_lm import CausalLM
from models.layers.linear import lm_logits
from models.layers.mamba2 import (
    Mamba2Mixer,
    Mamba2MixerConfig,
    mixer_config_from_mamba_keys,
    mixer_params_from_hf,
)
from models.layers.mlp import GatedMLP
from models.layers.moe import TopKMoE
from models.layers.norm import RMSNorm
from models.recurrent import MAMBA2_IN_PLACE, LayerStates

_KINDS = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
}


@dataclasses.dataclass(frozen=True)
class GraniteMoeHybridConfig:
    """Shape of a Granite MoE hybrid: per-layer mixer kinds, the experts and shared MLP every layer has,
    and Granite's scalar multipliers."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "mamba" | "attention"
    attention: AttentionConfig
    mixer: Mamba2MixerConfig
    intermediate_size: int  # of each expert
    num_experts: int  # 0: no routed experts, the shared MLP alone
    num_experts_per_tok: int
    shared_intermediate_size: int  # of the shared MLP every layer adds (0: none)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # scales each block's output before the residual add
    attention_multiplier: float = 1.0  # the attention softmax scale (in place of head_dim ** -0.5)
    logits_scaling: float = 1.0  # divides the logits
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1 << 20
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.layer_types or set(self.layer_types) - {"mamba", "attention"}:
            raise ValueError(
                f"layer_types={self.layer_types} must be a non-empty sequence of mamba/attention"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts=}]"
            )
        if not (self.num_experts or self.shared_intermediate_size):
            raise ValueError("a layer needs routed experts (num_local_experts > 0) or a shared MLP")
        if self.mixer.hidden_size != self.hidden_size:
            raise ValueError(f"mixer hidden_size={self.mixer.hidden_size} != hidden_size={self.hidden_size}")
        if self.logits_scaling == 0:
            raise ValueError("logits_scaling=0 would divide the logits by zero")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def cache_spec(self) -> CacheSpec:
        return hybrid.cache_spec(self.layer_types, self.attention, self.mixer.ssm_shape,
                                 self.mixer.conv_shape)

    @property
    def num_params(self) -> int:
        d = self.hidden_size
        mixers = {"mamba": self.mixer.num_params, "attention": self.attention.num_params(d)}
        ffn = self.num_experts * (3 * d * self.intermediate_size + d) + 3 * d * self.shared_intermediate_size
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return sum(2 * d + mixers[kind] + ffn for kind in self.layer_types) + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> GraniteMoeHybridConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        if hf.get("hidden_act", "silu") != "silu":  # also the activation after the mixer's conv
            raise ValueError(f"unsupported GraniteMoeHybrid hidden_act={hf['hidden_act']!r}; only silu")
        hidden, num_layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
        names = hf.get("layer_types") or hf.get("layers_block_type") or ["linear_attention"] * num_layers
        unknown = sorted(set(names) - set(_KINDS))
        if unknown or len(names) != num_layers:
            raise ValueError(
                f"layer_types={names} must name {num_layers} layers, each linear_attention (Mamba-2) or "
                "full_attention"
            )
        position = hf.get("position_embedding_type")
        if position not in (None, "rope"):
            raise ValueError(f"unsupported position_embedding_type={position!r}; known: rope, none")
        eps = float(hf.get("rms_norm_eps", 1e-6))
        mixer = mixer_config_from_mamba_keys(hf, hidden, eps)
        bias = bool(hf.get("attention_bias", False))
        # HF's attention reads no `head_dim` from this config: heads are hidden_size / num_attention_heads.
        attention = AttentionConfig.from_hf(
            {**hf, "head_dim": None}, qkv_bias=bias, o_bias=bias, rope=position == "rope"
        )
        return cls(
            architecture=archs[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            layer_types=tuple(_KINDS[name] for name in names),
            attention=attention,
            mixer=mixer,
            intermediate_size=int(hf["intermediate_size"]),
            num_experts=int(hf.get("num_local_experts", 8) or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2) or 0),
            shared_intermediate_size=int(hf.get("shared_intermediate_size", 1024) or 0),
            embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
            attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
            logits_scaling=float(hf.get("logits_scaling", 1.0)),
            rms_norm_eps=eps,
            max_position_embeddings=int(hf.get("max_position_embeddings", 1 << 20)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids_from_hf(hf),
        )


config_from_hf = GraniteMoeHybridConfig.from_hf


class GraniteMoeHybridLayer(nnx.Module):
    """norm -> Mamba-2 or attention -> scaled residual add; norm -> experts + shared MLP -> scaled add."""

    def __init__(self, cfg: GraniteMoeHybridConfig, kind: str, *, dtype):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind, self.residual_multiplier = kind, cfg.residual_multiplier
        self.input_norm = RMSNorm(d, eps=eps, dtype=dtype)
        if kind == "mamba":
            self.mamba = Mamba2Mixer(cfg.mixer, dtype=dtype)
        else:
            self.attn = Attention(d, cfg.attention, dtype=dtype)
        self.post_attn_norm = RMSNorm(d, eps=eps, dtype=dtype)
        # Granite routes by a softmax over the top-k logits: the full softmax's top k, renormalised.
        self.moe = (
            TopKMoE(
                d,
                cfg.intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                normalize_topk=True,
                act=cfg.hidden_act,
                dtype=dtype,
            )
            if cfg.num_experts
            else None
        )
        self.shared_mlp = (
            GatedMLP(d, cfg.shared_intermediate_size, act=cfg.hidden_act, bias=False, dtype=dtype)
            if cfg.shared_intermediate_size
            else None
        )

    def __call__(
        self, x, batch: ForwardBatch, kv: KVPool | None, states: LayerStates | None, index: int
    ) -> tuple[jax.Array, KVPool | None, LayerStates | None]:
        """Mamba layers mix from their initial `states` and return their final ones; attention layers write
        KV pool layer `index` (their ordinal among attention layers)."""
        h = self.input_norm(x)
        if self.kind == "mamba":
            with jax.named_scope("mamba"):
                h, states = self.mamba(h, batch, states)
        else:
            with jax.named_scope("attention"):
                h, kv = self.attn(h, batch, kv, index)
        x = x + h * self.residual_multiplier
        h = self.post_attn_norm(x)
        with jax.named_scope("moe"):
            y = self.moe(h) if self.moe is not None else 0.0
            if self.shared_mlp is not None:
                y = y + self.shared_mlp(h)
        return x + y * self.residual_multiplier, kv, states


class GraniteMoeHybridForCausalLM(CausalLM):
    """Layers of two kinds run in a Python loop; layer i's parameters live under `layers/<i>`.

    The recurrent pool rides through the loop: each Mamba layer reads its rows and writes its finals back
    (models/recurrent.py); its pool layer is its ordinal among Mamba layers.
    """

    def __init__(self, cfg: GraniteMoeHybridConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.Dict(
            {str(i): GraniteMoeHybridLayer(cfg, kind, dtype=dtype) for i, kind in enumerate(cfg.layer_types)}
        )

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        # Multiplied here, not folded into the table: a tied LM head reads the same table unscaled.
        x = self.embed_tokens(batch.input_ids) * self.cfg.embedding_multiplier
        x, pools = hybrid.run_layers(self.layers, self.cfg.layer_types, "mamba", x, batch, pools,
                                     in_place_ops=MAMBA2_IN_PLACE)
        return self.norm(x, self.dtype), pools

    def logits(self, hidden: jax.Array) -> jax.Array:
        """f32[N, vocab] logits for hidden rows f[N, hidden], divided by `logits_scaling`."""
        return lm_logits(hidden, self.embed_weight(), self.lm_head_weight(),
                         scale=1.0 / self.cfg.logits_scaling)


def _moe_from_hf(cfg: GraniteMoeHybridConfig, get, prefix: str) -> dict[tuple[str, ...], np.ndarray]:
    """One layer's router and stacked experts from `prefix + block_sparse_moe.`, in either naming.

    Granite checkpoints hold the experts fused as `input_linear` f[E, 2F, hidden] (gate rows first) and
    `output_linear` f[E, hidden, F], the router as `router.layer`; transformers renames them to
    `experts.gate_up_proj`, `experts.down_proj` and `router` in memory (and may save that).
    """
    block = prefix + "block_sparse_moe."
    try:
        gate_up, down = get(block + "input_linear.weight"), get(block + "output_linear.weight")
        router = get(block + "router.layer.weight")
    except KeyError:
        gate_up, down = get(block + "experts.gate_up_proj"), get(block + "experts.down_proj")
        router = get(block + "router.weight")
    return {
        ("router", "kernel"): router.T,
        ("experts", "gate_up"): gate_up.transpose(0, 2, 1),
        ("experts", "down"): down.transpose(0, 2, 1),
    }


def params_from_hf(cfg: GraniteMoeHybridConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF GraniteMoeHybridForCausalLM tensors to our paths (kernels [in, out], q/k/v and gate/up fused).

    The attention multiplier replaces the usual head_dim ** -0.5 scale: it is folded into the key
    projection (the K pool holds the scaled keys; only the scores read them).
    """
    out = {("embed",): get("model.embed_tokens.weight"), ("norm", "weight"): get("model.norm.weight")}
    k_scale = cfg.attention_multiplier * cfg.attention.head_dim**0.5
    for i, kind in enumerate(cfg.layer_types):
        prefix, ours = f"model.layers.{i}.", ("layers", str(i))
        out[(*ours, "input_norm", "weight")] = get(prefix + "input_layernorm.weight")
        out[(*ours, "post_attn_norm", "weight")] = get(prefix + "post_attention_layernorm.weight")
        if kind == "mamba":
            out.update(
                hybrid.prefixed((*ours, "mamba"), mixer_params_from_hf(cfg.mixer, get, prefix + "mamba."))
            )
        else:
            attn = attention_params_from_hf(cfg.attention, get, prefix + "self_attn", k_scale=k_scale)
            out.update(hybrid.prefixed((*ours, "attn"), attn))
        if cfg.num_experts:
            out.update(hybrid.prefixed((*ours, "moe"), _moe_from_hf(cfg, get, prefix)))
        if cfg.shared_intermediate_size:
            shared = prefix + "shared_mlp."
            gate, up = np.split(get(shared + "input_linear.weight"), 2)  # gate rows, then up rows
            out[(*ours, "shared_mlp", "gate_up", "kernel")] = gate_up_rows(gate, up).T
            out[(*ours, "shared_mlp", "down", "kernel")] = get(shared + "output_linear.weight").T
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
