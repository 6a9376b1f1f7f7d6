"""Falcon-H1: attention and Mamba-2 side by side in every layer, then a gated MLP; muP multipliers."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from memory import CacheSpec, KVPool, MemoryPools, RecurrentSpec
from models import hybrid
from models.batch import ForwardBatch
from models.config import AttentionConfig, eos_ids_from_hf
from models.layers.attention import Attention, attention_params_from_hf
from models.layers.causal_lm import CausalLM
from models.layers.linear import lm_logits
from models.layers.mamba2 import Mamba2Mixer, Mamba2MixerConfig, mixer_params_from_hf, parse_time_step_limit
from models.layers.mlp import GatedMLP, gated_mlp_params_from_hf
from models.layers.norm import RMSNorm
from models.recurrent import LayerStates, read_layer_states, state_rows, write_layer_states


@dataclasses.dataclass(frozen=True)
class FalconH1Multipliers:
    """Falcon-H1's muP scalars (HF config names). All but the embedding and LM-head ones fold into weights."""

    embedding: float = 1.0  # embedding rows, before the first layer (not the tied LM head)
    lm_head: float = 1.0  # logits
    attention_in: float = 1.0  # the attention block's (normed) input
    attention_out: float = 1.0  # the attention block's output
    key: float = 1.0  # k_proj's output
    ssm_in: float = 1.0  # the Mamba block's (normed) input
    ssm_out: float = 1.0  # the Mamba block's output
    ssm: tuple[float, ...] = (1.0,) * 5  # in_proj output segments z, x, B, C, dt
    mlp: tuple[float, float] = (1.0, 1.0)  # gate_proj's output, the MLP's output

    def __post_init__(self):
        if len(self.ssm) != 5 or len(self.mlp) != 2:
            raise ValueError(
                f"ssm_multipliers={self.ssm} needs 5 values and mlp_multipliers={self.mlp} needs 2"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> FalconH1Multipliers:
        def scalar(name: str) -> float:
            value = hf.get(name)
            return 1.0 if value is None else float(value)

        return cls(
            embedding=scalar("embedding_multiplier"),
            lm_head=scalar("lm_head_multiplier"),
            attention_in=scalar("attention_in_multiplier"),
            attention_out=scalar("attention_out_multiplier"),
            key=scalar("key_multiplier"),
            ssm_in=scalar("ssm_in_multiplier"),
            ssm_out=scalar("ssm_out_multiplier"),
            ssm=tuple(float(m) for m in hf.get("ssm_multipliers") or (1.0,) * 5),
            mlp=tuple(float(m) for m in hf.get("mlp_multipliers") or (1.0, 1.0)),
        )


@dataclasses.dataclass(frozen=True)
class FalconH1Config:
    """Shape of a Falcon-H1 model: every layer has one attention block, one Mamba-2 mixer and one MLP."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    attention: AttentionConfig
    mixer: Mamba2MixerConfig
    intermediate_size: int
    multipliers: FalconH1Multipliers = FalconH1Multipliers()
    hidden_act: str = "silu"
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.mixer.hidden_size != self.hidden_size:
            raise ValueError(f"mixer hidden_size={self.mixer.hidden_size} != hidden_size={self.hidden_size}")

    @property
    def cache_spec(self) -> CacheSpec:
        recurrent = RecurrentSpec(self.num_layers, self.mixer.ssm_shape, self.mixer.conv_shape)
        return CacheSpec(self.num_layers, self.attention.num_kv_heads, self.attention.head_dim, recurrent)

    @property
    def num_params(self) -> int:
        d, i = self.hidden_size, self.intermediate_size
        mlp = 3 * d * i + (2 * i + d) * self.mlp_bias
        layer = 2 * d + self.attention.num_params(d) + self.mixer.num_params + mlp
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> FalconH1Config:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        if hf.get("hidden_act", "silu") != "silu":  # also the activation after the mixer's conv
            raise ValueError(f"unsupported Falcon-H1 hidden_act={hf['hidden_act']!r}; only silu")
        hidden = int(hf["hidden_size"])
        d_ssm = hf.get("mamba_d_ssm")
        d_ssm = int(hf.get("mamba_expand", 2)) * hidden if d_ssm is None else int(d_ssm)
        num_heads = int(hf.get("mamba_n_heads", 128))
        head_dim = hf.get("mamba_d_head", "auto")
        head_dim = d_ssm // num_heads if head_dim == "auto" else int(head_dim)
        if num_heads * head_dim != d_ssm:
            raise ValueError(
                f"mamba_n_heads * mamba_d_head = {num_heads * head_dim} must equal the mixer width "
                f"(mamba_d_ssm or mamba_expand * hidden_size) = {d_ssm}"
            )
        eps, n_groups = float(hf.get("rms_norm_eps", 1e-5)), int(hf.get("mamba_n_groups", 1))
        mixer = Mamba2MixerConfig(
            hidden_size=hidden,
            num_heads=num_heads,
            head_dim=head_dim,
            n_groups=n_groups,
            state_size=int(hf.get("mamba_d_state", 256)),
            conv_kernel=int(hf.get("mamba_d_conv", 4)),
            norm_groups=n_groups,
            norm_eps=eps,
            use_conv_bias=bool(hf.get("mamba_conv_bias", True)),
            in_proj_bias=bool(hf.get("mamba_proj_bias", False)),
            out_proj_bias=bool(hf.get("projectors_bias", False)),  # HF's out_proj takes projectors_bias
            time_step_limit=parse_time_step_limit(hf.get("time_step_limit")),
            gated_norm=bool(hf.get("mamba_rms_norm", False)),
            norm_before_gate=bool(hf.get("mamba_norm_before_gate", True)),
        )
        bias = bool(hf.get("attention_bias", False))
        # HF's Falcon-H1 RoPE turns the whole head whatever partial_rotary_factor says.
        rope_params = {
            **(hf.get("rope_parameters") or hf.get("rope_scaling") or {}),
            "partial_rotary_factor": 1.0,
        }
        attention = AttentionConfig.from_hf(
            {**hf, "rope_parameters": rope_params}, qkv_bias=bias, o_bias=bias, rope=True
        )
        return cls(
            architecture=archs[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            attention=attention,
            mixer=mixer,
            intermediate_size=int(hf["intermediate_size"]),
            multipliers=FalconH1Multipliers.from_hf(hf),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            rms_norm_eps=eps,
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids_from_hf(hf),
        )


config_from_hf = FalconH1Config.from_hf


class FalconH1Layer(nnx.Module):
    """x + mamba(norm(x)) + attention(norm(x)), then x + mlp(norm(x)); multipliers are in the weights."""

    def __init__(self, cfg: FalconH1Config, *, dtype):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mamba = Mamba2Mixer(cfg.mixer, dtype=dtype)
        self.attn = Attention(d, cfg.attention, dtype=dtype)
        self.pre_ff_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, bias=cfg.mlp_bias, dtype=dtype)

    def __call__(
        self, x, batch: ForwardBatch, kv: KVPool, states: LayerStates, index: int
    ) -> tuple[jax.Array, KVPool, LayerStates]:
        """Mixes from the layer's initial `states` (returns its final ones); writes KV pool layer `index`."""
        h = self.input_norm(x)
        with jax.named_scope("mamba"):
            m, states = self.mamba(h, batch, states)
        with jax.named_scope("attention"):
            a, kv = self.attn(h, batch, kv, index)
        x = x + (m + a)
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.pre_ff_norm(x))
        return x, kv, states


class FalconH1ForCausalLM(CausalLM):
    """Identical layers in a Python loop; layer i lives under `layers/<i>` and owns layer i of both pools.

    Layers read their recurrent states from the step's input pool; all are written back after the loop.
    """

    def __init__(self, cfg: FalconH1Config, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.Dict({str(i): FalconH1Layer(cfg, dtype=dtype) for i in range(cfg.num_layers)})

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        # The embedding multiplier stays at run time: a tied LM head reads the unscaled rows.
        x = self.embed_tokens(batch.input_ids) * self.cfg.multipliers.embedding
        kv, rec, rows = pools.kv, pools.recurrent, state_rows(batch)
        for i in range(self.cfg.num_layers):
            x, kv, states = self.layers[str(i)](x, batch, kv, read_layer_states(rec, i, rows), i)
            rec = write_layer_states(rec, i, rows, states)
        return self.norm(x, self.dtype), pools._replace(kv=kv, recurrent=rec)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """f32[N, vocab] logits for hidden rows f[N, hidden], times lm_head_multiplier."""
        return lm_logits(hidden, self.embed_weight(), self.lm_head_weight(), self.cfg.multipliers.lm_head)


def params_from_hf(cfg: FalconH1Config, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF FalconH1ForCausalLM tensors to our parameter paths, folding the muP multipliers into weights.

    Each multiplier scales a linear map's input or output, so it folds exactly into that kernel (and, for
    outputs, its bias): no per-token multiplies at run time, and the layer code stays Falcon-agnostic.
    """
    mult, mc = cfg.multipliers, cfg.mixer
    i, gn = mc.intermediate_size, mc.n_groups * mc.state_size
    # HF's mup_vector: one multiplier per in_proj output segment z | x | B | C | dt.
    mup = np.concatenate([np.full(n, m, np.float32) for n, m in zip((i, i, gn, gn, mc.num_heads), mult.ssm)])
    out = {
        ("embed",): get("model.embed_tokens.weight"),
        ("norm", "weight"): get("model.final_layernorm.weight"),
    }
    for layer in range(cfg.num_layers):
        prefix, ours = f"model.layers.{layer}.", ("layers", str(layer))
        out[(*ours, "input_norm", "weight")] = get(prefix + "input_layernorm.weight")
        out[(*ours, "pre_ff_norm", "weight")] = get(prefix + "pre_ff_layernorm.weight")
        mamba = mixer_params_from_hf(mc, get, prefix + "mamba.")
        mamba[("in_proj", "kernel")] = mamba[("in_proj", "kernel")] * (mult.ssm_in * mup)
        if mc.in_proj_bias:
            mamba[("in_proj", "bias")] = mamba[("in_proj", "bias")] * mup
        mamba[("out_proj", "kernel")] = mamba[("out_proj", "kernel")] * mult.ssm_out
        if mc.out_proj_bias:
            mamba[("out_proj", "bias")] = mamba[("out_proj", "bias")] * mult.ssm_out
        out.update(hybrid.prefixed((*ours, "mamba"), mamba))
        attn = attention_params_from_hf(
            cfg.attention,
            get,
            prefix + "self_attn",
            in_scale=mult.attention_in,
            k_scale=mult.key,
            out_scale=mult.attention_out,
        )
        out.update(hybrid.prefixed((*ours, "attn"), attn))
        mlp = gated_mlp_params_from_hf(
            get, prefix + "feed_forward", bias=cfg.mlp_bias, gate_scale=mult.mlp[0], down_scale=mult.mlp[1]
        )
        out.update(hybrid.prefixed((*ours, "mlp"), mlp))
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
