"""Grouped-query attention over the paged KV pool, with optional q/k norms and (partial) RoPE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.paged_attention import paged_attention, write_kv
from memory import KVPool
from models.batch import ForwardBatch, by_section
from models.config import AttentionConfig
from models.fused import qkv_rows, split_qkv
from models.layers.linear import Linear
from models.layers.norm import RMSNorm
from models.layers.rope import apply_rope


class Attention(nnx.Module):
    """Causal GQA attention whose K/V live in layer `layer` of the paged KV pool."""

    def __init__(self, hidden: int, cfg: AttentionConfig, *, dtype):
        self.cfg = cfg
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k and v are fused into one matmul (one pass over x), columns grouped by KV head
        # (models/fused.py).
        self.qkv = Linear(hidden, q_out + 2 * kv_out, bias=cfg.qkv_bias, dtype=dtype)
        self.o = Linear(q_out, hidden, bias=cfg.o_bias, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps, dtype=dtype)
        self.gate = Linear(hidden, q_out, bias=False, dtype=dtype) if cfg.output_gate else None

    def __call__(self, x, batch: ForwardBatch, kv: KVPool, layer) -> tuple[jax.Array, KVPool]:
        """x f[T, hidden] (normed) -> (f32[T, hidden], kv with this step's K/V written to layer `layer`)."""
        cfg = self.cfg
        t, hd, dtype = x.shape[0], cfg.head_dim, self.o.dtype
        q, k, v = split_qkv(self.qkv(x), cfg.num_heads, cfg.num_kv_heads, hd)
        if cfg.qk_norm:
            q, k = self.q_norm(q, dtype), self.k_norm(k, dtype)
        q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
        if cfg.rope is not None:
            inv_freq = cfg.rope.inv_freq(cfg.rotary_dim)  # a trace-time constant
            q = apply_rope(q, batch.positions, inv_freq, cfg.rope.attention_scaling)
            k = apply_rope(k, batch.positions, inv_freq, cfg.rope.attention_scaling)
        k_pool, v_pool = write_kv(kv.k, kv.v, layer, k, v, batch.out_cache_loc)

        # `--activation-quantization bf16` over a bf16 KV cache: attention's products take their inputs in
        # bf16 as well (the queries, then the softmax weights; keys and values are bf16 already), as a bf16
        # model's do: on a CPU with AVX512-BF16, pair products at twice the f32 rate, prefill and decode.
        bf16_queries = self.o.activations == "bf16" and k_pool.dtype == jnp.bfloat16 and dtype != jnp.bfloat16

        def attend(pages, block_size):
            def run(q, positions):
                q_in = q.astype(jnp.bfloat16) if bf16_queries else q
                out = paged_attention(q_in, k_pool, v_pool, layer, pages, positions, page_size=kv.page_size,
                                      block_size=block_size, scale=hd**-0.5)
                return out.astype(q.dtype)
            return run

        attn = by_section(batch, attend(batch.prefill_pages, batch.prefill_block_size),
                          attend(batch.decode_pages, 1), q, batch.positions).reshape(t, cfg.num_heads * hd)
        if self.gate is not None:
            attn = (attn * jax.nn.sigmoid(self.gate(x).astype(jnp.float32))).astype(attn.dtype)
        return self.o(attn), KVPool(k_pool, v_pool, kv.page_size)


def attention_params_from_hf(
    cfg: AttentionConfig,
    get,
    prefix: str,
    *,
    in_scale: float = 1.0,
    k_scale: float = 1.0,
    out_scale: float = 1.0,
) -> dict[tuple[str, ...], np.ndarray]:
    """HF q/k/v/o_proj (and q/k_norm) under `prefix` -> our `Attention` ({(name, leaf): array}, kernels
    [in, out]).

    Scalar multipliers fold into the weights (Falcon-H1's muP): `in_scale` multiplies the block's input
    (kernels only), `k_scale` the key projection's output and `out_scale` the block's output (kernel and
    bias).
    """
    q, k, v = (get(f"{prefix}.{n}_proj.weight") for n in "qkv")
    out = {
        ("qkv", "kernel"): _scaled(qkv_rows(q, _scaled(k, k_scale), v, cfg.num_kv_heads).T, in_scale),
        ("o", "kernel"): _scaled(get(f"{prefix}.o_proj.weight").T, out_scale),
    }
    if cfg.qkv_bias:
        qb, kb, vb = (get(f"{prefix}.{n}_proj.bias") for n in "qkv")
        out[("qkv", "bias")] = qkv_rows(qb, _scaled(kb, k_scale), vb, cfg.num_kv_heads)
    if cfg.o_bias:
        out[("o", "bias")] = _scaled(get(f"{prefix}.o_proj.bias"), out_scale)
    if cfg.qk_norm:
        out[("q_norm", "weight")] = get(f"{prefix}.q_norm.weight")
        out[("k_norm", "weight")] = get(f"{prefix}.k_norm.weight")
    return out


def _scaled(x, scale: float):
    return x if scale == 1.0 else x * scale
