"""Sparse mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama attention, top-k experts."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from memory import MemoryPools
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.layers.attention import Attention, attention_params_from_hf
from models.layers.causal_lm import CausalLM
from models.layers.decoder import DecoderLayer, decoder_layer_params
from models.layers.mlp import GatedMLP, gated_mlp_params_from_hf
from models.layers.moe import TopKMoE, experts_from_hf
from models.layers.stack import scan_layers, stacked_layer_stack


@dataclasses.dataclass(frozen=True)
class MoeConfig(ModelConfig):
    """A Llama-family decoder whose MLPs are sparse mixtures of experts, except in dense layers.

    `intermediate_size` is the width of the dense MLP of layers where `sparse_layers[i]` is False
    (Qwen's `mlp_only_layers` / `decoder_sparse_step`); each expert is `moe_intermediate_size` wide.
    """

    num_experts: int = 1
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 1
    norm_topk_prob: bool = True  # renormalise the chosen experts' softmax weights to sum to one
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none), sigmoid-gated
    sparse_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or the dense gated MLP (False)

    def __post_init__(self):
        super().__post_init__()
        if len(self.sparse_layers) != self.num_layers:
            raise ValueError(
                f"sparse_layers={self.sparse_layers} needs one entry per layer ({self.num_layers})"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts=}]"
            )
        if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"bad expert widths: moe_intermediate_size={self.moe_intermediate_size}, "
                f"shared_expert_intermediate_size={self.shared_expert_intermediate_size}"
            )

    @property
    def layers_alike(self) -> bool:
        """All layers have the same parameter shapes, so they can be stacked and scanned."""
        return len(set(self.sparse_layers)) == 1

    @property
    def num_params(self) -> int:
        d = self.hidden_size
        sparse = self.num_experts * (3 * d * self.moe_intermediate_size + d)  # experts and router rows
        if self.shared_expert_intermediate_size:
            sparse += 3 * d * self.shared_expert_intermediate_size + d
        return super().num_params + sum(self.sparse_layers) * (sparse - 3 * d * self.intermediate_size)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MoeConfig:
        base = ModelConfig.from_hf(hf)
        arch, num_layers = base.architecture, base.num_layers
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig)}
        if arch == "MixtralForCausalLM":
            window = hf.get("sliding_window")
            moe = dict(
                num_experts=int(hf["num_local_experts"]),
                moe_intermediate_size=base.intermediate_size,
                norm_topk_prob=True,
                sparse_layers=(True,) * num_layers,
            )
            fields.update(attention_bias=False, o_bias=False, qk_norm=False)
        elif arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
            # transformers 5 writes Qwen3-MoE's expert count as `num_local_experts` (an attribute_map alias).
            num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
            mlp_only, step = set(hf.get("mlp_only_layers") or ()), int(hf.get("decoder_sparse_step", 1))
            moe = dict(
                num_experts=num_experts,
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                sparse_layers=tuple(
                    i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
                ),
            )
            window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
            if arch == "Qwen2MoeForCausalLM":
                moe["shared_expert_intermediate_size"] = int(hf.get("shared_expert_intermediate_size") or 0)
                layer_types = hf.get("layer_types")
                if layer_types and "sliding_attention" not in layer_types:
                    window = None
                fields.update(attention_bias=bool(hf.get("qkv_bias", True)), o_bias=False, qk_norm=False)
            else:
                bias = bool(hf.get("attention_bias", False))  # on q, k, v and o alike
                fields.update(attention_bias=bias, o_bias=bias, qk_norm=True)
        else:
            raise ValueError(f"models.moe does not implement {arch!r}")
        if window and window < base.max_position_embeddings:
            raise ValueError(
                f"{arch}: sliding_window={window} < max_position_embeddings={base.max_position_embeddings} "
                "is not supported: paged attention always attends to the whole context"
            )
        return cls(**fields, num_experts_per_tok=int(hf["num_experts_per_tok"]), **moe)


config_from_hf = MoeConfig.from_hf


def decoder_layer(cfg: MoeConfig, sparse: bool, *, dtype) -> DecoderLayer:
    d = cfg.hidden_size
    if sparse:
        mlp = TopKMoE(d, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                      normalize_topk=cfg.norm_topk_prob, act=cfg.hidden_act,
                      shared_intermediate=cfg.shared_expert_intermediate_size, dtype=dtype)
    else:
        mlp = GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, bias=False, dtype=dtype)
    return DecoderLayer(d, cfg.rms_norm_eps, Attention(d, cfg.attention, dtype=dtype), mlp, dtype=dtype,
                        mlp_scope="moe" if sparse else "mlp")


class MoeForCausalLM(CausalLM):
    """Decoder of MoE layers; stacked and run by one `lax.scan` when all layers are alike (as in llama.py).

    With dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`) the parameter
    shapes differ between layers, so the layers are kept apart and run by a Python loop.
    """

    def __init__(self, cfg: MoeConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        if cfg.layers_alike:
            self.layers = stacked_layer_stack(lambda: decoder_layer(cfg, cfg.sparse_layers[0], dtype=dtype),
                                              cfg.num_layers)
        else:
            self.layers = nnx.Dict(
                {
                    str(i): decoder_layer(cfg, sparse, dtype=dtype)
                    for i, sparse in enumerate(cfg.sparse_layers)
                }
            )

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        kv = pools.kv
        x = self.embed_tokens(batch.input_ids)
        if self.cfg.layers_alike:
            def step(layer, index, carry):
                x, kv = carry
                return layer(x, batch, kv, index)

            x, kv = scan_layers(self.layers, self.cfg.num_layers, step, (x, kv))
        else:
            for i in range(self.cfg.num_layers):
                x, kv = self.layers[str(i)](x, batch, kv, i)
        return self.norm(x, self.dtype), pools._replace(kv=kv)


def _moe_from_hf(cfg: MoeConfig, get, prefix: str) -> dict[tuple[str, ...], np.ndarray]:
    shared = cfg.shared_expert_intermediate_size > 0
    return topk_moe_params_from_hf(get, prefix, cfg.num_experts, shared=shared)


def topk_moe_params_from_hf(get, prefix: str, num_experts: int, *,
                            shared: bool) -> dict[tuple[str, ...], np.ndarray]:
    """One layer's `TopKMoE`: the router and experts (either on-disk layout, layers/moe.py:`experts_from_hf`)
    under Qwen's and transformers 5's `mlp`, or Mixtral's hub layout `block_sparse_moe` (experts' w1, w3,
    w2); with `shared`, Qwen2-MoE's (and Qwen3-Next's) shared expert and its gate."""
    try:
        router = get(prefix + "mlp.gate.weight")
        block, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    except KeyError:
        block, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
        router = get(block + "gate.weight")
    out = {("router", "kernel"): router.T, **experts_from_hf(get, block, num_experts, names=names)}
    if shared:
        shared = gated_mlp_params_from_hf(get, prefix + "mlp.shared_expert", bias=False)
        out.update({("shared_expert", *path): value for path, value in shared.items()})
        out[("shared_expert_gate", "kernel")] = get(prefix + "mlp.shared_expert_gate.weight").T
    return out


def _layer_from_hf(cfg: MoeConfig, get, i: int) -> dict[tuple[str, ...], np.ndarray]:
    prefix = f"model.layers.{i}."
    if cfg.sparse_layers[i]:
        mlp = _moe_from_hf(cfg, get, prefix)
    else:
        mlp = gated_mlp_params_from_hf(get, prefix + "mlp", bias=False)
    attn = attention_params_from_hf(cfg.attention, get, prefix + "self_attn")
    return decoder_layer_params(get, prefix, attn, mlp)


def params_from_hf(cfg: MoeConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF tensors (fetched by name with `get`) to our parameter paths.

    HF linear weights are [out, in]; ours are [in, out], q/k/v and gate/up concatenated on `out`, experts
    stacked on a leading expert axis, and layers stacked on a leading layer axis when they are alike
    (else kept per layer under their index).
    """
    layers = [_layer_from_hf(cfg, get, i) for i in range(cfg.num_layers)]
    if cfg.layers_alike:
        out = {("layers", *path): np.stack([layer[path] for layer in layers]) for path in layers[0]}
    else:
        out = {
            ("layers", str(i), *path): value
            for i, layer in enumerate(layers)
            for path, value in layer.items()
        }
    out[("embed",)] = get("model.embed_tokens.weight")
    out[("norm", "weight")] = get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
