"""Qwen3-Next and the Qwen3.5 text models: Gated DeltaNet linear-attention layers mixed with gated softmax
attention, MoE with a shared expert (dense MLPs where `mlp_only_layers` / `decoder_sparse_step` say so, and
everywhere in dense Qwen3.5).

Qwen3.5 differs in its checkpoints only: separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a where
Qwen3-Next fuses them per key head, and its image-text checkpoints (`...ForConditionalGeneration`) nest the
text model's config under `text_config` and its weights under `model.language_model.`: served as text-only
models, the vision tower's weights are not read. Its multimodal RoPE (mrope) gives text tokens the same
position on all three axes, which is plain RoPE.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from memory import CacheSpec, MemoryPools
from models import hybrid
from models.batch import ForwardBatch
from models.config import AttentionConfig
from models.layers.attention import Attention, attention_params_from_hf
from models.layers.causal_lm import CausalLM
from models.layers.delta_net import DeltaNetConfig, GatedDeltaNet, delta_net_params_from_hf
from models.layers.mlp import GatedMLP, gated_mlp_params_from_hf
from models.layers.moe import TopKMoE
from models.layers.norm import RMSNorm
from models.moe import topk_moe_params_from_hf

LINEAR, FULL = hybrid.LINEAR, hybrid.FULL
# The native kernels that update a Gated DeltaNet layer's states in place in decode-only steps.
IN_PLACE = ("gated_delta_decode_update", "conv1d_decode_update")


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (Gated DeltaNet) | "full_attention"
    attention: AttentionConfig  # gated, q/k-normed, partial RoPE
    delta_net: DeltaNetConfig
    sparse_layers: tuple[bool, ...]  # per layer: MoE (else a dense gated MLP of `intermediate_size`)
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        hybrid.check_linear_full_layers(self.layer_types, self.sparse_layers)
        if any(self.sparse_layers) and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"[1, {self.num_experts}]")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def cache_spec(self) -> CacheSpec:
        return hybrid.cache_spec(self.layer_types, self.attention, self.delta_net.ssm_shape,
                                 self.delta_net.conv_shape, attention_kind=FULL, recurrent_kind=LINEAR,
                                 split_heads=True)

    @property
    def num_params(self) -> int:
        d = self.hidden_size
        mixers = {LINEAR: self.delta_net.num_params, FULL: self.attention.num_params(d)}
        moe = (self.num_experts * (3 * d * self.moe_intermediate_size + d)
               + 3 * d * self.shared_expert_intermediate_size + d)
        return hybrid.decoder_params(d, self.vocab_size, self.tie_word_embeddings, self.layer_types,
                                     self.sparse_layers, mixers, moe, 3 * d * self.intermediate_size)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen3NextConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        if isinstance(hf.get("text_config"), dict):  # an image-text checkpoint: its text model
            text = hf["text_config"]
            hf = {**text, "architectures": archs,
                  "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings"))}
        num_layers = int(hf["num_hidden_layers"])
        interval = int(hf.get("full_attention_interval", 4))
        layer_types = tuple(hf.get("layer_types")
                            or (FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)))
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        eps = float(hf.get("rms_norm_eps", 1e-6))
        attention = dataclasses.replace(
            AttentionConfig.from_hf(hf, qkv_bias=bool(hf.get("attention_bias", False)),
                                    o_bias=bool(hf.get("attention_bias", False)), rope=True),
            qk_norm=True, norm_eps=eps, output_gate=True)
        delta = DeltaNetConfig(
            hidden_size=int(hf["hidden_size"]), num_k_heads=int(hf["linear_num_key_heads"]),
            num_v_heads=int(hf["linear_num_value_heads"]), k_head_dim=int(hf["linear_key_head_dim"]),
            v_head_dim=int(hf["linear_value_head_dim"]), conv_kernel=int(hf.get("linear_conv_kernel_dim", 4)),
            norm_eps=eps)
        num_experts = int(hf.get("num_experts") or 0)
        step, dense_only = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or ())
        sparse = tuple(num_experts > 0 and i not in dense_only and (i + 1) % step == 0
                       for i in range(num_layers))
        eos = hf.get("eos_token_id")
        return cls(
            architecture=archs[0], vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            layer_types=layer_types, attention=attention, delta_net=delta, sparse_layers=sparse,
            intermediate_size=int(hf.get("intermediate_size") or 0), num_experts=num_experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 1),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)), hidden_act=hf.get("hidden_act", "silu"),
            rms_norm_eps=eps, max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )


config_from_hf = Qwen3NextConfig.from_hf


class Qwen3NextLayer(hybrid.PreNormLayer):
    """x = x + mixer(norm(x)); x = x + mlp(norm(x))."""

    def __init__(self, cfg: Qwen3NextConfig, kind: str, sparse: bool, *, dtype):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.recurrent = kind == LINEAR
        self.input_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.attn = GatedDeltaNet(cfg.delta_net, dtype=dtype) if kind == LINEAR else Attention(
            d, cfg.attention, dtype=dtype)
        self.post_attn_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = (TopKMoE(d, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                            normalize_topk=cfg.norm_topk_prob, act=cfg.hidden_act,
                            shared_intermediate=cfg.shared_expert_intermediate_size, dtype=dtype)
                    if sparse
                    else GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, bias=False, dtype=dtype))


class Qwen3NextForCausalLM(CausalLM):
    """Layers of two kinds run in a Python loop (models/hybrid.py); layer i's parameters live under
    `layers/<i>`."""

    def __init__(self, cfg: Qwen3NextConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.Dict({str(i): Qwen3NextLayer(cfg, kind, sparse, dtype=dtype)
                                for i, (kind, sparse) in enumerate(zip(cfg.layer_types, cfg.sparse_layers))})

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        return hybrid.run_model(self, batch, pools, LINEAR, IN_PLACE)


def _centered(get):
    """`get` with Qwen3-Next's zero-centred RMSNorm weights (applied as 1 + w) turned into plain ones."""
    def wrapped(name: str):
        w = get(name)
        return w + np.asarray(1, w.dtype) if name.endswith("norm.weight") and "linear_attn" not in name else w
    return wrapped


def _gated_attention_from_hf(cfg: Qwen3NextConfig, get, prefix: str) -> dict[tuple[str, ...], np.ndarray]:
    """HF's q_proj rows hold, per head, the query and then its output gate: split them."""
    a = cfg.attention
    q_and_gate = get(prefix + ".q_proj.weight").reshape(a.num_heads, 2, a.head_dim, -1)

    def split_get(name: str):
        return q_and_gate[:, 0].reshape(a.num_heads * a.head_dim, -1) if name == prefix + ".q_proj.weight" \
            else get(name)

    out = attention_params_from_hf(a, split_get, prefix)
    out[("gate", "kernel")] = q_and_gate[:, 1].reshape(a.num_heads * a.head_dim, -1).T
    return out


def _text_model(cfg: Qwen3NextConfig, get):
    """`get` for an image-text checkpoint's text model, whose weights live under `model.language_model.`."""
    if not cfg.architecture.endswith("ForConditionalGeneration"):
        return get
    return lambda name: get(name.replace("model.", "model.language_model.", 1) if name.startswith("model.")
                            else name)


def params_from_hf(cfg: Qwen3NextConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    get = _centered(_text_model(cfg, get))
    out = {("embed",): get("model.embed_tokens.weight"), ("norm", "weight"): get("model.norm.weight")}
    for i, (kind, sparse) in enumerate(zip(cfg.layer_types, cfg.sparse_layers)):
        prefix, ours = f"model.layers.{i}.", ("layers", str(i))
        out[(*ours, "input_norm", "weight")] = get(prefix + "input_layernorm.weight")
        out[(*ours, "post_attn_norm", "weight")] = get(prefix + "post_attention_layernorm.weight")
        if kind == LINEAR:
            mixer = delta_net_params_from_hf(cfg.delta_net, get, prefix + "linear_attn.")
        else:
            mixer = _gated_attention_from_hf(cfg, get, prefix + "self_attn")
        out.update(hybrid.prefixed((*ours, "attn"), mixer))
        shared = cfg.shared_expert_intermediate_size > 0
        mlp = (topk_moe_params_from_hf(get, prefix, cfg.num_experts, shared=shared)
               if sparse else gated_mlp_params_from_hf(get, prefix + "mlp", bias=False))
        out.update(hybrid.prefixed((*ours, "mlp"), mlp))
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
