"""Mamba-1 and Falcon-Mamba: selective-SSM mixer layers over a per-slot recurrent state, layers scanned."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from memory import CacheSpec, MemoryPools, RecurrentSpec
from models.batch import ForwardBatch
from models.layers.causal_lm import CausalLM
from models.layers.mamba import MambaMixer, mixer_params_from_hf
from models.layers.mlp import ACTIVATIONS
from models.layers.norm import RMSNorm
from models.layers.stack import stacked_layer_stack
from models.recurrent import (
    LayerStates,
    scan_recurrent_layers,
)

_FALCON_ARCHITECTURES = ("FalconMambaForCausalLM",)
_BCDT_NORMS = (None, "weightless", "weighted")


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """Shape and numerics of a Mamba-1 language model (HF `MambaConfig` / `FalconMambaConfig`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # expand * hidden_size: the mixer's channel count Dn
    state_size: int  # N
    num_layers: int
    conv_kernel: int = 4
    time_step_rank: int = 8
    layer_norm_eps: float = 1e-5
    use_bias: bool = False  # bias on in_proj and out_proj
    use_conv_bias: bool = True
    hidden_act: str = "silu"  # after the conv; the z gate is always silu (as HF and mamba_ssm do)
    residual_in_fp32: bool = True
    # Falcon-Mamba normalizes dt (low rank), B and C with a weightless RMSNorm of this eps; None: plain Mamba.
    bcdt_rms_eps: float | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 1 << 20  # a recurrent model has no context limit
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "state_size", "num_layers",
                     "time_step_rank"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel={self.conv_kernel} must be >= 2")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act={self.hidden_act!r}; known: {', '.join(ACTIVATIONS)}")

    @property
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(
            num_kv_layers=0,
            recurrent=RecurrentSpec(
                self.num_layers, (self.intermediate_size, self.state_size),
                (self.intermediate_size, self.conv_kernel - 1),
            ),
        )

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, i, n, r, k = (self.hidden_size, self.intermediate_size, self.state_size, self.time_step_rank,
                         self.conv_kernel)
        mixer = (
            d * 2 * i + i * k + i * (r + 2 * n) + r * i + i + i * n + i + i * d
            + (2 * i + d if self.use_bias else 0) + (i if self.use_conv_bias else 0)
        )
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (mixer + d) + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MambaConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        hidden = int(hf["hidden_size"])
        rank = hf.get("time_step_rank", "auto")
        falcon = archs[0] in _FALCON_ARCHITECTURES or hf.get("model_type") == "falcon_mamba"
        eos = hf.get("eos_token_id")
        return cls(
            architecture=archs[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf.get("intermediate_size") or hf.get("expand", 2) * hidden),
            state_size=int(hf.get("state_size", 16)),
            num_layers=int(hf["num_hidden_layers"]),
            conv_kernel=int(hf.get("conv_kernel", 4)),
            time_step_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
            layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            use_bias=bool(hf.get("use_bias", False)),
            use_conv_bias=bool(hf.get("use_conv_bias", True)),
            hidden_act=hf.get("hidden_act", "silu"),
            residual_in_fp32=bool(hf.get("residual_in_fp32", True)),
            bcdt_rms_eps=float(hf.get("mixer_rms_eps", 1e-6)) if falcon else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )


config_from_hf = MambaConfig.from_hf


class MambaBlock(nnx.Module):
    """Pre-norm residual block around one mixer."""

    def __init__(self, cfg: MambaConfig, *, dtype):
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.mixer = MambaMixer(
            cfg.hidden_size, cfg.intermediate_size, cfg.state_size, conv_kernel=cfg.conv_kernel,
            time_step_rank=cfg.time_step_rank, use_bias=cfg.use_bias, use_conv_bias=cfg.use_conv_bias,
            hidden_act=cfg.hidden_act, bcdt_norm=None if cfg.bcdt_rms_eps is None else "weightless",
            bcdt_norm_eps=cfg.bcdt_rms_eps or 1e-6, dtype=dtype,
        )
        self.residual_in_fp32 = cfg.residual_in_fp32

    def __call__(self, x, batch: ForwardBatch, states: LayerStates) -> tuple[jax.Array, LayerStates]:
        dtype = self.norm.weight.dtype
        with jax.named_scope("mixer"):
            h, final = self.mixer(self.norm(x, dtype), batch, states)
        x = x + h
        # Without residual_in_fp32, HF keeps the residual stream in the model dtype: round it as HF does.
        return (x if self.residual_in_fp32 else x.astype(dtype).astype(jnp.float32)), final


class MambaForCausalLM(CausalLM):
    """Mamba-1 / Falcon-Mamba LM: layers stacked and run by one `lax.scan`; states written once after it."""

    def __init__(self, cfg: MambaConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.layer_norm_eps, dtype=dtype)
        self.layers = stacked_layer_stack(lambda: MambaBlock(cfg, dtype=dtype), cfg.num_layers)

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        x = self.embed_tokens(batch.input_ids)
        if not self.cfg.residual_in_fp32:
            x = x.astype(self.dtype).astype(jnp.float32)
        x, rec = scan_recurrent_layers(self.layers, self.cfg.num_layers, x, batch, pools.recurrent)
        return self.norm(x, self.dtype), pools._replace(recurrent=rec)


def params_from_hf(cfg: MambaConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF tensors (fetched by name with `get`) to our parameter paths, per-layer tensors stacked."""
    mixers = [
        mixer_params_from_hf(get, f"backbone.layers.{i}.mixer.", use_bias=cfg.use_bias,
                             use_conv_bias=cfg.use_conv_bias)
        for i in range(cfg.num_layers)
    ]
    out = {("layers", "mixer", *path): np.stack([m[path] for m in mixers]) for path in mixers[0]}
    out[("layers", "norm", "weight")] = np.stack([get(f"backbone.layers.{i}.norm.weight")
                                                  for i in range(cfg.num_layers)])
    try:
        out[("embed",)] = get("backbone.embeddings.weight")
    except KeyError:  # early Mamba checkpoints name it `embedding` (HF renames it in a load hook)
        out[("embed",)] = get("backbone.embedding.weight")
    out[("norm", "weight")] = get("backbone.norm_f.weight")
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
