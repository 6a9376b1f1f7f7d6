"""Llama-family decoders (Llama, Qwen2, Qwen3): GQA attention over paged KV, gated MLP, layers scanned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.paged_attention import paged_attention, write_kv
from memory import KVPool, MemoryPools
from models.batch import ForwardBatch
from models.config import ModelConfig
from models.fused import gate_up_rows, qkv_rows, split_qkv
from models.layers import GatedMLP, Linear, RMSNorm, apply_rope, layer_stack, lm_logits, scan_layers

config_from_hf = ModelConfig.from_hf


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        # q, k and v are fused into one matmul (one pass over x), columns grouped by KV head
        # (models/fused.py).
        self.qkv = Linear(d, q_out + 2 * kv_out, bias=cfg.attention_bias, dtype=dtype)
        self.o = Linear(q_out, d, bias=cfg.o_bias, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x, batch: ForwardBatch, kv: KVPool, layer) -> tuple[jax.Array, KVPool]:
        cfg = self.cfg
        t, hd, dtype = x.shape[0], cfg.head_dim, self.o.kernel.dtype
        q, k, v = split_qkv(self.qkv(x), cfg.num_heads, cfg.num_kv_heads, hd)
        v = v.astype(dtype)
        if cfg.qk_norm:
            q, k = self.q_norm(q, dtype), self.k_norm(k, dtype)
        inv_freq = cfg.rope.inv_freq(hd)  # a trace-time constant
        q = apply_rope(q.astype(dtype), batch.positions, inv_freq, cfg.rope.attention_scaling)
        k = apply_rope(k.astype(dtype), batch.positions, inv_freq, cfg.rope.attention_scaling)
        k_pool, v_pool = write_kv(kv.k, kv.v, layer, k, v, batch.out_cache_loc)

        scale = hd**-0.5
        outs = []
        num_prefill = batch.num_prefill_tokens
        if num_prefill:
            outs.append(
                paged_attention(
                    q[:num_prefill], k_pool, v_pool, layer, batch.prefill_pages,
                    batch.positions[:num_prefill],
                    page_size=kv.page_size, block_size=batch.prefill_block_size, scale=scale,
                )
            )
        if batch.num_decode:
            outs.append(
                paged_attention(
                    q[num_prefill:], k_pool, v_pool, layer, batch.decode_pages, batch.positions[num_prefill:],
                    page_size=kv.page_size, block_size=1, scale=scale,
                )
            )
        attn = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
        return self.o(attn.reshape(t, cfg.num_heads * hd)), KVPool(k_pool, v_pool, kv.page_size)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype):
        eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act, bias=cfg.mlp_bias,
                            dtype=dtype)

    def __call__(self, x, batch: ForwardBatch, kv: KVPool, layer) -> tuple[jax.Array, KVPool]:
        # The residual stream `x` stays float32 whatever the compute dtype.
        with jax.named_scope("attention"):
            h, kv = self.attn(self.input_norm(x), batch, kv, layer)
        x = x + h
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.post_attn_norm(x))
        return x, kv


class LlamaForCausalLM(nnx.Module):
    """Decoder whose layers run in one `lax.scan` (models/layers.py:`scan_layers`).

    Scanning compiles one layer body instead of `num_layers` copies, which keeps precompiling every
    shape bucket fast; the KV pools ride in the scan carry so XLA updates them in place. Layer weights are
    stacked on a leading axis (GPU/TPU) or kept per layer and picked by `lax.switch` (CPU, which would copy
    a dynamic slice of the stacked weights out every step): `layer_stack`.
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = layer_stack(lambda: DecoderLayer(cfg, dtype=dtype), cfg.num_layers)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nnx.Param(jnp.zeros((cfg.hidden_size, cfg.vocab_size), dtype)))

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        kv = pools.kv
        x = self.embed[...][batch.input_ids].astype(jnp.float32)

        def step(layer, index, carry):
            x, kv = carry
            return layer(x, batch, kv, index)

        x, kv = scan_layers(self.layers, self.cfg.num_layers, step, (x, kv))
        return self.norm(x, self.dtype), pools._replace(kv=kv)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """f32[N, vocab] logits for hidden rows f[N, hidden]."""
        return lm_logits(hidden, self.embed[...], None if self.lm_head is None else self.lm_head[...])


def params_from_hf(cfg: ModelConfig, get) -> dict[tuple, np.ndarray]:
    """Maps HF tensors (fetched by name with `get`) to our parameter paths, fusing and transposing.

    HF linear weights are [out, in]; ours are [in, out], q/k/v and gate/up fused on `out` in the
    layouts of models/fused.py, and layer i's parameters under ("layers", i, ...).
    """
    out = {("embed",): get("model.embed_tokens.weight"), ("norm", "weight"): get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    for i in range(cfg.num_layers):
        layer = _layer_from_hf(cfg, get, f"model.layers.{i}.")
        out.update({("layers", i, *path): value for path, value in layer.items()})
    return out


def _layer_from_hf(cfg: ModelConfig, get, prefix: str) -> dict[tuple[str, ...], np.ndarray]:
    """One decoder layer's parameters (paths inside `DecoderLayer`) from HF tensors named `prefix` + name."""

    def attn(name: str):
        return get(f"{prefix}self_attn.{name}")

    def mlp(name: str):
        return get(f"{prefix}mlp.{name}")

    out = {
        ("attn", "qkv", "kernel"): qkv_rows(
            attn("q_proj.weight"), attn("k_proj.weight"), attn("v_proj.weight"), cfg.num_kv_heads
        ).T,
        ("attn", "o", "kernel"): attn("o_proj.weight").T,
        ("mlp", "gate_up", "kernel"): gate_up_rows(mlp("gate_proj.weight"), mlp("up_proj.weight")).T,
        ("mlp", "down", "kernel"): mlp("down_proj.weight").T,
        ("input_norm", "weight"): get(f"{prefix}input_layernorm.weight"),
        ("post_attn_norm", "weight"): get(f"{prefix}post_attention_layernorm.weight"),
    }
    if cfg.attention_bias:
        qkv_bias = [attn("q_proj.bias"), attn("k_proj.bias"), attn("v_proj.bias")]
        out[("attn", "qkv", "bias")] = qkv_rows(*qkv_bias, cfg.num_kv_heads)
    if cfg.o_bias:
        out[("attn", "o", "bias")] = attn("o_proj.bias")
    if cfg.qk_norm:
        out[("attn", "q_norm", "weight")] = attn("q_norm.weight")
        out[("attn", "k_norm", "weight")] = attn("k_norm.weight")
    if cfg.mlp_bias:
        out[("mlp", "gate_up", "bias")] = gate_up_rows(mlp("gate_proj.bias"), mlp("up_proj.bias"))
        out[("mlp", "down", "bias")] = mlp("down_proj.bias")
    return out
