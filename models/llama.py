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
from models.layers import GatedMLP, Linear, RMSNorm, apply_rope, lm_logits

config_from_hf = ModelConfig.from_hf


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype):
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        # q, k and v are fused into one matmul: one pass over x instead of three.
        self.qkv = Linear(d, q_out + 2 * kv_out, bias=cfg.attention_bias, dtype=dtype)
        self.o = Linear(q_out, d, bias=cfg.o_bias, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x, batch: ForwardBatch, kv: KVPool, layer) -> tuple[jax.Array, KVPool]:
        cfg = self.cfg
        t, hd, dtype = x.shape[0], cfg.head_dim, self.o.kernel.dtype
        qkv = self.qkv(x)
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        q = qkv[:, :q_out].reshape(t, cfg.num_heads, hd)
        k = qkv[:, q_out : q_out + kv_out].reshape(t, cfg.num_kv_heads, hd)
        v = qkv[:, q_out + kv_out :].reshape(t, cfg.num_kv_heads, hd).astype(dtype)
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
                    q[:num_prefill], k_pool, v_pool, layer, batch.prefill_pages, batch.positions[:num_prefill],
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
        return self.o(attn.reshape(t, q_out)), KVPool(k_pool, v_pool, kv.page_size)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype):
        eps = cfg.rms_norm_eps
        self.input_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.attn = Attention(cfg, dtype=dtype)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act, bias=cfg.mlp_bias, dtype=dtype)

    def __call__(self, x, batch: ForwardBatch, kv: KVPool, layer) -> tuple[jax.Array, KVPool]:
        # The residual stream `x` stays float32 whatever the compute dtype.
        with jax.named_scope("attention"):
            h, kv = self.attn(self.input_norm(x), batch, kv, layer)
        x = x + h
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.post_attn_norm(x))
        return x, kv


class LlamaForCausalLM(nnx.Module):
    """Decoder with all layers' parameters stacked on a leading axis and run by one `lax.scan`.

    Scanning compiles one layer body instead of `num_layers` copies, which keeps precompiling
    every shape bucket fast; the KV pools ride in the scan carry so XLA updates them in place.
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        layer = DecoderLayer(cfg, dtype=dtype)
        graphdef, state = nnx.split(layer)
        stacked = jax.tree.map(lambda x: jnp.zeros((cfg.num_layers, *x.shape), x.dtype), state)
        self.layers = nnx.merge(graphdef, stacked)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(jnp.zeros((cfg.hidden_size, cfg.vocab_size), dtype))

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        kv = pools.kv
        x = self.embed[...][batch.input_ids].astype(jnp.float32)
        graphdef, layer_state = nnx.split(self.layers)

        def body(carry, scanned):
            x, kv = carry
            index, state = scanned
            x, kv = nnx.merge(graphdef, state)(x, batch, kv, index)
            return (x, kv), None

        (x, kv), _ = jax.lax.scan(body, (x, kv), (jnp.arange(self.cfg.num_layers), layer_state))
        return self.norm(x, self.dtype), pools._replace(kv=kv)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """f32[N, vocab] logits for hidden rows f[N, hidden]."""
        return lm_logits(hidden, self.embed[...], None if self.lm_head is None else self.lm_head[...])


def params_from_hf(cfg: ModelConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF tensors (fetched by name with `get`) to our parameter paths, fusing and transposing.

    HF linear weights are [out, in]; ours are [in, out], q/k/v and gate/up concatenated on `out`,
    and per-layer tensors stacked on a leading layer axis.
    """
    def per_layer(fmt: str, fn=lambda x: x) -> np.ndarray:
        return np.stack([fn(lambda name: get(fmt.format(i=i, name=name))) for i in range(cfg.num_layers)])

    attn = "model.layers.{i}.self_attn.{name}"
    mlp = "model.layers.{i}.mlp.{name}"
    out = {
        ("embed",): get("model.embed_tokens.weight"),
        ("norm", "weight"): get("model.norm.weight"),
        ("layers", "attn", "qkv", "kernel"): per_layer(
            attn, lambda g: np.concatenate([g("q_proj.weight"), g("k_proj.weight"), g("v_proj.weight")]).T
        ),
        ("layers", "attn", "o", "kernel"): per_layer(attn, lambda g: g("o_proj.weight").T),
        ("layers", "mlp", "gate_up", "kernel"): per_layer(
            mlp, lambda g: np.concatenate([g("gate_proj.weight"), g("up_proj.weight")]).T
        ),
        ("layers", "mlp", "down", "kernel"): per_layer(mlp, lambda g: g("down_proj.weight").T),
        ("layers", "input_norm", "weight"): per_layer("model.layers.{i}.input_layernorm.{name}", lambda g: g("weight")),
        ("layers", "post_attn_norm", "weight"): per_layer(
            "model.layers.{i}.post_attention_layernorm.{name}", lambda g: g("weight")
        ),
    }
    if cfg.attention_bias:
        out[("layers", "attn", "qkv", "bias")] = per_layer(
            attn, lambda g: np.concatenate([g("q_proj.bias"), g("k_proj.bias"), g("v_proj.bias")])
        )
    if cfg.o_bias:
        out[("layers", "attn", "o", "bias")] = per_layer(attn, lambda g: g("o_proj.bias"))
    if cfg.qk_norm:
        out[("layers", "attn", "q_norm", "weight")] = per_layer(attn, lambda g: g("q_norm.weight"))
        out[("layers", "attn", "k_norm", "weight")] = per_layer(attn, lambda g: g("k_norm.weight"))
    if cfg.mlp_bias:
        out[("layers", "mlp", "gate_up", "bias")] = per_layer(
            mlp, lambda g: np.concatenate([g("gate_proj.bias"), g("up_proj.bias")])
        )
        out[("layers", "mlp", "down", "bias")] = per_layer(mlp, lambda g: g("down_proj.bias"))
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
