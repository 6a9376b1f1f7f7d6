"""Jamba: Mamba-1 layers with attention (no RoPE) every few layers, a mixture of experts every other MLP."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from memory import CacheSpec, KVPool, MemoryPools
from models import hybrid
from models.batch import ForwardBatch
from models.config import AttentionConfig, eos_ids_from_hf
from models.layers.attention import Attention, attention_params_from_hf
from models.layers.causal_lm import CausalLM
from models.layers.mamba import MambaMixer
from models.layers.mamba import mixer_params_from_hf as mamba_params_from_hf
from models.layers.mlp import ACTIVATIONS, GatedMLP, gated_mlp_params_from_hf
from models.layers.moe import TopKMoE, experts_from_hf
from models.layers.norm import RMSNorm
from models.recurrent import LayerStates


@dataclasses.dataclass(frozen=True)
class JambaConfig:
    """Shape of a Jamba model: per-layer mixer kind and MLP kind, and the one shape of each block."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "mamba" | "attention"
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or the dense gated MLP (False)
    attention: AttentionConfig
    intermediate_size: int  # of the dense MLP and of each expert
    num_experts: int
    num_experts_per_tok: int
    mamba_intermediate_size: int  # mamba_expand * hidden_size: the mixer's channel count Dn
    mamba_state_size: int  # N
    mamba_conv_kernel: int = 4
    mamba_dt_rank: int = 16
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.layer_types or set(self.layer_types) - {"mamba", "attention"}:
            raise ValueError(
                f"layer_types={self.layer_types} must be a non-empty sequence of mamba/attention"
            )
        if len(self.sparse_layers) != len(self.layer_types):
            raise ValueError(
                f"sparse_layers={self.sparse_layers} needs one entry per layer ({self.num_layers})"
            )
        if any(self.sparse_layers) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts=}]"
            )
        for name in ("vocab_size", "intermediate_size", "mamba_intermediate_size", "mamba_state_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act={self.hidden_act!r}; known: {', '.join(ACTIVATIONS)}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def cache_spec(self) -> CacheSpec:
        i, n = self.mamba_intermediate_size, self.mamba_state_size
        return hybrid.cache_spec(self.layer_types, self.attention, (i, n), (i, self.mamba_conv_kernel - 1))

    @property
    def num_params(self) -> int:
        d, i, n, r, k = (
            self.hidden_size,
            self.mamba_intermediate_size,
            self.mamba_state_size,
            self.mamba_dt_rank,
            self.mamba_conv_kernel,
        )
        mamba = (
            d * 2 * i
            + i * k
            + i * (r + 2 * n)
            + r * i
            + i
            + i * n
            + i
            + i * d
            + (2 * i + d) * self.mamba_proj_bias
            + i * self.mamba_conv_bias
            + r
            + 2 * n
        )
        mixers = {"mamba": mamba, "attention": self.attention.num_params(d)}
        dense = 3 * d * self.intermediate_size
        sparse = self.num_experts * (dense + d)  # experts and router rows
        mlps = sum(sparse if s else dense for s in self.sparse_layers)
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return sum(2 * d + mixers[kind] for kind in self.layer_types) + mlps + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> JambaConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        if hf.get("hidden_act", "silu") != "silu":  # also the activation after the mixer's conv
            raise ValueError(f"unsupported Jamba hidden_act={hf['hidden_act']!r}; only silu")
        hidden, num_layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
        attn_period, attn_offset = int(hf.get("attn_layer_period", 8)), int(hf.get("attn_layer_offset", 4))
        expert_period, expert_offset = (
            int(hf.get("expert_layer_period", 2)),
            int(hf.get("expert_layer_offset", 1)),
        )
        if not (0 <= attn_offset < attn_period and 0 <= expert_offset < expert_period):
            raise ValueError(
                f"layer offsets must lie in [0, period): attn {attn_offset}/{attn_period}, "
                f"expert {expert_offset}/{expert_period}"
            )
        num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 16)
        rank = hf.get("mamba_dt_rank", "auto")
        # Jamba's attention has no biases and no positional encoding: the Mamba layers carry position.
        attention = AttentionConfig.from_hf(hf, qkv_bias=False, o_bias=False, rope=False)
        return cls(
            architecture=archs[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            layer_types=tuple(
                "attention" if i % attn_period == attn_offset else "mamba" for i in range(num_layers)
            ),
            # HF builds a dense MLP where a layer's expert count is 1, as with num_experts == 1.
            sparse_layers=tuple(
                num_experts > 1 and i % expert_period == expert_offset for i in range(num_layers)
            ),
            attention=attention,
            intermediate_size=int(hf["intermediate_size"]),
            num_experts=num_experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            mamba_intermediate_size=int(hf.get("mamba_expand", 2)) * hidden,
            mamba_state_size=int(hf.get("mamba_d_state", 16)),
            mamba_conv_kernel=int(hf.get("mamba_d_conv", 4)),
            mamba_dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
            mamba_conv_bias=bool(hf.get("mamba_conv_bias", True)),
            mamba_proj_bias=bool(hf.get("mamba_proj_bias", False)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids_from_hf(hf),
        )


config_from_hf = JambaConfig.from_hf


class JambaLayer(nnx.Module):
    """norm -> Mamba-1 or attention -> residual add; norm -> experts or gated MLP -> residual add."""

    def __init__(self, cfg: JambaConfig, kind: str, sparse: bool, *, dtype):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = kind
        self.input_norm = RMSNorm(d, eps=eps, dtype=dtype)
        if kind == "mamba":
            self.mamba = MambaMixer(
                d,
                cfg.mamba_intermediate_size,
                cfg.mamba_state_size,
                conv_kernel=cfg.mamba_conv_kernel,
                time_step_rank=cfg.mamba_dt_rank,
                use_bias=cfg.mamba_proj_bias,
                use_conv_bias=cfg.mamba_conv_bias,
                hidden_act=cfg.hidden_act,
                bcdt_norm="weighted",  # HF's dt/b/c_layernorm, with the model's rms_norm_eps
                bcdt_norm_eps=eps,
                dtype=dtype,
            )
        else:
            self.attn = Attention(d, cfg.attention, dtype=dtype)
        self.pre_ff_norm = RMSNorm(d, eps=eps, dtype=dtype)
        if sparse:
            self.feed_forward = TopKMoE(
                d,
                cfg.intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                normalize_topk=False,
                act=cfg.hidden_act,
                dtype=dtype,
            )
        else:
            self.feed_forward = GatedMLP(
                d, cfg.intermediate_size, act=cfg.hidden_act, bias=False, dtype=dtype
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
        x = x + h
        with jax.named_scope("moe" if isinstance(self.feed_forward, TopKMoE) else "mlp"):
            x = x + self.feed_forward(self.pre_ff_norm(x))
        return x, kv, states


class JambaForCausalLM(CausalLM):
    """Layers of different shapes run in a Python loop; layer i's parameters live under `layers/<i>`.

    The recurrent pool rides through the loop: each Mamba layer reads its rows and writes its finals back
    (models/recurrent.py); its pool layer is its ordinal among Mamba layers.
    """

    def __init__(self, cfg: JambaConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.Dict(
            {
                str(i): JambaLayer(cfg, kind, sparse, dtype=dtype)
                for i, (kind, sparse) in enumerate(zip(cfg.layer_types, cfg.sparse_layers))
            }
        )

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        x = self.embed_tokens(batch.input_ids)  # the residual stream stays float32
        x, pools = hybrid.run_layers(self.layers, self.cfg.layer_types, "mamba", x, batch, pools)
        return self.norm(x, self.dtype), pools


def params_from_hf(cfg: JambaConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF JambaForCausalLM tensors to our paths (kernels [in, out], q/k/v and gate/up fused)."""
    out = {
        ("embed",): get("model.embed_tokens.weight"),
        ("norm", "weight"): get("model.final_layernorm.weight"),
    }
    for i, (kind, sparse) in enumerate(zip(cfg.layer_types, cfg.sparse_layers)):
        prefix, ours = f"model.layers.{i}.", ("layers", str(i))
        out[(*ours, "input_norm", "weight")] = get(prefix + "input_layernorm.weight")
        out[(*ours, "pre_ff_norm", "weight")] = get(prefix + "pre_ff_layernorm.weight")
        if kind == "mamba":
            mixer = mamba_params_from_hf(
                get,
                prefix + "mamba.",
                use_bias=cfg.mamba_proj_bias,
                use_conv_bias=cfg.mamba_conv_bias,
                bcdt_norm="weighted",
            )
            out.update(hybrid.prefixed((*ours, "mamba"), mixer))
        else:
            attn = attention_params_from_hf(cfg.attention, get, prefix + "self_attn")
            out.update(hybrid.prefixed((*ours, "attn"), attn))
        ff = prefix + "feed_forward."
        if sparse:
            moe = {
                ("router", "kernel"): get(ff + "router.weight").T,
                **experts_from_hf(get, ff, cfg.num_experts),
            }
        else:
            moe = gated_mlp_params_from_hf(get, prefix + "feed_forward", bias=False)
        out.update(hybrid.prefixed((*ours, "feed_forward"), moe))
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
