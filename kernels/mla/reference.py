"""Plain-jnp MLA attention over paged latents: the CPU path and the oracle for a Pallas kernel.

Each cached token keeps one vector `[c; k_pe]`: the normed compressed KV `c` (kv_lora_rank channels)
and the RoPE'd shared key `k_pe` (rope_dim channels). Per head h, key = [c @ W_UK[h]; k_pe] and
value = c @ W_UV[h]. Prefill expands the latents into per-head keys and values (cheap when many
queries share them); decode folds W_UK into the query and W_UV into the output (the "absorbed" form,
DeepSeek-V2 section 2.1.2), so it reads only the latents: kv_lora_rank + rope_dim numbers per token
instead of heads * (nope + rope + v_head_dim).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.paged_attention.reference import write_rows_op


def write_latent(
    pool: jax.Array,  # f[num_layers, num_slots, 1, kv_lora_rank + rope_dim]
    layer: jax.Array | int,
    latent: jax.Array,  # f[T, kv_lora_rank + rope_dim]
    slots: jax.Array,  # i32[T] flat slot = page * page_size + offset; padding writes the dummy page 0
) -> jax.Array:
    """Scatters this step's latents into one layer of the pool; returns the updated pool."""
    return write_rows_op(pool, layer, latent[:, None, :], slots)


def _gather(pool, layer, pages, page_size, compute_dtype):
    """The latents of each row's page-table row: f[rows, pages_per_seq * page_size, latent_dim], widened to
    `compute_dtype` where the pool is narrower (a bf16 pool under an f32 model)."""
    num_layers, num_slots, _, latent_dim = pool.shape
    rows, pages_per_seq = pages.shape
    paged = pool.reshape(num_layers, num_slots // page_size, page_size, latent_dim)
    latents = paged[layer, pages].reshape(rows, pages_per_seq * page_size, latent_dim)
    return latents.astype(jnp.promote_types(latents.dtype, compute_dtype))


def mla_prefill_attention(
    q_nope: jax.Array,  # f[T, heads, nope], T = num_blocks * block_size
    q_pe: jax.Array,  # f[T, heads, rope_dim] (RoPE applied)
    pool: jax.Array,  # f[num_layers, num_slots, 1, kv_lora_rank + rope_dim]
    layer: jax.Array | int,
    block_pages: jax.Array,  # i32[num_blocks, pages_per_seq]
    positions: jax.Array,  # i32[T]
    w_uk: jax.Array,  # f[kv_lora_rank, heads, nope]
    w_uv: jax.Array,  # f[kv_lora_rank, heads, v_head_dim]
    *,
    page_size: int,
    block_size: int,
    scale: float,
) -> jax.Array:
    """Expanded form: causal attention of each query block over its sequence's latents, expanded per head.

    Same contract as `paged_attention` (this step's latents already written; key j visible to query t iff
    j <= positions[t]). Returns f[T, heads, v_head_dim].
    """
    num_tokens, num_heads, nope = q_nope.shape
    num_blocks = block_pages.shape[0]
    if num_tokens != num_blocks * block_size:
        raise ValueError(f"{num_tokens=} must equal {num_blocks=} * {block_size=}")
    rank = w_uk.shape[0]
    latents = _gather(pool, layer, block_pages, page_size, q_nope.dtype)  # [b, s, rank + rope]
    kv_len = latents.shape[1]
    block_positions = positions.reshape(num_blocks, block_size)
    # Slots past the block's last position hold stale or foreign data (maybe NaN): zero them before use.
    live = jnp.arange(kv_len)[None, :] <= block_positions.max(axis=1)[:, None]  # [b, s]
    latents = jnp.where(live[:, :, None], latents, 0)
    c, k_pe = latents[..., :rank], latents[..., rank:]
    k_nope = jnp.einsum("bsc,chn->bshn", c, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)
    v = jnp.einsum("bsc,chv->bshv", c, w_uv, preferred_element_type=jnp.float32).astype(q_nope.dtype)
    qn = q_nope.reshape(num_blocks, block_size, num_heads, nope)
    qp = q_pe.reshape(num_blocks, block_size, num_heads, -1)
    scores = jnp.einsum("bqhn,bshn->bhqs", qn, k_nope, preferred_element_type=jnp.float32)
    scores = scores + jnp.einsum("bqhr,bsr->bhqs", qp, k_pe, preferred_element_type=jnp.float32)
    visible = jnp.arange(kv_len)[None, None, :] <= block_positions[:, :, None]  # [b, q, s]
    scores = jnp.where(visible[:, None], scores * scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqs,bshv->bqhv", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, -1).astype(q_nope.dtype)


def mla_decode_attention(
    q_nope: jax.Array,  # f[D, heads, nope]
    q_pe: jax.Array,  # f[D, heads, rope_dim] (RoPE applied)
    pool: jax.Array,  # f[num_layers, num_slots, 1, kv_lora_rank + rope_dim]
    layer: jax.Array | int,
    pages: jax.Array,  # i32[D, pages_per_seq]
    positions: jax.Array,  # i32[D]
    w_uk: jax.Array,  # f[kv_lora_rank, heads, nope]
    w_uv: jax.Array,  # f[kv_lora_rank, heads, v_head_dim]
    *,
    page_size: int,
    scale: float,
) -> jax.Array:
    """Absorbed form: one query per row attends over its latents directly. Returns f[D, heads, v_head_dim].

    score(h, j) = (q_nope[h] W_UK[h]^T) . c_j + q_pe[h] . k_pe_j, output_h = (sum_j p_hj c_j) W_UV[h]:
    the same numbers as the expanded form, with the head projections moved off the per-token path.
    """
    rank = w_uk.shape[0]
    latents = _gather(pool, layer, pages, page_size, q_nope.dtype)  # [d, s, rank + rope]
    kv_len = latents.shape[1]
    visible = jnp.arange(kv_len)[None, :] <= positions[:, None]  # [d, s]
    latents = jnp.where(visible[:, :, None], latents, 0)
    c, k_pe = latents[..., :rank], latents[..., rank:]
    q_latent = jnp.einsum("dhn,chn->dhc", q_nope, w_uk, preferred_element_type=jnp.float32).astype(c.dtype)
    scores = jnp.einsum("dhc,dsc->dhs", q_latent, c, preferred_element_type=jnp.float32)
    scores = scores + jnp.einsum("dhr,dsr->dhs", q_pe, k_pe, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, :], scores * scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(c.dtype)
    out_latent = jnp.einsum("dhs,dsc->dhc", probs, c, preferred_element_type=jnp.float32).astype(c.dtype)
    out = jnp.einsum("dhc,chv->dhv", out_latent, w_uv, preferred_element_type=jnp.float32)
    return out.astype(q_nope.dtype)
