"""Plain-jnp paged attention: the CPU path and the oracle for the Pallas kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(
    k_pool: jax.Array,  # f[num_layers, num_pages, page_size, kv_heads, head_dim]
    v_pool: jax.Array,  # f[num_layers, num_pages, page_size, kv_heads, head_dim]
    layer: jax.Array | int,  # which layer's pages to write (may be a traced scan index)
    k: jax.Array,  # f[T, kv_heads, head_dim]
    v: jax.Array,  # f[T, kv_heads, head_dim]
    slots: jax.Array,  # i32[T] flat slot = page * page_size + offset; padding writes the dummy page 0
) -> tuple[jax.Array, jax.Array]:
    """Scatters new K/V into one layer of the pools; returns the updated pools.

    The pools hold all layers so that a `lax.scan` over layers can update them in place (a carry
    with a scatter is aliased by XLA; slicing a layer out and back would copy it every step).
    """
    num_layers, num_pages, page_size, kv_heads, head_dim = k_pool.shape
    flat = (num_layers, num_pages * page_size, kv_heads, head_dim)
    k_pool = k_pool.reshape(flat).at[layer, slots].set(k.astype(k_pool.dtype)).reshape(k_pool.shape)
    v_pool = v_pool.reshape(flat).at[layer, slots].set(v.astype(v_pool.dtype)).reshape(v_pool.shape)
    return k_pool, v_pool


def paged_attention(
    q: jax.Array,  # f[T, heads, head_dim], T = num_blocks * block_size
    k_pool: jax.Array,  # f[num_layers, num_pages, page_size, kv_heads, head_dim]
    v_pool: jax.Array,  # f[num_layers, num_pages, page_size, kv_heads, head_dim]
    layer: jax.Array | int,
    block_pages: jax.Array,  # i32[num_blocks, pages_per_seq] page table row of each query block's sequence
    positions: jax.Array,  # i32[T] absolute position of each query token
    *,
    block_size: int,
    scale: float,
) -> jax.Array:
    """Causal attention of each query block against its sequence's pages in layer `layer`.

    Every block of `block_size` consecutive queries belongs to one sequence (padding rows point at
    the dummy page 0). Key j of a sequence is visible to query t iff j <= positions[t], so the
    current tokens' K/V must already be written into the pool. Unused page-table entries may point
    anywhere: they sit past every query's position and are masked. Returns f[T, heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, pages_per_seq = block_pages.shape
    _, _, page_size, kv_heads, _ = k_pool.shape
    if num_tokens != num_blocks * block_size:
        raise ValueError(f"{num_tokens=} must equal {num_blocks=} * {block_size=}")
    group = num_heads // kv_heads
    kv_len = pages_per_seq * page_size

    k = k_pool[layer, block_pages].reshape(num_blocks, kv_len, kv_heads, head_dim)
    v = v_pool[layer, block_pages].reshape(num_blocks, kv_len, kv_heads, head_dim)
    qb = q.reshape(num_blocks, block_size, kv_heads, group, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qb, k, preferred_element_type=jnp.float32) * scale
    block_positions = positions.reshape(num_blocks, block_size)
    visible = jnp.arange(kv_len)[None, None, :] <= block_positions[:, :, None]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    # Slots past the block's last position hold stale or foreign data: zero them, since 0 * NaN = NaN
    # would otherwise leak a bad value from a page's previous owner into this sequence.
    v = jnp.where((jnp.arange(kv_len)[None, :] <= block_positions.max(axis=1)[:, None])[:, :, None, None], v, 0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
