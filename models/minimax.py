"""MiniMax (MiniMax-Text-01): Lightning linear attention mixed with softmax attention, MoE in every layer."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.moe.reference import ACTIVATIONS
from memory import CacheSpec, KVPool, MemoryPools, RecurrentSpec
from models import hybrid
from models.batch import ForwardBatch
from models.config import AttentionConfig
from models.layers.attention import Attention, attention_params_from_hf
from models.layers.causal_lm import CausalLM
from models.layers.linear import Linear
from models.layers.linear_attention import lightning_mix
from models.layers.moe import TopKMoE
from models.layers.norm import RMSNorm
from models.recurrent import (
    LayerStates,
)

LINEAR, FULL = "linear_attention", "full_attention"
# HF's Lightning output norm is built without the config's eps: MiniMaxRMSNorm's default.
LIGHTNING_NORM_EPS = 1e-6


def lightning_slopes(num_heads: int, layer: int, num_layers: int) -> np.ndarray:
    """f32[H] per-head decay rates of Lightning layer `layer` (its index among ALL layers), as HF builds them.

    ALiBi-style slopes (2^(-8/H))^(h+1), shrunk linearly with depth: deeper layers forget more slowly.
    """
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    # float32 like HF's buffer (a python float to the power of an int tensor, times a python float).
    rate = np.float32(base) ** (np.arange(num_heads, dtype=np.float32) + 1)
    return (rate * np.float32(factor)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class MiniMaxConfig:
    """Shape of a MiniMax model: which layers are Lightning (linear) attention, attention/MoE shapes, and
    the residual factors (`x = alpha * normed_x + beta * block(normed_x)` after each block)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" | "full_attention"
    attention: AttentionConfig  # of the full-attention layers; Lightning layers use its heads and head_dim
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # of each expert
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    linear_attn_alpha_factor: float = 1.0
    linear_attn_beta_factor: float = 1.0
    full_attn_alpha_factor: float = 1.0
    full_attn_beta_factor: float = 1.0
    mlp_alpha_factor: float = 1.0
    mlp_beta_factor: float = 1.0
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.layer_types or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(
                f"layer_types={self.layer_types} must be a non-empty sequence of {LINEAR}/{FULL}"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]"
            )
        if self.vocab_size <= 0 or self.intermediate_size <= 0:
            raise ValueError(f"{self.vocab_size=} and {self.intermediate_size=} must be positive")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_heads(self) -> int:
        return self.attention.num_heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @property
    def cache_spec(self) -> CacheSpec:
        num_linear = self.layer_types.count(LINEAR)
        hd = self.head_dim
        recurrent = RecurrentSpec(num_linear, (self.num_heads, hd, hd), None) if num_linear else None
        return CacheSpec(self.layer_types.count(FULL), self.attention.num_kv_heads, hd, recurrent)

    @property
    def num_params(self) -> int:
        d, e = self.hidden_size, self.num_experts
        inner = self.num_heads * self.head_dim
        mixers = {
            LINEAR: 3 * d * inner + inner * d + d * inner + inner,  # qkv, out, gate, norm
            FULL: self.attention.num_params(d),
        }
        moe = e * (3 * d * self.intermediate_size + d)  # experts and router rows
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return sum(2 * d + mixers[kind] + moe for kind in self.layer_types) + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MiniMaxConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        num_layers = int(hf["num_hidden_layers"])
        layer_types = tuple(
            hf.get("layer_types") or (FULL if (i + 1) % 2 else LINEAR for i in range(num_layers))
        )
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        if hf.get("sliding_window"):
            raise ValueError(
                f"MiniMax sliding_window={hf['sliding_window']} is not supported: paged attention always "
                "attends to the whole context"
            )
        # HF's MiniMax RoPE turns every channel of a head, whatever `partial_rotary_factor` says.
        rope_params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_params["partial_rotary_factor"] = 1.0
        attention = AttentionConfig.from_hf(
            {**hf, "rope_parameters": rope_params}, qkv_bias=False, o_bias=False, rope=True
        )
        eos = hf.get("eos_token_id")
        return cls(
            architecture=archs[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            layer_types=layer_types,
            attention=attention,
            num_experts=int(hf.get("num_local_experts") or hf.get("num_experts") or 8),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            intermediate_size=int(hf["intermediate_size"]),
            hidden_act=hf.get("hidden_act", "silu"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            **{
                f"{name}_factor": float(hf.get(f"{name}_factor", 1.0))
                for name in (
                    "linear_attn_alpha",
                    "linear_attn_beta",
                    "full_attn_alpha",
                    "full_attn_beta",
                    "mlp_alpha",
                    "mlp_beta",
                )
            },
            max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )


config_from_hf = MiniMaxConfig.from_hf


class LightningAttention(nnx.Module):
    """act(qkv_proj) -> per-head (q, k, v); linear attention with per-head decay slopes (no softmax, no
    scale, a token attends to itself); RMSNorm over all heads; sigmoid(output_gate(x)) gate; out_proj."""

    def __init__(self, cfg: MiniMaxConfig, layer: int, *, dtype):
        d, h, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.cfg = cfg
        self.qkv = Linear(d, 3 * h * hd, bias=False, dtype=dtype)
        self.output_gate = Linear(d, h * hd, bias=False, dtype=dtype)
        self.norm = RMSNorm(h * hd, eps=LIGHTNING_NORM_EPS, dtype=dtype)
        self.out_proj = Linear(h * hd, d, bias=False, dtype=dtype)
        # Trace-time constants, not parameters (HF's slope buffers are rebuilt from the config).
        self.slopes = tuple(float(r) for r in lightning_slopes(h, layer, cfg.num_layers))

    def __call__(
        self, x: jax.Array, batch: ForwardBatch, states: LayerStates
    ) -> tuple[jax.Array, LayerStates]:
        """Mixes x f[T, hidden] (normed) from the step's initial states (rows: prefill blocks, then decode
        rows; see models/recurrent.py); returns f32[T, hidden] and the rows' final states."""
        cfg = self.cfg
        t, h, hd = x.shape[0], cfg.num_heads, cfg.head_dim
        dtype = self.out_proj.dtype
        # HF lays qkv_proj's output out per head: [q_h, k_h, v_h] for each head h.
        qkv = _act(cfg.hidden_act, self.qkv(x)).astype(dtype).reshape(t, h, 3, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        log_decay = -jnp.asarray(self.slopes, jnp.float32)  # f32[H]
        o, finals = lightning_mix(q, k, v, log_decay, batch, states, scale=1.0)
        o = o.reshape(t, h * hd)  # f32[T, H * hd]
        with jax.named_scope("norm_gate"):
            o = self.norm(o, dtype) * jax.nn.sigmoid(self.output_gate(x)).astype(dtype)
        return self.out_proj(o), finals


def _act(name: str, x: jax.Array) -> jax.Array:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act={name!r}; known: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name](x)


class MiniMaxLayer(nnx.Module):
    """h = norm(x); x = alpha * h + beta * mixer(h); h = norm(x); x = alpha' * h + beta' * moe(h).

    As in HF, the residual taken around each block is its NORMED input, scaled by the alpha factor.
    """

    def __init__(self, cfg: MiniMaxConfig, kind: str, layer: int, *, dtype):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = kind
        self.input_norm = RMSNorm(d, eps=eps, dtype=dtype)
        if kind == LINEAR:
            self.attn = LightningAttention(cfg, layer, dtype=dtype)
            self.alpha, self.beta = cfg.linear_attn_alpha_factor, cfg.linear_attn_beta_factor
        else:
            self.attn = Attention(d, cfg.attention, dtype=dtype)
            self.alpha, self.beta = cfg.full_attn_alpha_factor, cfg.full_attn_beta_factor
        self.post_attn_norm = RMSNorm(d, eps=eps, dtype=dtype)
        # Softmax over all experts, top-k renormalised to sum to one (as Mixtral).
        self.mlp = TopKMoE(
            d, cfg.intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, normalize_topk=True,
            act=cfg.hidden_act, dtype=dtype,
        )
        self.mlp_alpha, self.mlp_beta = cfg.mlp_alpha_factor, cfg.mlp_beta_factor

    def __call__(
        self, x, batch: ForwardBatch, kv: KVPool | None, states: LayerStates | None, index: int
    ) -> tuple[jax.Array, KVPool | None, LayerStates | None]:
        """Lightning layers mix from their initial `states` and return their final ones; attention layers
        write KV pool layer `index` (their ordinal among attention layers)."""
        h = self.input_norm(x, jnp.float32)  # the residual stream stays float32
        if self.kind == LINEAR:
            with jax.named_scope("lightning_attention"):
                y, states = self.attn(h, batch, states)
        else:
            with jax.named_scope("attention"):
                y, kv = self.attn(h, batch, kv, index)
        x = h * self.alpha + y * self.beta
        h = self.post_attn_norm(x, jnp.float32)
        with jax.named_scope("moe"):
            x = h * self.mlp_alpha + self.mlp(h) * self.mlp_beta
        return x, kv, states


class MiniMaxForCausalLM(CausalLM):
    """Layers of two kinds run in a Python loop; layer i's parameters live under `layers/<i>`.

    Each Lightning layer reads its rows' states from the pool carried through the loop and writes its
    final states back (models/recurrent.py); attention layers use the paged KV pool.
    """

    def __init__(self, cfg: MiniMaxConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.Dict(
            {str(i): MiniMaxLayer(cfg, kind, i, dtype=dtype) for i, kind in enumerate(cfg.layer_types)}
        )

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        x = self.embed_tokens(batch.input_ids)  # the residual stream stays float32
        x, pools = hybrid.run_layers(self.layers, self.cfg.layer_types, LINEAR, x, batch, pools)
        return self.norm(x, self.dtype), pools


def _experts_from_hf(cfg: MiniMaxConfig, get, prefix: str) -> dict[tuple[str, ...], np.ndarray]:
    """Router and stacked experts of one layer, from either on-disk layout.

    Hub checkpoints (and transformers 5's `save_pretrained`, which converts back) use Mixtral's per-expert
    layout `block_sparse_moe.experts.{j}.w1/w3/w2` (gate/up/down); transformers 5's in-memory layout
    (`save_original_format=False`) is fused: `mlp.experts.gate_up_proj` [E, 2F, hidden] (gate rows first)
    and `mlp.experts.down_proj` [E, hidden, F].
    """
    try:
        fused_gate_up = get(prefix + "mlp.experts.gate_up_proj")  # f[E, 2F, hidden]
    except KeyError:
        fused_gate_up = None
    if fused_gate_up is not None:
        router = get(prefix + "mlp.gate.weight")
        gate_up = fused_gate_up.transpose(0, 2, 1)
        down = get(prefix + "mlp.experts.down_proj").transpose(0, 2, 1)
    else:
        block = prefix + "block_sparse_moe."
        router = get(block + "gate.weight")
        experts = [f"{block}experts.{j}." for j in range(cfg.num_experts)]
        gate_up = np.stack(
            [np.concatenate([get(e + "w1.weight"), get(e + "w3.weight")]).T for e in experts]
        )
        down = np.stack([get(e + "w2.weight").T for e in experts])
    return {
        ("mlp", "router", "kernel"): router.T,
        ("mlp", "experts", "gate_up"): gate_up,
        ("mlp", "experts", "down"): down,
    }


def params_from_hf(cfg: MiniMaxConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF MiniMaxForCausalLM tensors to our paths (kernels [in, out], q/k/v fused, experts stacked).

    Lightning layers' decay buffers (slope_rate, ...) are not read: the slopes are rebuilt from the config.
    """
    out = {
        ("embed",): get("model.embed_tokens.weight"),
        ("norm", "weight"): get("model.norm.weight"),
    }
    for i, kind in enumerate(cfg.layer_types):
        prefix, ours = f"model.layers.{i}.", ("layers", str(i))
        out[(*ours, "input_norm", "weight")] = get(prefix + "input_layernorm.weight")
        out[(*ours, "post_attn_norm", "weight")] = get(prefix + "post_attention_layernorm.weight")
        attn = prefix + "self_attn."
        if kind == LINEAR:
            out[(*ours, "attn", "qkv", "kernel")] = get(attn + "qkv_proj.weight").T
            out[(*ours, "attn", "output_gate", "kernel")] = get(attn + "output_gate.weight").T
            out[(*ours, "attn", "norm", "weight")] = get(attn + "norm.weight")
            out[(*ours, "attn", "out_proj", "kernel")] = get(attn + "out_proj.weight").T
        else:
            full = attention_params_from_hf(cfg.attention, get, attn[:-1])
            out.update(hybrid.prefixed((*ours, "attn"), full))
        out.update(hybrid.prefixed(ours, _experts_from_hf(cfg, get, prefix)))
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
