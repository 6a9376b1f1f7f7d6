"""Frozen model configuration for decoder-only transformers, built from a Hugging Face config dict."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from memory import CacheSpec


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def eos_ids_from_hf(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (https://arxiv.org/abs/2309.00071), as HF's `_compute_yarn_parameters`
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    yarn_attention_factor: float | None = None  # HF `attention_factor`; None: derived from factor and mscales
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ("default", "llama3", "linear", "yarn"):
            raise ValueError(
                f"unsupported rope_type={self.rope_type!r}; known: default, llama3, linear, yarn"
            )
        if self.theta <= 0:
            raise ValueError(f"rope theta={self.theta} must be positive")

    @property
    def attention_scaling(self) -> float:
        """Factor on cos and sin (YaRN's magnitude correction; 1 for the other types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.yarn_attention_factor is not None:
            return self.yarn_attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, rotary_dim: int) -> np.ndarray:
        """Inverse frequencies f32[rotary_dim // 2], as HF computes them (float32 arithmetic)."""
        exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim
        inv = (1.0 / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.rope_type == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.rope_type == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(rotary_dim, inv)
        return inv

    def _yarn_inv_freq(self, rotary_dim: int, extrapolation: np.ndarray) -> np.ndarray:
        """Blends interpolated (divided by `factor`) and original frequencies over a linear ramp of dims."""
        def correction_dim(rotations: float) -> float:
            ctx = self.original_max_position_embeddings
            return rotary_dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        dims = np.arange(rotary_dim // 2, dtype=np.float32)
        ramp = np.clip((dims - low) / (high - low), 0, 1).astype(np.float32)
        keep = (1 - ramp).astype(np.float32)  # share of the original (extrapolated) frequency
        exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / rotary_dim
        pos_freqs = np.float32(self.theta) ** exponents
        interpolation = (1.0 / (np.float32(self.factor) * pos_freqs)).astype(np.float32)
        return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        kwargs: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
        if rope_type in ("llama3", "linear"):
            kwargs["factor"] = float(params["factor"])
        if rope_type == "yarn":
            kwargs["factor"] = float(params["factor"])
            kwargs["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
            for ours, theirs in (("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"), ("mscale", "mscale"),
                                 ("mscale_all_dim", "mscale_all_dim")):
                if params.get(theirs):
                    kwargs[ours] = float(params[theirs])
            if params.get("attention_factor") is not None:
                kwargs["yarn_attention_factor"] = float(params["attention_factor"])
            kwargs["truncate"] = bool(params.get("truncate", True))
        if rope_type == "llama3":
            kwargs["low_freq_factor"] = float(params["low_freq_factor"])
            kwargs["high_freq_factor"] = float(params["high_freq_factor"])
            kwargs["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Shape of a grouped-query attention block (models/layers/attention.py); `rope=None` means no positional
    encoding (Nemotron-H)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    rope: RopeConfig | None = None
    rotary_dim: int = 0  # leading channels of each head that rotate (Bamba rotates half of them)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    norm_eps: float = 1e-6  # the q/k norms' epsilon
    output_gate: bool = False  # the output is gated by sigmoid(gate(x)) before o (Qwen3-Next)

    def __post_init__(self):
        if min(self.num_heads, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(
                f"bad attention shape: {self.num_heads=}, {self.num_kv_heads=}, {self.head_dim=}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(
                f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]"
            )

    def num_params(self, hidden: int) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (
            2 * hidden * q
            + 2 * hidden * kv
            + (q + 2 * kv if self.qkv_bias else 0)
            + (hidden if self.o_bias else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
            + (hidden * q if self.output_gate else 0)
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, qkv_bias: bool, o_bias: bool, rope: bool) -> AttentionConfig:
        """Heads from the usual HF keys; with `rope`, the rotary fraction from `partial_rotary_factor`."""
        num_heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
        rope_cfg, rotary_dim = None, 0
        if rope:
            rope_cfg = RopeConfig.from_hf(hf)
            params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
            factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
            rotary_dim = int(head_dim * float(factor))
        return cls(
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            rope=rope_cfg,
            rotary_dim=rotary_dim,
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Qwen2, Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # bias on o_proj too (Llama's and Qwen3's attention_bias; not Qwen2's qkv bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.hidden_act not in ("silu", "gelu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden_act={self.hidden_act!r}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            qkv_bias=self.attention_bias, o_bias=self.o_bias, rope=self.rope, rotary_dim=self.head_dim,
            qk_norm=self.qk_norm, norm_eps=self.rms_norm_eps,
        )

    @property
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, h, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * h * 2 + d * kv * 2 + (h + 2 * kv if self.attention_bias else 0) + (d if self.o_bias else 0)
        mlp = 3 * d * self.intermediate_size
        layer = attn + mlp + 2 * d + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        model_type = hf.get("model_type", "")
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        return cls(
            architecture=archs[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(hf.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3",),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids_from_hf(hf),
        )
