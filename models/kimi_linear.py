"""Kimi-Linear and Ling 3 (`bailing_hybrid`): Kimi Delta Attention (KDA: the gated delta rule with a decay
per key channel) mixed with MLA layers, and DeepSeek-style grouped sigmoid-routed experts with shared experts
(dense MLPs in the first layers).

Kimi-Linear's MLA has no positional encoding and its KDA gates are low-rank (f_a/f_b, g_a/g_b). Ling 3's MLA
rotates its rope part (interleaved pairs) and gates each head's output (sigmoid(g(x))); its KDA gates are
one projection each, and its forget gate may be the bounded one (`kda_safe_gate`: lower_bound *
sigmoid(exp(A_log) (f(x) + dt_bias)) instead of -exp(A_log) softplus(f(x) + dt_bias)). Ling 3's
multi-token-prediction layers are not read (no MTP drafting).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.conv1d import causal_conv1d_prefill
from kernels.delta_rule import kda_decode_rows, kda_decode_update, kda_prefill
from memory import CacheSpec, MemoryPools, RecurrentSpec
from models import hybrid
from models.batch import ForwardBatch, by_section
from models.fused import grouped_rows
from models.layers.causal_lm import CausalLM
from models.layers.delta_net import DeltaRuleMixer, _l2norm
from models.layers.linear import Linear
from models.layers.mla import MLAConfig, MLAttention, mla_params_from_hf
from models.layers.mlp import GatedMLP, gated_mlp_params_from_hf
from models.layers.moe import GroupedMoE, GroupedRouting, grouped_moe_from_hf
from models.layers.norm import RMSNorm
from models.recurrent import LayerStates, split_rows, state_rows

LINEAR, FULL = hybrid.LINEAR, hybrid.FULL
# The native kernels that update a KDA layer's states in place in decode-only steps.
IN_PLACE = ("kda_decode_update", "conv1d_decode_update")


def _first(hf: dict[str, Any], *names: str, default=None):
    """The first of `names` the config has (transformers saves some Kimi keys under aliases)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    return default


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (KDA) | "full_attention" (MLA)
    sparse_layers: tuple[bool, ...]  # per layer: MoE, else a dense gated MLP of `intermediate_size`
    mla: MLAConfig
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel: int
    intermediate_size: int
    moe_intermediate_size: int
    n_shared_experts: int
    routing: GroupedRouting | None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    low_rank_gates: bool = True  # KDA's forget and output gates: f_a/f_b, g_a/g_b (Kimi) or f, g (Ling 3)
    gate_lower_bound: float | None = None  # the bounded forget gate (Ling 3's kda_safe_gate); None: softplus
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        hybrid.check_linear_full_layers(self.layer_types, self.sparse_layers)
        if any(self.sparse_layers) and self.routing is None:
            raise ValueError("sparse layers need num_experts > 0")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def kda_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def cache_spec(self) -> CacheSpec:
        h, d = self.linear_num_heads, self.linear_head_dim
        num_linear, num_full = self.layer_types.count(LINEAR), self.layer_types.count(FULL)
        recurrent = (RecurrentSpec(num_linear, (h, d, d), (3 * self.kda_dim, self.linear_conv_kernel - 1),
                                   split_heads=True) if num_linear else None)
        return CacheSpec(num_full, 1 if num_full else 0, self.mla.latent_dim if num_full else 0, recurrent,
                         latent_kv=num_full > 0)

    @property
    def num_params(self) -> int:
        d, h, hd, q = self.hidden_size, self.linear_num_heads, self.linear_head_dim, self.kda_dim
        kda = (3 * d * q + 3 * q * self.linear_conv_kernel + d * hd + hd * q + q + h + d * h + d * hd + hd * q
               + hd + q * d)
        mixers = {LINEAR: kda, FULL: self.mla.num_params(d)}
        moe = 0
        if self.routing is not None:
            e, f = self.routing.num_experts, self.moe_intermediate_size
            moe = e * 3 * d * f + d * e + e + 3 * d * f * self.n_shared_experts
        return hybrid.decoder_params(d, self.vocab_size, self.tie_word_embeddings, self.layer_types,
                                     self.sparse_layers, mixers, moe, 3 * d * self.intermediate_size)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> KimiLinearConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        num_layers = int(hf["num_hidden_layers"])
        linear = hf.get("linear_attn_config") or {}
        ling = hf.get("model_type") == "bailing_hybrid" or archs[0] == "BailingHybridForCausalLM"
        layer_types = hf.get("layer_types")
        if not layer_types and ling:  # the last layer of each group is MLA
            group = int(hf.get("layer_group_size", 6))
            layer_types = [FULL if (i + 1) % group == 0 else LINEAR for i in range(num_layers)]
        if not layer_types and "kda_layers" in linear:  # the hub's 1-indexed layer lists
            full = set(linear.get("full_attn_layers") or ())
            layer_types = [FULL if i + 1 in full else LINEAR for i in range(num_layers)]
        layer_types = tuple(layer_types or (FULL if i and i % 4 == 0 else LINEAR for i in range(num_layers)))
        mlp_types = hf.get("mlp_layer_types") or [
            "dense" if i < int(hf.get("first_k_dense_replace", 1)) else "sparse" for i in range(num_layers)]
        if len(layer_types) != num_layers or len(mlp_types) != num_layers:
            raise ValueError(f"layer_types / mlp_layer_types must name {num_layers} layers")
        num_experts = int(_first(hf, "num_experts", "num_local_experts", default=0))
        routing = GroupedRouting(
            num_experts=num_experts, top_k=int(_first(hf, "num_experts_per_token", "num_experts_per_tok")),
            n_group=int(_first(hf, "num_expert_group", "n_group", default=1)),
            topk_group=int(_first(hf, "topk_group", default=1)),
            norm_topk_prob=bool(_first(hf, "moe_renormalize", "norm_topk_prob", default=True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        ) if num_experts else None
        mla = (dataclasses.replace(MLAConfig.from_hf(hf), head_gate=True) if ling
               else dataclasses.replace(MLAConfig.from_hf({**hf, "rope_interleave": False}), rope=None))
        eos = hf.get("eos_token_id")
        return cls(
            architecture=archs[0], vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            layer_types=layer_types, sparse_layers=tuple(t == "sparse" for t in mlp_types), mla=mla,
            linear_num_heads=int(linear.get("num_heads")
                                 or _first(hf, "linear_num_heads", "num_attention_heads")),
            linear_head_dim=int(linear.get("head_dim") or _first(hf, "linear_head_dim", default=128)),
            linear_conv_kernel=int(linear.get("short_conv_kernel_size")
                                   or _first(hf, "linear_conv_kernel_dim", "short_conv_kernel_size",
                                             default=4)),
            low_rank_gates=not ling,
            gate_lower_bound=float(hf.get("kda_lower_bound", -5.0)) if ling and hf.get("kda_safe_gate", True)
            else None,
            intermediate_size=int(hf.get("intermediate_size") or 0),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            n_shared_experts=int(_first(hf, "num_shared_experts", "n_shared_experts", default=0)),
            routing=routing, hidden_act=hf.get("hidden_act", "silu"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(_first(hf, "model_max_length", "max_position_embeddings",
                                               default=1048576)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )


config_from_hf = KimiLinearConfig.from_hf


class KimiDeltaAttention(DeltaRuleMixer):
    """q, k, v projections; causal conv + SiLU; L2-normed q, k; per-channel log decays
    g = -exp(A_log[h]) softplus(f_b(f_a(x)) + dt_bias) and beta = sigmoid(b(x)); KDA (kernels/delta_rule);
    per-head RMSNorm gated by sigmoid(g_b(g_a(x))); o_proj.

    qkv's outputs, the conv's channels and so the conv state are grouped by head (per head its q, k, v;
    models/fused.py): tensor parallelism splits them into whole heads, the recurrent state with them.
    """

    decode_update = staticmethod(kda_decode_update)
    decode_rows = staticmethod(kda_decode_rows)

    def __init__(self, cfg: KimiLinearConfig, *, dtype):
        d, h, hd, q = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_dim
        self.cfg = cfg
        self.scale = hd**-0.5
        self.qkv = Linear(d, 3 * q, bias=False, dtype=dtype)
        self.conv_weight = nnx.Param(jnp.zeros((3 * q, cfg.linear_conv_kernel), dtype))
        if cfg.low_rank_gates:
            self.f_a, self.g_a = (Linear(d, hd, bias=False, dtype=dtype) for _ in range(2))
            self.f_b, self.g_b = (Linear(hd, q, bias=False, dtype=dtype) for _ in range(2))
            self.f = self.g = None
        else:
            self.f, self.g = Linear(d, q, bias=False, dtype=dtype), Linear(d, q, bias=False, dtype=dtype)
            self.f_a = self.f_b = self.g_a = self.g_b = None
        self.dt_bias = nnx.Param(jnp.zeros((q,), jnp.float32))
        self.A_log = nnx.Param(jnp.zeros((h,), jnp.float32))
        self.b = Linear(d, h, bias=False, dtype=dtype)
        self.o_norm_weight = nnx.Param(jnp.ones((hd,), dtype))
        self.o = Linear(q, d, bias=False, dtype=dtype)

    def __call__(self, x: jax.Array, batch: ForwardBatch,
                 states: LayerStates) -> tuple[jax.Array, LayerStates]:
        cfg = self.cfg
        t, h, hd = x.shape[0], cfg.linear_num_heads, cfg.linear_head_dim
        dtype = self.o.dtype
        qkv = self.qkv(x).astype(dtype)
        f = self.f(x) if self.f is not None else self.f_b(self.f_a(x).astype(dtype))
        f = (f.astype(jnp.float32) + self.dt_bias[...]).reshape(t, h, hd)
        rate = jnp.exp(self.A_log[...])[:, None]
        g = (-rate * jax.nn.softplus(f) if cfg.gate_lower_bound is None  # log decays f32[T, H, hd]
             else cfg.gate_lower_bound * jax.nn.sigmoid(rate * f))
        beta = jax.nn.sigmoid(self.b(x).astype(jnp.float32))  # f32[T, H]
        prefill_states, decode_states = split_rows(states, batch.prefill_pages.shape[0])

        o, finals = by_section(batch, lambda *a: self._prefill(batch, prefill_states, *a),  # o f32[T, H, hd]
                               lambda *a: self._decode(decode_states, batch, *a), qkv, g, beta)
        with jax.named_scope("gated_norm"):  # per head: norm, weight (float32), then sigmoid(gate)
            var = jnp.mean(o * o, axis=-1, keepdims=True)
            gate = self.g(x) if self.g is not None else self.g_b(self.g_a(x).astype(dtype))
            gate = gate.astype(jnp.float32).reshape(t, h, hd)
            o = o * jax.lax.rsqrt(var + cfg.rms_norm_eps) * self.o_norm_weight[...].astype(jnp.float32)
            o = o * jax.nn.sigmoid(gate)
        return self.o(o.reshape(t, h * hd).astype(dtype)), finals

    def _heads(self, u: jax.Array):
        """L2-normed q, k and v f[..., H, hd] from the conv's activated output u f[..., 3 H hd] (per head)."""
        cfg = self.cfg
        u = u.reshape(*u.shape[:-1], cfg.linear_num_heads, 3, cfg.linear_head_dim)
        return _l2norm(u[..., 0, :]), _l2norm(u[..., 1, :]), u[..., 2, :]

    def _prefill(self, batch: ForwardBatch, states: LayerStates, qkv, g, beta):
        cfg = self.cfg
        nb, bs = batch.prefill_pages.shape[0], batch.prefill_block_size
        rows = state_rows(batch)
        with jax.named_scope("conv1d"):
            u, conv = causal_conv1d_prefill(qkv.reshape(nb, bs, -1), self.conv_weight[...], None, states.conv,
                                            rows.starts, rows.lens)
            q, k, v = self._heads(jax.nn.silu(u).astype(self.o.dtype))
        real = jnp.arange(bs)[None, :] < rows.lens[:, None]  # bool[nb, bs]
        g = jnp.where(real[..., None, None], g.reshape(nb, bs, *g.shape[1:]), 0.0)
        beta = jnp.where(real[..., None], beta.reshape(nb, bs, -1), 0.0)
        with jax.named_scope("kda_prefill"):
            o, final = kda_prefill(q, k, v, g, beta, states.ssm, rows.starts, scale=self.scale)
        return o.reshape(nb * bs, cfg.linear_num_heads, cfg.linear_head_dim), LayerStates(final, conv)


class KimiLinearLayer(hybrid.PreNormLayer):
    def __init__(self, cfg: KimiLinearConfig, kind: str, sparse: bool, *, dtype):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.recurrent = kind == LINEAR
        self.input_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.attn = KimiDeltaAttention(cfg, dtype=dtype) if kind == LINEAR else MLAttention(d, cfg.mla,
                                                                                          dtype=dtype)
        self.post_attn_norm = RMSNorm(d, eps=eps, dtype=dtype)
        self.mlp = (GroupedMoE(d, cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                               cfg.routing, act=cfg.hidden_act, dtype=dtype)
                    if sparse else GatedMLP(d, cfg.intermediate_size, act=cfg.hidden_act, bias=False,
                                            dtype=dtype))


class KimiLinearForCausalLM(CausalLM):
    def __init__(self, cfg: KimiLinearConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.init_ends(cfg, cfg.rms_norm_eps, dtype=dtype)
        self.layers = nnx.Dict({str(i): KimiLinearLayer(cfg, kind, sparse, dtype=dtype)
                                for i, (kind, sparse) in enumerate(zip(cfg.layer_types, cfg.sparse_layers))})

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        return hybrid.run_model(self, batch, pools, LINEAR, IN_PLACE)


def _either(get, *names: str) -> np.ndarray:
    """The first of `names` the checkpoint has: transformers' in-memory names or the hub's."""
    for name in names[:-1]:
        try:
            return get(name)
        except KeyError:
            pass
    return get(names[-1])


def _kda_from_hf(cfg: KimiLinearConfig, get, prefix: str) -> dict[tuple[str, ...], np.ndarray]:
    """A KDA layer from transformers' names (`conv1d`, `forget_gate.*`) or the hub checkpoints' (one conv per
    q, k and v: `q_conv1d`..., the forget gate's tensors directly under the layer)."""
    try:
        conv = np.split(get(prefix + "conv1d.weight")[:, 0, :], 3)
    except KeyError:
        conv = [get(f"{prefix}{n}_conv1d.weight")[:, 0, :] for n in "qkv"]

    def gate(name: str) -> np.ndarray:
        return _either(get, prefix + "forget_gate." + name, prefix + name)

    heads = cfg.linear_num_heads
    out = {
        ("qkv", "kernel"): grouped_rows([get(f"{prefix}{n}_proj.weight") for n in "qkv"], heads).T,
        ("conv_weight",): grouped_rows(conv, heads),
        ("dt_bias",): gate("dt_bias").reshape(-1),
        ("A_log",): gate("A_log").reshape(-1),
        ("b", "kernel"): get(prefix + "b_proj.weight").T,
        ("o_norm_weight",): get(prefix + "o_norm.weight"),
        ("o", "kernel"): get(prefix + "o_proj.weight").T,
    }
    if cfg.low_rank_gates:
        out.update({("f_a", "kernel"): gate("f_a_proj.weight").T,
                    ("f_b", "kernel"): gate("f_b_proj.weight").T,
                    ("g_a", "kernel"): get(prefix + "g_a_proj.weight").T,
                    ("g_b", "kernel"): get(prefix + "g_b_proj.weight").T})
    else:
        out.update({("f", "kernel"): gate("f_proj.weight").T,
                    ("g", "kernel"): get(prefix + "g_proj.weight").T})
    return out


def _mlp_from_hf(cfg: KimiLinearConfig, get, prefix: str, sparse: bool) -> dict[tuple[str, ...], np.ndarray]:
    """The MLP of a layer under `mlp.` (transformers) or `block_sparse_moe.` (hub checkpoints, whose experts'
    tensors are w1 / w3 / w2)."""
    try:
        get(prefix + ("mlp.gate.weight" if sparse else "mlp.gate_proj.weight"))
        block, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    except KeyError:
        block, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    if not sparse:
        return gated_mlp_params_from_hf(get, block[:-1], bias=False)
    return grouped_moe_from_hf(get, block, cfg.routing.num_experts, bias_name="e_score_correction_bias",
                               shared=cfg.n_shared_experts > 0, names=names)


# transformers' in-memory names -> the names Ling 3's checkpoints (and transformers' save of them) use
_LING_NAMES = (("model.embed_tokens.", "model.word_embeddings."), (".self_attn.", ".attention."),
               ("attention.o_proj.", "attention.dense."),
               ("gate.e_score_correction_bias", "gate.expert_bias"))


def _with_hub_names(get):
    """`get` that falls back to Ling 3's tensor names where transformers' are missing."""
    def wrapped(name: str) -> np.ndarray:
        try:
            return get(name)
        except KeyError:
            alt = name
            for ours, theirs in _LING_NAMES:
                alt = alt.replace(ours, theirs)
            if alt == name:
                raise
            return get(alt)
    return wrapped


def params_from_hf(cfg: KimiLinearConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    get = _with_hub_names(get)
    out = {("embed",): get("model.embed_tokens.weight"), ("norm", "weight"): get("model.norm.weight")}
    for i, (kind, sparse) in enumerate(zip(cfg.layer_types, cfg.sparse_layers)):
        prefix, ours = f"model.layers.{i}.", ("layers", str(i))
        out[(*ours, "input_norm", "weight")] = get(prefix + "input_layernorm.weight")
        out[(*ours, "post_attn_norm", "weight")] = get(prefix + "post_attention_layernorm.weight")
        if kind == LINEAR:
            mixer = _kda_from_hf(cfg, get, prefix + "self_attn.")
        else:
            mixer = mla_params_from_hf(cfg.mla, get, prefix + "self_attn.")
            if cfg.mla.head_gate:
                mixer[("g", "kernel")] = get(prefix + "self_attn.g_proj.weight").T
        out.update(hybrid.prefixed((*ours, "attn"), mixer))
        out.update(hybrid.prefixed((*ours, "mlp"), _mlp_from_hf(cfg, get, prefix, sparse)))
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
