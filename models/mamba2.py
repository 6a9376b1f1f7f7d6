"""Mamba-2 (SSD) language models: pre-norm mixer blocks (models/layers/mamba2.py), layers scanned."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from memory import CacheSpec, MemoryPools, RecurrentSpec
from models.batch import ForwardBatch
from models.config import eos_ids_from_hf
from models.layers.causal_lm import CausalLM
from models.layers.mamba2 import Mamba2Mixer, Mamba2MixerConfig, mixer_params_from_hf, parse_time_step_limit
from models.layers.norm import RMSNorm
from models.layers.stack import layer_stack
from models.recurrent import MAMBA2_IN_PLACE, LayerStates, scan_recurrent_layers


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """A pure Mamba-2 decoder: pre-norm mixer blocks with a float32 residual, a final norm, an LM head."""

    architecture: str
    vocab_size: int
    num_layers: int
    mixer: Mamba2MixerConfig
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 1 << 20  # a recurrent state has no context limit

    def __post_init__(self):
        if self.vocab_size <= 0 or self.num_layers <= 0:
            raise ValueError(f"{self.vocab_size=} and {self.num_layers=} must be positive")

    @property
    def hidden_size(self) -> int:
        return self.mixer.hidden_size

    @property
    def cache_spec(self) -> CacheSpec:
        recurrent = RecurrentSpec(self.num_layers, self.mixer.ssm_shape, self.mixer.conv_shape)
        return CacheSpec(num_kv_layers=0, recurrent=recurrent)

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d = self.hidden_size
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (d + self.mixer.num_params) + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Mamba2Config:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        hidden, num_heads, head_dim = int(hf["hidden_size"]), int(hf["num_heads"]), int(hf["head_dim"])
        expand = hf.get("expand", 2)
        if hidden * expand != num_heads * head_dim:
            raise ValueError(f"hidden_size * expand = {hidden * expand} must equal num_heads * head_dim = "
                             f"{num_heads * head_dim}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported Mamba-2 hidden_act={hf['hidden_act']!r}; only silu")
        eps = float(hf.get("layer_norm_epsilon", 1e-5))
        n_groups = int(hf.get("n_groups", 8))
        use_bias = bool(hf.get("use_bias", False))
        mixer = Mamba2MixerConfig(
            hidden_size=hidden, num_heads=num_heads, head_dim=head_dim, n_groups=n_groups,
            state_size=int(hf.get("state_size", 128)), conv_kernel=int(hf.get("conv_kernel", 4)),
            norm_groups=n_groups, norm_eps=eps, use_conv_bias=bool(hf.get("use_conv_bias", True)),
            in_proj_bias=use_bias, out_proj_bias=use_bias,
            time_step_limit=parse_time_step_limit(hf.get("time_step_limit")),
        )
        return cls(
            architecture=archs[0], vocab_size=int(hf["vocab_size"]), num_layers=int(hf["num_hidden_layers"]),
            mixer=mixer, norm_eps=eps, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids_from_hf(hf),
        )


config_from_hf = Mamba2Config.from_hf


class Mamba2Block(nnx.Module):
    def __init__(self, cfg: Mamba2Config, *, dtype):
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype)
        self.mixer = Mamba2Mixer(cfg.mixer, dtype=dtype)

    def __call__(self, x, batch: ForwardBatch, states: LayerStates) -> tuple[jax.Array, LayerStates]:
        # HF rounds the float32 residual to the model dtype before the norm (a no-op in float32).
        with jax.named_scope("mixer"):
            h, states = self.mixer(self.norm(x.astype(self.norm.weight.dtype)), batch, states)
        return x + h, states


class Mamba2ForCausalLM(CausalLM):
    """Mamba-2 decoder run by one `lax.scan` over layers (weights stacked or per layer:
    models/layers/stack.py:`layer_stack`).

    The state pool rides in the scan carry; each layer gathers its rows and scatters its final states
    (see models/recurrent.py for why that is in place). The residual stream stays float32 (HF's
    `residual_in_fp32`; we keep it for every config).
    """

    def __init__(self, cfg: Mamba2Config, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.norm_eps, dtype=dtype)
        self.layers = layer_stack(lambda: Mamba2Block(cfg, dtype=dtype), cfg.num_layers)

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f32[T, hidden] and the updated pools."""
        x = self.embed_tokens(batch.input_ids)
        x, rec = scan_recurrent_layers(self.layers, self.cfg.num_layers, x, batch, pools.recurrent,
                                       in_place_ops=MAMBA2_IN_PLACE)
        # HF's norm_f keeps the float32 residual's dtype; the LM head casts to the weight dtype.
        return self.norm(x, jnp.float32), pools._replace(recurrent=rec)


def params_from_hf(cfg: Mamba2Config, get) -> dict[tuple, np.ndarray]:
    """Maps HF Mamba2ForCausalLM tensors to our parameter paths (layer i's under ("layers", i, ...))."""
    out = {}
    for i in range(cfg.num_layers):
        mixer = mixer_params_from_hf(cfg.mixer, get, f"backbone.layers.{i}.mixer.")
        out.update({("layers", i, "mixer", *path): value for path, value in mixer.items()})
        out[("layers", i, "norm", "weight")] = get(f"backbone.layers.{i}.norm.weight")
    out[("embed",)] = get("backbone.embeddings.weight")
    out[("norm", "weight")] = get("backbone.norm_f.weight")
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
