"""DeepSeek-V3: MLA attention over a latent KV pool, dense first layers, then grouped sigmoid-routed
experts."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from memory import CacheSpec, KVPool, MemoryPools
from models.batch import ForwardBatch
from models.layers.causal_lm import CausalLM
from models.layers.decoder import DecoderLayer, decoder_layer_params
from models.layers.mla import MLAConfig, MLAttention, mla_params_from_hf
from models.layers.mlp import GatedMLP, gated_mlp_params_from_hf
from models.layers.moe import GroupedMoE, GroupedRouting, grouped_moe_from_hf
from models.layers.stack import scan_layers, stacked_layer_stack


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """Layers `< first_k_dense_replace` have a dense MLP (`intermediate_size`); the rest route each token to
    `num_experts_per_tok` of `num_experts` experts (`moe_intermediate_size` wide) chosen within the best
    `topk_group` of `n_group` groups, plus `n_shared_experts` always-on experts fused into one MLP."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    mla: MLAConfig
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(
                f"first_k_dense_replace={self.first_k_dense_replace} must be in [0, {self.num_layers}]"
            )
        self.routing  # validates the routing fields

    @property
    def routing(self) -> GroupedRouting:
        return GroupedRouting(
            self.num_experts,
            self.num_experts_per_tok,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )

    @property
    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace

    @property
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(self.num_layers, 1, self.mla.latent_dim, latent_kv=True)

    @property
    def num_params(self) -> int:
        d = self.hidden_size
        attn = self.mla.num_params(d) + 2 * d  # and the two layer norms
        dense = 3 * d * self.intermediate_size
        moe = (
            self.num_experts + self.n_shared_experts
        ) * 3 * d * self.moe_intermediate_size + self.num_experts * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * attn + self.num_dense_layers * dense + self.num_moe_layers * moe + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> DeepseekV3Config:
        topk_method = hf.get("topk_method", "noaux_tc")
        if topk_method != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"DeepseekV3: only sigmoid noaux_tc routing is supported, not {topk_method!r}")
        eos = hf.get("eos_token_id")
        return cls(
            architecture=hf["architectures"][0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            mla=MLAConfig.from_hf(hf),
            num_experts=int(hf.get("n_routed_experts") or hf["num_local_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            hidden_act=hf.get("hidden_act", "silu"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )


config_from_hf = DeepseekV3Config.from_hf


def decoder_layer(cfg: DeepseekV3Config, sparse: bool, *, dtype) -> DecoderLayer:
    d = cfg.hidden_size
    if sparse:
        mlp = GroupedMoE(d, cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                         cfg.routing, act=cfg.hidden_act, dtype=dtype)
    else:
        mlp = GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, bias=False, dtype=dtype)
    return DecoderLayer(d, cfg.rms_norm_eps, MLAttention(d, cfg.mla, dtype=dtype), mlp, dtype=dtype,
                        attn_scope="mla", mlp_scope="moe" if sparse else "mlp")


def _stack(cfg: DeepseekV3Config, sparse: bool, count: int, dtype):
    """`count` alike layers with parameters stacked on a leading axis (run by one `lax.scan`), or None."""
    if not count:
        return None
    return stacked_layer_stack(lambda: decoder_layer(cfg, sparse, dtype=dtype), count)


def _scan(layers: nnx.Module, first: int, count: int, x, batch: ForwardBatch, kv: KVPool):
    """Runs the `count` stacked layers whose first is layer `first` of the KV pool."""
    def step(layer, index, carry):
        x, kv = carry
        return layer(x, batch, kv, first + index)

    return scan_layers(layers, count, step, (x, kv))


class DeepseekV3ForCausalLM(CausalLM):
    """The dense layers and the MoE layers each form one stack scanned by `lax.scan` (two scans in all)."""

    def __init__(self, cfg: DeepseekV3Config, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        self.dense_layers = _stack(cfg, False, cfg.num_dense_layers, dtype)
        self.moe_layers = _stack(cfg, True, cfg.num_moe_layers, dtype)

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        kv = pools.kv
        x = self.embed_tokens(batch.input_ids)
        if self.dense_layers is not None:
            x, kv = _scan(self.dense_layers, 0, self.cfg.num_dense_layers, x, batch, kv)
        if self.moe_layers is not None:
            x, kv = _scan(self.moe_layers, self.cfg.num_dense_layers, self.cfg.num_moe_layers, x, batch, kv)
        return self.norm(x, self.dtype), pools._replace(kv=kv)


def _layer_from_hf(cfg: DeepseekV3Config, get, i: int) -> dict[tuple[str, ...], np.ndarray]:
    prefix = f"model.layers.{i}."
    if i < cfg.num_dense_layers:
        mlp = gated_mlp_params_from_hf(get, prefix + "mlp", bias=False)
    else:
        mlp = grouped_moe_from_hf(get, prefix + "mlp.", cfg.num_experts, bias_name="e_score_correction_bias",
                                  shared=cfg.n_shared_experts > 0)
    return decoder_layer_params(get, prefix, mla_params_from_hf(cfg.mla, get, prefix + "self_attn."), mlp)


def params_from_hf(cfg: DeepseekV3Config, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF tensors (fetched by name with `get`) to our parameter paths; layers stacked per kind."""
    layers = [_layer_from_hf(cfg, get, i) for i in range(cfg.num_layers)]
    out: dict[tuple[str, ...], np.ndarray] = {}
    for name, group in (
        ("dense_layers", layers[: cfg.num_dense_layers]),
        ("moe_layers", layers[cfg.num_dense_layers :]),
    ):
        if group:
            out.update({(name, *path): np.stack([layer[path] for layer in group]) for path in group[0]})
    out[("embed",)] = get("model.embed_tokens.weight")
    out[("norm", "weight")] = get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
