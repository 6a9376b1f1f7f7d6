"""Plain-jnp paged attention: the CPU path and the oracle for the Pallas kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.backend import dispatched


def write_kv(
    k_pool: jax.Array,  # f[num_layers, num_slots, kv_heads, head_dim]
    v_pool: jax.Array,  # f[num_layers, num_slots, kv_heads, head_dim]
    layer: jax.Array | int,  # which layer's pages to write (may be a traced scan index)
    k: jax.Array,  # f[T, kv_heads, head_dim]
    v: jax.Array,  # f[T, kv_heads, head_dim]
    slots: jax.Array,  # i32[T] flat slot = page * page_size + offset; padding writes the dummy page 0
) -> tuple[jax.Array, jax.Array]:
    """Scatters new K/V into one layer of the pools; returns the updated pools.

    The pools hold all layers so that a `lax.scan` over layers can update them in place (a carry
    with a scatter is aliased by XLA; slicing a layer out and back would copy it every step).
    """
    return write_rows_op(k_pool, layer, k, slots), write_rows_op(v_pool, layer, v, slots)


def write_rows(pool: jax.Array, layer, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """pool[layer, slots[t]] = rows[t] in the pool's dtype (pool f[num_layers, num_slots, ...], rows
    f[T, *pool.shape[2:]]); a slot outside the pool is dropped."""
    return pool.at[layer, slots].set(rows.astype(pool.dtype), mode="drop")


write_rows_op = dispatched("write_rows", write_rows)


def paged_attention(
    q: jax.Array,  # f[T, heads, head_dim], T = num_blocks * block_size
    k_pool: jax.Array,  # f[num_layers, num_slots, kv_heads, head_dim], num_slots = num_pages * page_size
    v_pool: jax.Array,  # f[num_layers, num_slots, kv_heads, head_dim]
    layer: jax.Array | int,
    block_pages: jax.Array,  # i32[num_blocks, pages_per_seq] page table row of each query block's sequence
    positions: jax.Array,  # i32[T] absolute position of each query token
    *,
    page_size: int,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of each query block against its sequence's pages in layer `layer`.

    Every block of `block_size` consecutive queries belongs to one sequence (padding rows point at
    the dummy page 0). Key j of a sequence is visible to query t iff j <= positions[t] (and, with a
    `sliding_window` W, positions[t] - W < j), so the current tokens' K/V must already be written into
    the pool. Unused page-table entries may point anywhere: they sit past every query's position and
    are masked. With `soft_cap` c the scaled scores become c * tanh(scores / c) before masking (Gemma 2).
    Returns f[T, heads, head_dim].
    """
    num_tokens = q.shape[0]
    num_blocks = block_pages.shape[0]
    if num_tokens != num_blocks * block_size:
        raise ValueError(f"{num_tokens=} must equal {num_blocks=} * {block_size=}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1 (or None)")
    if block_size == 1:
        return decode_attention(q, k_pool, v_pool, layer, block_pages, positions, page_size=page_size,
                                scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    return prefill_attention(q, k_pool, v_pool, layer, block_pages, positions, page_size=page_size,
                             block_size=block_size, scale=scale, sliding_window=sliding_window,
                             soft_cap=soft_cap)


def prefill_attention_reference(
    q: jax.Array,  # f[T, heads, head_dim], T = num_blocks * block_size
    k_pool: jax.Array,  # f[num_layers, num_slots, kv_heads, head_dim]
    v_pool: jax.Array,
    layer: jax.Array | int,
    block_pages: jax.Array,  # i32[num_blocks, pages_per_seq]
    positions: jax.Array,  # i32[T]
    *,
    page_size: int,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """`paged_attention` for blocks of more than one query: each block's pages gathered (the whole page
    bucket), scored against every query of the block and masked. Returns f[T, heads, head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, pages_per_seq = block_pages.shape
    kv_heads = k_pool.shape[2]
    group = num_heads // kv_heads
    kv_len = pages_per_seq * page_size

    k = _gather_pages(k_pool, layer, block_pages, page_size, q.dtype)
    v = _gather_pages(v_pool, layer, block_pages, page_size, q.dtype)
    block_positions = positions.reshape(num_blocks, block_size)
    # Slots past the block's last position hold stale or foreign data: zero V there, since 0 * NaN = NaN
    # would otherwise leak a bad value from a page's previous owner into this sequence.
    v = jnp.where((jnp.arange(kv_len)[None, :] <= block_positions.max(axis=1)[:, None])[:, :, None, None],
                  v, 0)
    keys = jnp.arange(kv_len)[None, None, :]
    visible = keys <= block_positions[:, :, None]  # [blocks, block_size, kv_len]
    if sliding_window is not None:
        visible &= keys > block_positions[:, :, None] - sliding_window
    qb = q.reshape(num_blocks, block_size, kv_heads, group, head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qb, k, preferred_element_type=jnp.float32) * scale
    scores = _soft_cap(scores, soft_cap)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _gather_pages(pool: jax.Array, layer, pages: jax.Array, page_size: int, compute_dtype) -> jax.Array:
    """f[rows, pages_per_row * page_size, kv_heads, head_dim]: each row's pages of layer `layer`, in order,
    widened to `compute_dtype` where the pool is narrower (a bf16 pool under an f32 model)."""
    num_layers, num_slots, kv_heads, head_dim = pool.shape
    paged = pool.reshape(num_layers, num_slots // page_size, page_size, kv_heads, head_dim)
    rows = paged[layer, pages].reshape(pages.shape[0], pages.shape[1] * page_size, kv_heads, head_dim)
    return rows.astype(jnp.promote_types(rows.dtype, compute_dtype))


def decode_attention_reference(
    q: jax.Array,  # f[B, heads, head_dim], one query per sequence
    k_pool: jax.Array,  # f[num_layers, num_slots, kv_heads, head_dim]
    v_pool: jax.Array,
    layer: jax.Array | int,
    pages: jax.Array,  # i32[B, pages_per_seq]
    positions: jax.Array,  # i32[B]
    *,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """`paged_attention` with one query per sequence (block_size 1): the sequence's pages gathered, then
    `_decode_attention`. Returns f[B, heads, head_dim]."""
    kv_len = pages.shape[1] * page_size
    k = _gather_pages(k_pool, layer, pages, page_size, q.dtype)
    v = _gather_pages(v_pool, layer, pages, page_size, q.dtype)
    keys = jnp.arange(kv_len)[None, :]
    visible = keys <= positions[:, None]  # [B, kv_len]
    v = jnp.where(visible[:, :, None, None], v, 0)  # stale slots: 0 * NaN would leak (see paged_attention)
    if sliding_window is not None:
        visible &= keys > positions[:, None] - sliding_window
    return _decode_attention(q, k, v, visible, scale, soft_cap)


decode_attention = dispatched("decode_attention", decode_attention_reference)
prefill_attention = dispatched("prefill_attention", prefill_attention_reference)


def _decode_attention(
    q: jax.Array,  # f[B, heads, head_dim], one query per sequence
    k: jax.Array,  # f[B, S, kv_heads, head_dim], the sequence's gathered pages
    v: jax.Array,  # f[B, S, kv_heads, head_dim], zero at the slots not visible
    visible: jax.Array,  # bool[B, S]
    scale: float,
    soft_cap: float | None,
) -> jax.Array:
    """One query per sequence as two batched matmuls over the sequences, GQA by a block-diagonal query.

    Query head h = (kv head j, group g) is placed in rows j*head_dim..(j+1)*head_dim of a zero [kv_heads *
    head_dim, heads] matrix, so `k` [S, kv_heads * head_dim] times it gives every head's scores in one
    matmul without repeating K per group; `probs^T @ v` likewise gives each head against every kv head,
    of which the diagonal blocks are kept. The extra (kv_heads - 1) / kv_heads of FLOPs is cheap next to
    reading K and V, and XLA:CPU runs these as plain matmuls: measured 1.1 vs 1.7 ms per layer against a
    multiply-and-reduce form at 32 sequences x 144 tokens (SmolLM2 shapes). Masked scores are -inf, so a
    NaN in a slot past the sequence (or in another kv head's zeroed block) never reaches the output.
    """
    b, num_heads, head_dim = q.shape
    _, s, kv_heads, _ = k.shape
    group = num_heads // kv_heads
    eye = jnp.eye(kv_heads, dtype=q.dtype)
    # [B, kv_heads * head_dim, heads]: column (j, g) holds q[:, j*group + g] in rows of kv head j only.
    q_block = jnp.einsum("bjgd,ji->bidjg", q.reshape(b, kv_heads, group, head_dim), eye)
    q_block = q_block.reshape(b, kv_heads * head_dim, num_heads)
    k, v = k.reshape(b, s, kv_heads * head_dim), v.reshape(b, s, kv_heads * head_dim)
    scores = jnp.einsum("bse,beh->bsh", k, q_block, preferred_element_type=jnp.float32) * scale
    scores = _soft_cap(scores, soft_cap)
    scores = jnp.where(visible[:, :, None], scores, -jnp.inf)
    weights = jnp.exp(scores - scores.max(axis=1, keepdims=True))  # [B, S, heads]
    out = jnp.einsum("bsh,bse->bhe", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(b, kv_heads, group, kv_heads, head_dim)
    out = jnp.einsum("bjgid,ji->bjgd", out, eye.astype(out.dtype))  # keep head (j, g) against kv head j
    out = out / weights.sum(axis=1).reshape(b, kv_heads, group)[..., None]
    return out.reshape(b, num_heads, head_dim).astype(q.dtype)


def _soft_cap(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """Squashes scores into (-soft_cap, soft_cap); identity when soft_cap is None."""
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)
