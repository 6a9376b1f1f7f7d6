"""Ling 2.5 / 2.6 (BailingMoeV2_5): MLA every `layer_group_size`-th layer, Lightning linear attention in the
others, dense first layers, then sigmoid group-routed experts with a shared expert."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from memory import CacheSpec, KVPool, MemoryPools, RecurrentSpec
from models import hybrid
from models.batch import ForwardBatch
from models.config import RopeConfig
from models.layers.causal_lm import CausalLM
from models.layers.linear import Linear
from models.layers.linear_attention import lightning_mix
from models.layers.mla import MLAConfig, MLAttention, mla_params_from_hf
from models.layers.mlp import GatedMLP, gated_mlp_params_from_hf
from models.layers.moe import GroupedMoE, GroupedRouting, grouped_moe_from_hf
from models.layers.norm import GroupRMSNorm, RMSNorm
from models.layers.rope import apply_rope
from models.recurrent import LayerStates

LINEAR, MLA = "linear_attention", "attention"
# The official MLA builds q_a_layernorm and kv_a_layernorm without the config's eps: its RMSNorm default.
MLA_NORM_EPS = 1e-6


def _alibi_slopes(n: int) -> list[float]:
    """Lightning Attention-2's per-head base rates: powers of 2^(-8/n), interleaved if n is no power of 2."""
    if math.log2(n).is_integer():
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]
    closest = 2 ** math.floor(math.log2(n))
    return _alibi_slopes(closest) + _alibi_slopes(2 * closest)[0::2][: n - closest]


def lightning_log_decay(num_heads: int, layer: int, num_layers: int) -> np.ndarray:
    """f32[H] per-step log decay g < 0 of linear-attention layer `layer` (its index among ALL layers).

    As the official code: -base * (1 - (layer - 1) / (num_layers - 1) + 1e-5). The `layer - 1` (not
    `layer`) is upstream's, so layer 0 decays faster than the base rates; float32 as its buffer.
    """
    factor = 1 - (layer - 1) / (num_layers - 1) + 1e-5
    return -(np.asarray(_alibi_slopes(num_heads), np.float32) * np.float32(factor)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class BailingMoeV2_5Config:
    """Shape of a Ling 2.5 model. Linear layers use `num_heads` heads of `head_dim` for q, k and v (the
    official code ignores `num_key_value_heads` there); layers `< first_k_dense_replace` have a dense MLP."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" | "attention" (MLA)
    num_heads: int
    head_dim: int
    rotary_dim: int  # head_dim * partial_rotary_factor leading channels rotate (both attention kinds)
    rope: RopeConfig
    mla: MLAConfig
    intermediate_size: int  # of the dense MLPs
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    first_k_dense_replace: int
    group_norm_size: int = 1  # groups of the linear attention's output RMSNorm
    use_qk_norm: bool = True
    qkv_bias: bool = False  # HF use_qkv_bias: the linear qkv projection (and MLA's q_a, kv_a, dense)
    linear_o_bias: bool = False  # HF use_bias: the linear attention's output projection
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.layer_types or set(self.layer_types) - {LINEAR, MLA}:
            raise ValueError(f"layer_types={self.layer_types} must be a non-empty sequence of {LINEAR}/{MLA}")
        rot, inner = self.rotary_dim, self.num_heads * self.head_dim
        if not (0 < rot <= self.head_dim and rot % 2 == 0):
            raise ValueError(f"rotary_dim={rot} must be even and in (0, head_dim={self.head_dim}]")
        if MLA in self.layer_types and rot != self.mla.qk_rope_head_dim:
            # HF builds MLA's rotary table from head_dim * partial_rotary_factor too; it only fits when equal.
            raise ValueError(f"rotary_dim={rot} must equal qk_rope_head_dim={self.mla.qk_rope_head_dim}")
        if inner % self.group_norm_size:
            raise ValueError(f"group_norm_size={self.group_norm_size} must divide heads * head_dim = {inner}")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(f"{self.first_k_dense_replace=} must be in [0, {self.num_layers}]")
        if self.num_experts:
            self.routing  # validates the routing fields

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def norm_topk_prob(self) -> bool:
        """The official gate renormalises the chosen weights whenever more than one expert is chosen."""
        return self.num_experts_per_tok > 1

    @property
    def routing(self) -> GroupedRouting:
        return GroupedRouting(
            self.num_experts,
            self.num_experts_per_tok,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )

    def sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= self.first_k_dense_replace

    @property
    def cache_spec(self) -> CacheSpec:
        num_linear = self.layer_types.count(LINEAR)
        hd = self.head_dim
        recurrent = RecurrentSpec(num_linear, (self.num_heads, hd, hd), None) if num_linear else None
        return CacheSpec(self.layer_types.count(MLA), 1, self.mla.latent_dim, recurrent, latent_kv=True)

    @property
    def num_params(self) -> int:
        d, inner = self.hidden_size, self.num_heads * self.head_dim
        linear = 3 * d * inner + 2 * d * inner + inner  # qkv, g_proj, dense, g_norm
        linear += 3 * inner * self.qkv_bias + d * self.linear_o_bias + 2 * self.head_dim * self.use_qk_norm
        mixers = {LINEAR: linear, MLA: self.mla.num_params(d)}
        experts = self.num_experts + self.n_shared_experts
        moe = experts * 3 * d * self.moe_intermediate_size + self.num_experts * d  # and the router
        mlps = [moe if self.sparse(i) else 3 * d * self.intermediate_size for i in range(self.num_layers)]
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return sum(2 * d + mixers[kind] for kind in self.layer_types) + sum(mlps) + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> BailingMoeV2_5Config:
        num_layers, group = int(hf["num_hidden_layers"]), int(hf.get("layer_group_size") or 1)
        # As upstream: each group's last layer is MLA, and so is every layer of a trailing partial group.
        full = num_layers // group * group
        layer_types = tuple(MLA if (i + 1) % group == 0 or i >= full else LINEAR for i in range(num_layers))
        num_heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads)
        qkv_bias = bool(hf.get("use_qkv_bias", False))
        mla = MLAConfig.from_hf({**hf, "attention_bias": qkv_bias, "rms_norm_eps": MLA_NORM_EPS})
        num_experts = int(hf.get("num_experts") or 0)
        eos = hf.get("eos_token_id")
        return cls(
            architecture=hf["architectures"][0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            layer_types=layer_types,
            num_heads=num_heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * float(hf.get("partial_rotary_factor", 1.0))),
            rope=RopeConfig.from_hf(hf),
            mla=mla,
            intermediate_size=int(hf["intermediate_size"]),
            num_experts=num_experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 1),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 1),
            n_shared_experts=int(hf.get("num_shared_experts") or 0),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
            group_norm_size=int(hf.get("group_norm_size") or 1),
            use_qk_norm=bool(hf.get("use_qk_norm", False)),
            qkv_bias=qkv_bias,
            linear_o_bias=bool(hf.get("use_bias", False)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            hidden_act=hf.get("hidden_act", "silu"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )


config_from_hf = BailingMoeV2_5Config.from_hf


class LightningAttention(nnx.Module):
    """qkv -> per-head q/k RMSNorm -> partial RoPE -> simple GLA (decay per head, scale head_dim^-0.5) ->
    grouped RMSNorm -> times sigmoid(gate(x)) -> dense."""

    def __init__(self, cfg: BailingMoeV2_5Config, layer: int, *, dtype):
        d, h, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.cfg = cfg
        self.qkv = Linear(d, 3 * h * hd, bias=cfg.qkv_bias, dtype=dtype)
        self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype) if cfg.use_qk_norm else None
        self.gate = Linear(d, h * hd, bias=False, dtype=dtype)  # HF's g_proj
        self.g_norm = GroupRMSNorm(h * hd, cfg.group_norm_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.dense = Linear(h * hd, d, bias=cfg.linear_o_bias, dtype=dtype)
        # A trace-time constant, not a parameter (HF's slope buffer is rebuilt from the config).
        self.log_decay = tuple(float(g) for g in lightning_log_decay(h, layer, cfg.num_layers))

    def __call__(self, x, batch: ForwardBatch, states: LayerStates) -> tuple[jax.Array, LayerStates]:
        """x f[T, hidden] (normed) -> (f32[T, hidden], the rows' final states)."""
        cfg = self.cfg
        t, h, hd, dtype = x.shape[0], cfg.num_heads, cfg.head_dim, self.dense.dtype
        # HF splits the projection's heads as [q heads | k heads | v heads].
        qkv = self.qkv(x).astype(dtype).reshape(t, 3, h, hd)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        if cfg.use_qk_norm:
            q, k = self.q_norm(q, dtype), self.k_norm(k, dtype)
        inv_freq = cfg.rope.inv_freq(cfg.rotary_dim)  # a trace-time constant
        q = apply_rope(q, batch.positions, inv_freq, cfg.rope.attention_scaling)
        k = apply_rope(k, batch.positions, inv_freq, cfg.rope.attention_scaling)
        log_decay = jnp.asarray(self.log_decay, jnp.float32)  # f32[H]
        o, finals = lightning_mix(q, k, v, log_decay, batch, states, scale=hd**-0.5)
        with jax.named_scope("norm_gate"):
            o = self.g_norm(o.reshape(t, h * hd), dtype) * jax.nn.sigmoid(self.gate(x)).astype(dtype)
        return self.dense(o), finals


class BailingLayer(nnx.Module):
    """x += mixer(norm(x)); x += mlp(norm(x)), the mixer MLA or Lightning, the MLP dense or routed."""

    def __init__(self, cfg: BailingMoeV2_5Config, layer: int, *, dtype):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = cfg.layer_types[layer]
        self.input_norm = RMSNorm(d, eps=eps, dtype=dtype)
        if self.kind == MLA:
            self.attn = MLAttention(d, cfg.mla, dtype=dtype)
        else:
            self.attn = LightningAttention(cfg, layer, dtype=dtype)
        self.post_attn_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = (
            GroupedMoE(
                d,
                cfg.moe_intermediate_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                cfg.routing,
                act=cfg.hidden_act,
                dtype=dtype,
            )
            if cfg.sparse(layer)
            else GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, bias=False, dtype=dtype)
        )

    def __call__(
        self, x, batch: ForwardBatch, kv: KVPool | None, states: LayerStates | None, index: int
    ) -> tuple[jax.Array, KVPool | None, LayerStates | None]:
        """Lightning layers mix from their initial `states` and return their final ones; MLA layers write
        latent pool layer `index` (their ordinal among MLA layers). The residual stream stays float32."""
        h = self.input_norm(x)
        if self.kind == LINEAR:
            with jax.named_scope("lightning_attention"):
                y, states = self.attn(h, batch, states)
        else:
            with jax.named_scope("mla"):
                y, kv = self.attn(h, batch, kv, index)
        x = x + y
        with jax.named_scope("moe" if isinstance(self.mlp, GroupedMoE) else "mlp"):
            x = x + self.mlp(self.post_attn_norm(x))
        return x, kv, states


class BailingMoeV2_5ForCausalLM(CausalLM):
    """Layers of two kinds run in a Python loop (`hybrid.run_layers`); layer i's parameters live under
    `layers/<i>`. The MTP layers (`num_nextn_predict_layers`) serve training only and are not built."""

    def __init__(self, cfg: BailingMoeV2_5Config, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.Dict({str(i): BailingLayer(cfg, i, dtype=dtype) for i in range(cfg.num_layers)})

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        x = self.embed_tokens(batch.input_ids)  # the residual stream stays float32
        x, pools = hybrid.run_layers(self.layers, self.cfg.layer_types, LINEAR, x, batch, pools)
        return self.norm(x, self.dtype), pools


def _lightning_from_hf(cfg: BailingMoeV2_5Config, get, prefix: str) -> dict[tuple[str, ...], np.ndarray]:
    out = {
        ("qkv", "kernel"): get(prefix + "query_key_value.weight").T,
        ("gate", "kernel"): get(prefix + "g_proj.weight").T,
        ("g_norm", "weight"): get(prefix + "g_norm.weight"),
        ("dense", "kernel"): get(prefix + "dense.weight").T,
    }
    if cfg.use_qk_norm:
        out[("q_norm", "weight")] = get(prefix + "query_layernorm.weight")
        out[("k_norm", "weight")] = get(prefix + "key_layernorm.weight")
    if cfg.qkv_bias:
        out[("qkv", "bias")] = get(prefix + "query_key_value.bias")
    if cfg.linear_o_bias:
        out[("dense", "bias")] = get(prefix + "dense.bias")
    return out


def _mlp_from_hf(cfg: BailingMoeV2_5Config, get, prefix: str, i: int) -> dict[tuple[str, ...], np.ndarray]:
    if not cfg.sparse(i):
        return gated_mlp_params_from_hf(get, prefix[:-1], bias=False)
    return grouped_moe_from_hf(
        get, prefix, cfg.num_experts, bias_name="expert_bias", shared=cfg.n_shared_experts > 0
    )


def params_from_hf(cfg: BailingMoeV2_5Config, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps the official checkpoint's tensors to our paths (kernels [in, out], experts stacked).

    The slope buffers are not stored: they are rebuilt from the config. MTP layers' tensors are not read.
    """
    out = {
        ("embed",): get("model.word_embeddings.weight"),
        ("norm", "weight"): get("model.norm.weight"),
    }
    for i, kind in enumerate(cfg.layer_types):
        prefix, ours = f"model.layers.{i}.", ("layers", str(i))
        out[(*ours, "input_norm", "weight")] = get(prefix + "input_layernorm.weight")
        out[(*ours, "post_attn_norm", "weight")] = get(prefix + "post_attention_layernorm.weight")
        attn = prefix + "attention."
        if kind == MLA:
            mixer = mla_params_from_hf(cfg.mla, get, attn, o_name="dense")  # Bailing's name for o_proj
        else:
            mixer = _lightning_from_hf(cfg, get, attn)
        out.update(hybrid.prefixed((*ours, "attn"), mixer))
        out.update(hybrid.prefixed((*ours, "mlp"), _mlp_from_hf(cfg, get, prefix + "mlp.", i)))
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
