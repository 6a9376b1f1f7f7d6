"""Bamba: Mamba-2 layers with attention (half-rotary RoPE) at a few indices, a gated MLP after every mixer."""

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
from models.layers.attention import Attention, attention_params_from_hf
from models.layers.causal_lm import CausalLM
from models.layers.mamba2 import (
    Mamba2Mixer,
    Mamba2MixerConfig,
    mixer_config_from_mamba_keys,
    mixer_params_from_hf,
)
from models.layers.mlp import GatedMLP, gated_mlp_params_from_hf
from models.layers.norm import RMSNorm
from models.recurrent import MAMBA2_IN_PLACE, LayerStates


@dataclasses.dataclass(frozen=True)
class BambaConfig:
    """Shape of a Bamba model: which layers attend (the rest are Mamba-2), and each block's shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "mamba" | "attention"
    attention: AttentionConfig
    mixer: Mamba2MixerConfig
    intermediate_size: int  # of the gated MLP every layer has
    hidden_act: str = "silu"
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.layer_types or set(self.layer_types) - {"mamba", "attention"}:
            raise ValueError(
                f"layer_types={self.layer_types} must be a non-empty sequence of mamba/attention"
            )
        if self.vocab_size <= 0 or self.intermediate_size <= 0:
            raise ValueError(f"{self.vocab_size=} and {self.intermediate_size=} must be positive")
        if self.mixer.hidden_size != self.hidden_size:
            raise ValueError(f"mixer hidden_size={self.mixer.hidden_size} != hidden_size={self.hidden_size}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def cache_spec(self) -> CacheSpec:
        return hybrid.cache_spec(self.layer_types, self.attention, self.mixer.ssm_shape,
                                 self.mixer.conv_shape)

    @property
    def num_params(self) -> int:
        d, i = self.hidden_size, self.intermediate_size
        mixers = {"mamba": self.mixer.num_params, "attention": self.attention.num_params(d)}
        mlp = 3 * d * i + (2 * i + d) * self.mlp_bias
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return sum(2 * d + mixers[kind] + mlp for kind in self.layer_types) + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> BambaConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        if hf.get("hidden_act", "silu") != "silu":  # also the activation after the mixer's conv
            raise ValueError(f"unsupported Bamba hidden_act={hf['hidden_act']!r}; only silu")
        hidden, num_layers = int(hf["hidden_size"]), int(hf["num_hidden_layers"])
        attn_layers = set(hf.get("attn_layer_indices") or ())
        if not attn_layers <= set(range(num_layers)):
            raise ValueError(f"attn_layer_indices={sorted(attn_layers)} must lie in [0, {num_layers})")
        eps = float(hf.get("rms_norm_eps", 1e-5))
        mixer = mixer_config_from_mamba_keys(hf, hidden, eps)
        # BambaConfig hard-codes partial_rotary_factor = 0.5: RoPE turns the first half of each head.
        rope_params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_params.setdefault("partial_rotary_factor", 0.5)
        bias = bool(hf.get("attention_bias", False))
        attention = AttentionConfig.from_hf(
            {**hf, "rope_parameters": rope_params}, qkv_bias=bias, o_bias=bias, rope=True
        )
        return cls(
            architecture=archs[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            layer_types=tuple("attention" if i in attn_layers else "mamba" for i in range(num_layers)),
            attention=attention,
            mixer=mixer,
            intermediate_size=int(hf["intermediate_size"]),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            rms_norm_eps=eps,
            max_position_embeddings=int(hf.get("max_position_embeddings", 262144)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids_from_hf(hf),
        )


config_from_hf = BambaConfig.from_hf


class BambaLayer(nnx.Module):
    """norm -> Mamba-2 or attention -> residual add; norm -> gated MLP -> residual add."""

    def __init__(self, cfg: BambaConfig, kind: str, *, dtype):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.kind = kind
        self.input_norm = RMSNorm(d, eps=eps, dtype=dtype)
        if kind == "mamba":
            self.mamba = Mamba2Mixer(cfg.mixer, dtype=dtype)
        else:
            self.attn = Attention(d, cfg.attention, dtype=dtype)
        self.pre_ff_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, bias=cfg.mlp_bias, dtype=dtype)

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
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.pre_ff_norm(x))
        return x, kv, states


class BambaForCausalLM(CausalLM):
    """Layers of two kinds run in a Python loop; layer i's parameters live under `layers/<i>`.

    Mamba layers read their states from the step's input pool; all are written back after the loop.
    """

    def __init__(self, cfg: BambaConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.Dict(
            {str(i): BambaLayer(cfg, kind, dtype=dtype) for i, kind in enumerate(cfg.layer_types)}
        )

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        x = self.embed_tokens(batch.input_ids)  # the residual stream stays float32
        x, pools = hybrid.run_layers(self.layers, self.cfg.layer_types, "mamba", x, batch, pools,
                                     in_place_ops=MAMBA2_IN_PLACE)
        return self.norm(x, self.dtype), pools


def params_from_hf(cfg: BambaConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF BambaForCausalLM tensors to our paths (kernels [in, out], q/k/v and gate/up fused)."""
    out = {
        ("embed",): get("model.embed_tokens.weight"),
        ("norm", "weight"): get("model.final_layernorm.weight"),
    }
    for i, kind in enumerate(cfg.layer_types):
        prefix, ours = f"model.layers.{i}.", ("layers", str(i))
        out[(*ours, "input_norm", "weight")] = get(prefix + "input_layernorm.weight")
        out[(*ours, "pre_ff_norm", "weight")] = get(prefix + "pre_ff_layernorm.weight")
        if kind == "mamba":
            out.update(
                hybrid.prefixed((*ours, "mamba"), mixer_params_from_hf(cfg.mixer, get, prefix + "mamba."))
            )
        else:
            attn = attention_params_from_hf(cfg.attention, get, prefix + "self_attn")
            out.update(hybrid.prefixed((*ours, "attn"), attn))
        out.update(
            hybrid.prefixed(
                (*ours, "mlp"),
                gated_mlp_params_from_hf(get, prefix + "feed_forward", bias=cfg.mlp_bias),
            )
        )
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
