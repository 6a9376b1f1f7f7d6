"""Ragged paged attention and KV writes as TPU Pallas kernels: pages DMA'd from HBM, online softmax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.pallas_common import dot

# Keys per chunk the default `pages_per_chunk` aims at: a chunk is one [rows, keys] score tile per
# KV head, so a few hundred keys keep the MXU busy while the K/V double buffer stays well under VMEM.
TARGET_KEYS_PER_CHUNK = 256
WRITE_TOKENS_PER_STEP = 64  # tokens whose K/V rows one write_kv grid step copies into the pools


def _interpret_params(interpret: bool):
    # The kernels use DMAs, semaphores and VMEM scratch, which only the TPU interpreter models.
    return pltpu.InterpretParams() if interpret else False


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
    pages_per_chunk: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`reference.paged_attention` as one Pallas kernel; same arguments and result, plus:

    `pages_per_chunk`: pages of K/V fetched and scored per online-softmax step (default: about
    TARGET_KEYS_PER_CHUNK keys). `interpret`: run in the TPU interpreter (CPU tests).

    One grid step per query block. The page tables, the layer index and each block's chunk range and
    last position are scalar-prefetched (SMEM); the block walks its sequence's keys chunk by chunk,
    DMAing the next chunk's pages from the pool in HBM into one half of a VMEM double buffer while it
    scores the current chunk (flash-attention online softmax, float32 statistics). Only the chunks that
    hold a key some query of the block can see are visited, and pages past the block's last position are
    never read, so unused page-table entries cost nothing and their contents (NaN included) cannot leak.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, pages_per_seq = block_pages.shape
    num_layers, num_slots, kv_heads, _ = k_pool.shape
    if num_tokens != num_blocks * block_size:
        raise ValueError(f"{num_tokens=} must equal {num_blocks=} * {block_size=}")
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads=} must be a multiple of {kv_heads=}")
    if num_slots % page_size:
        raise ValueError(f"{page_size=} must divide {num_slots=}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be >= 1 (or None)")
    if num_blocks == 0:
        return jnp.zeros_like(q)
    group = num_heads // kv_heads
    rows = block_size * group  # query rows per KV head: token-major, the group's heads adjacent
    if pages_per_chunk is None:
        pages_per_chunk = max(1, TARGET_KEYS_PER_CHUNK // page_size)
    pages_per_chunk = min(pages_per_chunk, pages_per_seq)
    num_chunks = pl.cdiv(pages_per_seq, pages_per_chunk)
    chunk_keys = pages_per_chunk * page_size

    with jax.named_scope("paged_attention_layout"):
        # Heads sharing a KV head become the rows of one [rows, head_dim] query matrix per KV head.
        qb = q.reshape(num_blocks, block_size, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
        qb = qb.reshape(num_blocks, kv_heads, rows, head_dim)
        block_positions = positions.astype(jnp.int32).reshape(num_blocks, block_size)
        row_positions = jnp.repeat(block_positions, group, axis=1)[:, :, None]  # i32[num_blocks, rows, 1]
        chunk_range = _chunk_range(block_positions, chunk_keys, sliding_window)  # i32[num_blocks, 4]
        # Entries past the table (to a whole chunk) are never fetched; padding keeps SMEM reads in bounds.
        pages = jnp.pad(
            block_pages.astype(jnp.int32), ((0, 0), (0, num_chunks * pages_per_chunk - pages_per_seq))
        )
        layer_index = jnp.asarray(layer, jnp.int32).reshape(1)
        # A slot's heads side by side on the lane axis (a free reshape): head h of a fetched chunk is a
        # lane slice, and few KV heads do not pad VMEM tiles as a [slots, kv_heads, head_dim] buffer would.
        k_slots = k_pool.reshape(num_layers, num_slots, kv_heads * head_dim)
        v_slots = v_pool.reshape(num_layers, num_slots, kv_heads * head_dim)

    kernel = functools.partial(
        _attention_kernel,
        head_dim=head_dim,
        page_size=page_size,
        padded_pages_per_seq=num_chunks * pages_per_chunk,
        pages_per_chunk=pages_per_chunk,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,  # layer_index, pages (flat), chunk_range (flat)
        grid=(num_blocks,),
        in_specs=[
            pl.BlockSpec((None, kv_heads, rows, head_dim), lambda b, *_: (b, 0, 0, 0)),
            pl.BlockSpec((None, rows, 1), lambda b, *_: (b, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((None, kv_heads, rows, head_dim), lambda b, *_: (b, 0, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, chunk_keys, kv_heads * head_dim), k_pool.dtype),  # K double buffer
            pltpu.VMEM((2, chunk_keys, kv_heads * head_dim), v_pool.dtype),  # V double buffer
            pltpu.SemaphoreType.DMA((2, 2)),  # [K or V, buffer half]
            pltpu.VMEM((kv_heads, rows, 1), jnp.float32),  # running max
            pltpu.VMEM((kv_heads, rows, 1), jnp.float32),  # running denominator
            pltpu.VMEM((kv_heads, rows, head_dim), jnp.float32),  # running numerator
        ],
    )
    kv_bytes = 2 * num_blocks * pages_per_seq * page_size * kv_heads * head_dim * k_pool.dtype.itemsize
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_blocks, kv_heads, rows, head_dim), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=pl.CostEstimate(
            flops=4 * num_tokens * num_heads * pages_per_seq * page_size * head_dim,
            transcendentals=num_tokens * num_heads * pages_per_seq * page_size,
            bytes_accessed=kv_bytes + 2 * q.size * q.dtype.itemsize,  # an upper bound: all pages read
        ),
        interpret=_interpret_params(interpret),
        name="ragged_paged_attention",
    )(layer_index, pages.reshape(-1), chunk_range.reshape(-1), qb, row_positions, k_slots, v_slots)
    out = out.reshape(num_blocks, kv_heads, block_size, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(num_tokens, num_heads, head_dim)


def _chunk_range(
    block_positions: jax.Array,  # i32[num_blocks, block_size]
    chunk_keys: int,
    sliding_window: int | None,
) -> jax.Array:
    """Per block (start, first, end, last): the kernel loops over steps start..end-1; a step below `first`
    visits chunk 0, any other step the chunk of its own number.

    `last` is the block's last position and `end` one past its chunk. Without a window `first` is 0. With a
    window W, `first` is the chunk of the earliest key a real query can see (min position - W + 1).
    Padding rows (position 0 after row 0) see only key 0: when the window skips chunk 0, one extra
    step visits it first (start = first - 1) so they get exactly the reference's value.
    """
    last = block_positions.max(axis=1)
    end = last // chunk_keys + 1
    if sliding_window is None:
        zeros = jnp.zeros_like(end)
        return jnp.stack([zeros, zeros, end, last], axis=1)
    row = jnp.arange(block_positions.shape[1])[None, :]
    padding = (row > 0) & (block_positions == 0)
    lowest = jnp.where(padding, last[:, None], block_positions - sliding_window + 1).min(axis=1)
    first = jnp.maximum(lowest, 0) // chunk_keys
    start = first - ((first > 0) & padding.any(axis=1)).astype(jnp.int32)
    return jnp.stack([start, first, end, last], axis=1)


def _attention_kernel(
    layer_ref,  # SMEM i32[1]
    pages_ref,  # SMEM i32[num_blocks * padded_pages_per_seq]
    range_ref,  # SMEM i32[num_blocks * 4] (start, first, end, last) of each block: see _chunk_range
    q_ref,  # VMEM f[kv_heads, rows, head_dim]
    pos_ref,  # VMEM i32[rows, 1] position of each query row
    k_hbm,  # HBM f[num_layers, num_slots, kv_heads * head_dim]
    v_hbm,  # HBM f[num_layers, num_slots, kv_heads * head_dim]
    o_ref,  # VMEM f[kv_heads, rows, head_dim]
    k_buf,  # VMEM f[2, chunk_keys, kv_heads * head_dim]
    v_buf,  # VMEM f[2, chunk_keys, kv_heads * head_dim]
    sems,  # DMA semaphores [2 (K, V), 2 (buffer half)]
    m_ref,  # VMEM f32[kv_heads, rows, 1]
    l_ref,  # VMEM f32[kv_heads, rows, 1]
    acc_ref,  # VMEM f32[kv_heads, rows, head_dim]
    *,
    head_dim: int,
    page_size: int,
    padded_pages_per_seq: int,
    pages_per_chunk: int,
    scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    b = pl.program_id(0)
    kv_heads, rows, _ = q_ref.shape
    chunk_keys = pages_per_chunk * page_size
    layer = layer_ref[0]
    start, first, end, last = (range_ref[4 * b + i] for i in range(4))

    def page_copies(step, half, i):
        """K and V copies of page i of the chunk visited at `step` into buffer half `half`."""
        page = pages_ref[b * padded_pages_per_seq + _chunk(step, first) * pages_per_chunk + i]
        src, dst = pl.ds(page * page_size, page_size), pl.ds(i * page_size, page_size)
        return (
            pltpu.make_async_copy(k_hbm.at[layer, src], k_buf.at[half, dst], sems.at[0, half]),
            pltpu.make_async_copy(v_hbm.at[layer, src], v_buf.at[half, dst], sems.at[1, half]),
        )

    def pages_needed(step):
        # Pages past the last position are never read (unused table entries may point anywhere). lax.div
        # and lax.rem below, not // and %: the operands are non-negative, and Mosaic lowers those via sign.
        return jnp.minimum(
            pages_per_chunk, lax.div(last, page_size) - _chunk(step, first) * pages_per_chunk + 1
        )

    def start_fetch(step, half):
        @pl.loop(0, pages_needed(step))
        def _(i):
            for copy in page_copies(step, half, i):
                copy.start()

    def wait_fetch(step, half):
        @pl.loop(0, pages_needed(step))
        def _(i):
            for copy in page_copies(step, half, i):
                copy.wait()

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    row_pos = pos_ref[...]  # i32[rows, 1]
    start_fetch(start, 0)

    @pl.loop(start, end)
    def _(step):
        half = lax.rem(step - start, 2)

        @pl.when(step + 1 < end)
        def _():
            start_fetch(step + 1, 1 - half)

        wait_fetch(step, half)
        chunk = _chunk(step, first)
        keys = chunk * chunk_keys + jax.lax.broadcasted_iota(jnp.int32, (1, chunk_keys), 1)  # i32[1, keys]
        visible = keys <= row_pos  # bool[rows, chunk_keys]
        if sliding_window is not None:
            visible &= keys > row_pos - sliding_window
        # Slots past the last position were not fetched this chunk (stale or uninitialized VMEM, maybe
        # NaN): zero V there, since a zero weight times NaN is still NaN.
        key_col = chunk * chunk_keys + jax.lax.broadcasted_iota(jnp.int32, (chunk_keys, 1), 0)
        fetched = key_col <= last  # bool[chunk_keys, 1]
        for h in range(kv_heads):
            heads = pl.ds(h * head_dim, head_dim)
            k = k_buf[half, :, heads]  # [chunk_keys, head_dim]
            v = jnp.where(fetched, v_buf[half, :, heads], 0)
            scores = dot(q_ref[h], k, (1, 1)) * scale  # f32[rows, chunk_keys]
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            scores = jnp.where(visible, scores, -jnp.inf)
            m_prev = m_ref[h]
            m_next = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
            # A row with nothing visible yet keeps max -inf; shifting by 0 then keeps exp() at 0, not NaN.
            shift = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            alpha = jnp.exp(m_prev - shift)
            probs = jnp.exp(scores - shift)
            l_ref[h] = alpha * l_ref[h] + probs.sum(axis=1, keepdims=True)
            acc_ref[h] = alpha * acc_ref[h] + dot(probs.astype(v.dtype), v, (1, 0))
            m_ref[h] = m_next

    # Every row sees at least its own key, so the denominator is positive.
    o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def _chunk(step: jax.Array, first: jax.Array) -> jax.Array:
    """The chunk a block's loop visits at `step`: chunk 0 for the steps before `first` (see _chunk_range)."""
    return jnp.where(step < first, 0, step)


def write_kv(
    k_pool: jax.Array,  # f[num_layers, num_slots, kv_heads, head_dim]
    v_pool: jax.Array,  # f[num_layers, num_slots, kv_heads, head_dim]
    layer: jax.Array | int,  # which layer's pages to write (may be a traced scan index)
    k: jax.Array,  # f[T, kv_heads, head_dim]
    v: jax.Array,  # f[T, kv_heads, head_dim]
    slots: jax.Array,  # i32[T] flat slot = page * page_size + offset; padding writes the dummy page 0
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`reference.write_kv` as a Pallas kernel: each token's K/V row is DMA'd to its slot of the pools.

    The pools are aliased in and out (updated in place when the caller donates them); only the T
    written rows move. Several padding tokens may write the dummy slot; which one lands is unspecified,
    as in the reference's scatter.
    """
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return k_pool, v_pool
    tile = min(WRITE_TOKENS_PER_STEP, num_tokens)
    padded = pl.cdiv(num_tokens, tile) * tile
    # Rows of kv_heads * head_dim lanes, as paged_attention reads them (free reshapes of the pools).
    pad = ((0, padded - num_tokens), (0, 0))
    k = jnp.pad(k.astype(k_pool.dtype).reshape(num_tokens, -1), pad)  # f[padded, kv_heads * head_dim]
    v = jnp.pad(v.astype(v_pool.dtype).reshape(num_tokens, -1), pad)
    slots = jnp.pad(slots.astype(jnp.int32), (0, padded - num_tokens))
    layer_index = jnp.asarray(layer, jnp.int32).reshape(1)
    k_slots = k_pool.reshape(*k_pool.shape[:2], kv_heads * head_dim)
    v_slots = v_pool.reshape(*v_pool.shape[:2], kv_heads * head_dim)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # layer_index, slots
        grid=(padded // tile,),
        in_specs=[
            pl.BlockSpec((tile, kv_heads * head_dim), lambda i, *_: (i, 0)),
            pl.BlockSpec((tile, kv_heads * head_dim), lambda i, *_: (i, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
    )
    k_slots, v_slots = pl.pallas_call(
        functools.partial(_write_kernel, num_tokens=num_tokens),
        grid_spec=grid_spec,
        out_shape=(
            jax.ShapeDtypeStruct(k_slots.shape, k_slots.dtype),
            jax.ShapeDtypeStruct(v_slots.shape, v_slots.dtype),
        ),
        input_output_aliases={4: 0, 5: 1},  # operands: layer_index, slots, k, v, k_pool, v_pool
        # Steps write disjoint rows, except padding tokens all hitting the dummy slot (any one may win).
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=_interpret_params(interpret),
        name="write_kv",
    )(layer_index, slots, k, v, k_slots, v_slots)
    return k_slots.reshape(k_pool.shape), v_slots.reshape(v_pool.shape)


def _write_kernel(
    layer_ref,  # SMEM i32[1]
    slots_ref,  # SMEM i32[padded_tokens]
    k_ref,  # VMEM f[tile, kv_heads * head_dim]
    v_ref,  # VMEM f[tile, kv_heads * head_dim]
    k_pool_in,  # HBM, aliased to k_pool_out
    v_pool_in,  # HBM, aliased to v_pool_out
    k_pool_out,  # HBM f[num_layers, num_slots, kv_heads * head_dim]
    v_pool_out,  # HBM f[num_layers, num_slots, kv_heads * head_dim]
    sems,  # DMA semaphores [K, V]
    *,
    num_tokens: int,
):
    del k_pool_in, v_pool_in  # the same buffers as the outputs
    tile = k_ref.shape[0]
    base = pl.program_id(0) * tile
    layer = layer_ref[0]

    def copies(i):
        slot = slots_ref[base + i]
        return (
            pltpu.make_async_copy(k_ref.at[i], k_pool_out.at[layer, slot], sems.at[0]),
            pltpu.make_async_copy(v_ref.at[i], v_pool_out.at[layer, slot], sems.at[1]),
        )

    # All of the tile's copies are in flight at once; the tail past num_tokens is padding.
    @pl.loop(0, tile)
    def _(i):
        @pl.when(base + i < num_tokens)
        def _():
            for copy in copies(i):
                copy.start()

    @pl.loop(0, tile)
    def _(i):
        @pl.when(base + i < num_tokens)
        def _():
            for copy in copies(i):
                copy.wait()
