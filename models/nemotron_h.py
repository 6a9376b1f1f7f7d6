"""Nemotron-H: a stack of single-mixer layers, each Mamba-2, attention (no RoPE) or a relu^2 MLP."""

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
from models.layers.mamba2 import Mamba2Mixer, Mamba2MixerConfig, mixer_params_from_hf
from models.layers.mlp import ReluSquaredMLP
from models.layers.norm import RMSNorm
from models.recurrent import MAMBA2_IN_PLACE, LayerStates

# HF `layers_block_type` names (and the `hybrid_override_pattern` letters of older configs) -> our kinds.
_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp"}
_LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _layer_types(hf: dict[str, Any]) -> tuple[str, ...]:
    """Our kind of every layer, from `layers_block_type` or the older `hybrid_override_pattern` string."""
    names = hf.get("layers_block_type")
    if names is None:
        pattern = hf.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError("Nemotron-H config has neither layers_block_type nor hybrid_override_pattern")
        unknown = sorted(set(pattern) - set(_LETTERS))
        if unknown:
            raise ValueError(
                f"hybrid_override_pattern={pattern!r} has unknown letters {unknown}; known: M * - E"
            )
        names = [_LETTERS[c] for c in pattern]
    for i, name in enumerate(names):
        if name not in _KINDS:
            raise ValueError(
                f"Nemotron-H layer {i} is {name!r}, which is not supported; supported: "
                "linear_attention (M, Mamba-2), full_attention (*, attention), mlp (-, relu^2 MLP); "
                "mixture-of-experts layers (E, moe) are not"
            )
    return tuple(_KINDS[name] for name in names)


@dataclasses.dataclass(frozen=True)
class NemotronHConfig:
    """Shape of a Nemotron-H model: per-layer kinds plus the one shape each kind has."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "mamba" | "attention" | "mlp"
    attention: AttentionConfig
    mixer: Mamba2MixerConfig
    intermediate_size: int  # of the relu^2 MLP layers
    mlp_bias: bool = False
    norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    # HF's NemotronHForCausalLM never ties lm_head to the embedding (`_tied_weights_keys = {}`).
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.layer_types or set(self.layer_types) - set(_KINDS.values()):
            raise ValueError(
                f"layer_types={self.layer_types} must be a non-empty sequence of mamba/attention/mlp"
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
        per_kind = {
            "mamba": self.mixer.num_params,
            "attention": self.attention.num_params(d),
            "mlp": 2 * d * i + (i + d) * self.mlp_bias,
        }
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return sum(d + per_kind[kind] for kind in self.layer_types) + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> NemotronHConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        for key, default in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            if hf.get(key, default) != default:
                raise ValueError(f"unsupported Nemotron-H {key}={hf[key]!r}; only {default}")

        def get(name: str, legacy: str, default):  # HF renames the older mamba_* keys on load
            return hf.get(name, hf.get(legacy, default))

        hidden, eps = int(hf["hidden_size"]), float(hf.get("layer_norm_epsilon", 1e-5))
        n_groups = int(get("n_groups", "mamba_n_groups", 8))
        use_bias = bool(hf.get("use_bias", False))
        mixer = Mamba2MixerConfig(
            hidden_size=hidden,
            num_heads=int(hf.get("mamba_num_heads", 128)),
            head_dim=int(hf.get("mamba_head_dim", 64)),
            n_groups=n_groups,
            state_size=int(hf.get("ssm_state_size", 128)),
            conv_kernel=int(get("conv_kernel", "mamba_d_conv", 4)),
            norm_groups=n_groups,
            norm_eps=eps,
            use_conv_bias=bool(get("use_conv_bias", "mamba_conv_bias", True)),
            in_proj_bias=use_bias,
            out_proj_bias=use_bias,
            # HF's Nemotron-H mixer ignores `time_step_limit` and clamps dt from below at time_step_min.
            time_step_limit=(float(get("time_step_min", "mamba_dt_min", 0.001)), float("inf")),
        )
        # NemotronHConfig.head_dim defaults to 128, not hidden // heads; its attention has no biases.
        attention = AttentionConfig.from_hf({"head_dim": 128, **hf}, qkv_bias=False, o_bias=False, rope=False)
        return cls(
            architecture=archs[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            layer_types=_layer_types(hf),
            attention=attention,
            mixer=mixer,
            intermediate_size=int(hf["intermediate_size"]),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            norm_eps=eps,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids_from_hf(hf),
        )


config_from_hf = NemotronHConfig.from_hf


class NemotronHBlock(nnx.Module):
    """norm -> one mixer (Mamba-2, attention or MLP) -> residual add."""

    def __init__(self, cfg: NemotronHConfig, kind: str, *, dtype):
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(cfg.mixer, dtype=dtype)
        elif kind == "attention":
            self.mixer = Attention(cfg.hidden_size, cfg.attention, dtype=dtype)
        else:
            self.mixer = ReluSquaredMLP(
                cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype
            )

    def __call__(
        self, x, batch: ForwardBatch, kv: KVPool | None, states: LayerStates | None, index: int
    ) -> tuple[jax.Array, KVPool | None, LayerStates | None]:
        """Mamba layers mix from their initial `states` and return their final ones; attention layers write
        KV pool layer `index` (their ordinal among attention layers); MLP layers touch neither."""
        # HF's Nemotron-H norm multiplies by the weight in float32 (unlike Llama's).
        h = self.norm(x, jnp.float32)
        with jax.named_scope(self.kind):
            if self.kind == "mamba":
                h, states = self.mixer(h, batch, states)
            elif self.kind == "attention":
                h, kv = self.mixer(h, batch, kv, index)
            else:
                h = self.mixer(h)
        return x + h, kv, states


class NemotronHForCausalLM(CausalLM):
    """Layers of different kinds run in a Python loop (each compiled once per step program).

    Layer i's parameters live under `layers/<i>`; its pool layer is its ordinal among layers of its kind.
    Mamba layers read their states from the step's input pool; all are written back after the loop.
    """

    def __init__(self, cfg: NemotronHConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.init_ends(cfg, cfg.norm_eps, dtype=dtype)
        self.layers = nnx.Dict(
            {str(i): NemotronHBlock(cfg, kind, dtype=dtype) for i, kind in enumerate(cfg.layer_types)}
        )

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f32[T, hidden] and the updated pools."""
        x = self.embed_tokens(batch.input_ids)  # the residual stream stays float32
        x, pools = hybrid.run_layers(self.layers, self.cfg.layer_types, "mamba", x, batch, pools,
                                     in_place_ops=MAMBA2_IN_PLACE)
        return self.norm(x, jnp.float32), pools


def params_from_hf(cfg: NemotronHConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF NemotronHForCausalLM tensors to our parameter paths (kernels [in, out], q/k/v fused).

    Checkpoints name the base model `backbone.` (NVIDIA's releases, and what transformers writes back);
    `model.` is accepted too.
    """
    for base in ("backbone.", "model."):
        try:
            embed = get(base + "embeddings.weight")
            break
        except KeyError:
            continue
    else:
        raise KeyError(
            "Nemotron-H checkpoint has neither backbone.embeddings.weight nor model.embeddings.weight"
        )
    out = {("embed",): embed, ("norm", "weight"): get(base + "norm_f.weight")}
    for i, kind in enumerate(cfg.layer_types):
        prefix = f"{base}layers.{i}."
        out[("layers", str(i), "norm", "weight")] = get(prefix + "norm.weight")
        if kind == "mamba":
            mixer = mixer_params_from_hf(cfg.mixer, get, prefix + "mixer.")
        elif kind == "attention":
            mixer = attention_params_from_hf(cfg.attention, get, prefix + "mixer")
        else:
            mixer = {
                ("up", "kernel"): get(prefix + "mixer.up_proj.weight").T,
                ("down", "kernel"): get(prefix + "mixer.down_proj.weight").T,
            }
            if cfg.mlp_bias:
                mixer[("up", "bias")] = get(prefix + "mixer.up_proj.bias")
                mixer[("down", "bias")] = get(prefix + "mixer.down_proj.bias")
        out.update(hybrid.prefixed(("layers", str(i), "mixer"), mixer))
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
