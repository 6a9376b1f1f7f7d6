"""What the SSM+attention hybrids (Nemotron-H, Bamba, Falcon-H1) share: paged GQA attention, name maps."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.paged_attention import paged_attention, write_kv
from memory import CacheSpec, KVPool, MemoryPools, RecurrentSpec
from models.batch import ForwardBatch
from models.config import RopeConfig
from models.fused import gate_up_rows, qkv_rows, split_qkv
from models.layers import Linear, apply_rope
from models.recurrent import read_layer_states, state_rows, write_layer_states


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Shape of a hybrid's GQA attention block; `rope=None` means no positional encoding (Nemotron-H)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    rope: RopeConfig | None = None
    rotary_dim: int = 0  # leading channels of each head that rotate (Bamba rotates half of them)

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


class Attention(nnx.Module):
    """Causal GQA attention whose K/V live in layer `layer` of the paged KV pool (as in models/llama.py)."""

    def __init__(self, hidden: int, cfg: AttentionConfig, *, dtype):
        self.cfg = cfg
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v are fused into one matmul (one pass over x), columns grouped by KV head
        # (models/fused.py).
        self.qkv = Linear(hidden, q_out + 2 * kv_out, bias=cfg.qkv_bias, dtype=dtype)
        self.o = Linear(q_out, hidden, bias=cfg.o_bias, dtype=dtype)

    def __call__(self, x, batch: ForwardBatch, kv: KVPool, layer: int) -> tuple[jax.Array, KVPool]:
        """x f[T, hidden] (normed) -> (f32[T, hidden], kv with this step's K/V written to layer `layer`)."""
        cfg = self.cfg
        t, hd, dtype = x.shape[0], cfg.head_dim, self.o.kernel.dtype
        q_out = cfg.num_heads * hd
        q, k, v = (a.astype(dtype) for a in split_qkv(self.qkv(x), cfg.num_heads, cfg.num_kv_heads, hd))
        if cfg.rope is not None:
            inv_freq = cfg.rope.inv_freq(cfg.rotary_dim)  # a trace-time constant
            q = apply_rope(q, batch.positions, inv_freq, cfg.rope.attention_scaling)
            k = apply_rope(k, batch.positions, inv_freq, cfg.rope.attention_scaling)
        k_pool, v_pool = write_kv(kv.k, kv.v, layer, k, v, batch.out_cache_loc)

        scale = hd**-0.5
        outs = []
        num_prefill = batch.num_prefill_tokens
        if num_prefill:
            outs.append(
                paged_attention(
                    q[:num_prefill],
                    k_pool,
                    v_pool,
                    layer,
                    batch.prefill_pages,
                    batch.positions[:num_prefill],
                    page_size=kv.page_size,
                    block_size=batch.prefill_block_size,
                    scale=scale,
                )
            )
        if batch.num_decode:
            outs.append(
                paged_attention(
                    q[num_prefill:],
                    k_pool,
                    v_pool,
                    layer,
                    batch.decode_pages,
                    batch.positions[num_prefill:],
                    page_size=kv.page_size,
                    block_size=1,
                    scale=scale,
                )
            )
        attn = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
        return self.o(attn.reshape(t, q_out)), KVPool(k_pool, v_pool, kv.page_size)


def attention_params_from_hf(
    cfg: AttentionConfig,
    get,
    prefix: str,
    *,
    in_scale: float = 1.0,
    k_scale: float = 1.0,
    out_scale: float = 1.0,
) -> dict[tuple[str, ...], np.ndarray]:
    """HF q/k/v/o_proj under `prefix` -> our fused `qkv` and `o` ({(name, leaf): array}, kernels [in, out]).

    Scalar multipliers fold into the weights (Falcon-H1's muP): `in_scale` multiplies the block's input
    (kernels only), `k_scale` the key projection's output and `out_scale` the block's output (kernel and
    bias).
    """
    q, k, v = (get(f"{prefix}.{n}_proj.weight") for n in "qkv")
    out = {
        ("qkv", "kernel"): qkv_rows(q, k * k_scale, v, cfg.num_kv_heads).T * in_scale,
        ("o", "kernel"): get(f"{prefix}.o_proj.weight").T * out_scale,
    }
    if cfg.qkv_bias:
        qb, kb, vb = (get(f"{prefix}.{n}_proj.bias") for n in "qkv")
        out[("qkv", "bias")] = qkv_rows(qb, kb * k_scale, vb, cfg.num_kv_heads)
    if cfg.o_bias:
        out[("o", "bias")] = get(f"{prefix}.o_proj.bias") * out_scale
    return out


def gated_mlp_params_from_hf(
    get, prefix: str, *, bias: bool, gate_scale: float = 1.0, down_scale: float = 1.0
) -> dict[tuple[str, ...], np.ndarray]:
    """HF gate/up/down_proj under `prefix` -> our `GatedMLP` (gate and up fused, kernels [in, out]).

    `gate_scale` multiplies the gate projection's output and `down_scale` the MLP's output (Falcon-H1's
    mlp_multipliers), folded into kernels and biases.
    """
    gate, up = get(f"{prefix}.gate_proj.weight") * gate_scale, get(f"{prefix}.up_proj.weight")
    out = {
        ("gate_up", "kernel"): gate_up_rows(gate, up).T,
        ("down", "kernel"): get(f"{prefix}.down_proj.weight").T * down_scale,
    }
    if bias:
        out[("gate_up", "bias")] = gate_up_rows(
            get(f"{prefix}.gate_proj.bias") * gate_scale, get(f"{prefix}.up_proj.bias")
        )
        out[("down", "bias")] = get(f"{prefix}.down_proj.bias") * down_scale
    return out


def ordinals(kinds: Sequence[str]) -> tuple[int, ...]:
    """Index of each layer among the layers of its own kind: its layer index into that kind's pool."""
    seen: dict[str, int] = {}
    out = []
    for kind in kinds:
        out.append(seen.get(kind, 0))
        seen[kind] = out[-1] + 1
    return tuple(out)


def prefixed(
    prefix: tuple[str, ...], params: dict[tuple[str, ...], np.ndarray]
) -> dict[tuple[str, ...], np.ndarray]:
    return {prefix + path: value for path, value in params.items()}




def run_layers(
    layers: nnx.Dict, layer_types: tuple[str, ...], recurrent_kind: str, x: jax.Array, batch: ForwardBatch,
    pools: MemoryPools,
) -> tuple[jax.Array, MemoryPools]:
    """Runs heterogeneous layers in order: `layers[str(i)](x, batch, kv, states, index) -> (x, kv, states)`.

    `index` is the layer's ordinal among layers of its kind (its index into the KV or the state pool);
    layers of `recurrent_kind` get their rows' initial states (see models/recurrent.py) and their final
    states are written back to the pool right after them. Returns (x, pools with kv and recurrent updated).
    """
    kv, rec = pools.kv, pools.recurrent
    rows = state_rows(batch) if rec is not None else None
    for i, (kind, index) in enumerate(zip(layer_types, ordinals(layer_types))):
        states = read_layer_states(rec, index, rows) if kind == recurrent_kind else None
        x, kv, states = layers[str(i)](x, batch, kv, states, index)
        if kind == recurrent_kind:
            rec = write_layer_states(rec, index, rows, states)
    return x, pools._replace(kv=kv, recurrent=rec)


def cache_spec(
    layer_types: Sequence[str], attention: AttentionConfig, ssm_shape: tuple[int, ...],
    conv_shape: tuple[int, ...] | None, *, attention_kind: str = "attention", recurrent_kind: str = "mamba",
) -> CacheSpec:
    """KV pages for the `attention_kind` layers, a state slot of the given shapes for the `recurrent_kind`
    ones."""
    num_recurrent = list(layer_types).count(recurrent_kind)
    recurrent = RecurrentSpec(num_recurrent, ssm_shape, conv_shape) if num_recurrent else None
    return CacheSpec(list(layer_types).count(attention_kind), attention.num_kv_heads, attention.head_dim,
                     recurrent)
