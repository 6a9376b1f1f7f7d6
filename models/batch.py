"""What a model's forward reads about the batch: flat tokens in two sections and their page tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


class ForwardBatch(NamedTuple):
    """Flat tokens: a prefill section of fixed-size query blocks, then a decode section of single tokens.

    Every prefill block holds `prefill_block_size` consecutive tokens of one sequence (padded), so the
    block can read that sequence's pages once; each decode token reads its own sequence's pages.
    Padding tokens point at the dummy page 0 and position 0.

    Recurrent layers read the sequence structure from the slots: a sequence's prefill blocks are
    consecutive and share one slot (its request row), so block b starts a sequence's portion of this
    step iff b == 0 or its slot differs from block b-1's. That portion continues the state in the slot
    iff its first position is > 0, else it starts from zeros. Padding blocks and padding decode rows
    have slot 0 (the dummy slot) and length 0.

    A decode row reads its state from `decode_slots` and writes its final state to `decode_write_slots`
    (None: the same slots). Speculative decoding's draft rows continue the state of the row before them
    (kernels/chains.py): a request's first row reads and writes its slot, each draft row reads the slot
    the row before it writes and writes a scratch slot of its own.
    """

    input_ids: jax.Array  # i32[T], T = num_prefill_blocks * prefill_block_size + num_decode
    positions: jax.Array  # i32[T]
    out_cache_loc: jax.Array  # i32[T] flat KV slot (page * page_size + offset) each token's K/V goes to
    prefill_pages: jax.Array  # i32[num_prefill_blocks, pages_per_seq] page table row of each block
    decode_pages: jax.Array  # i32[num_decode, pages_per_seq] page table row of each decode token
    prefill_slots: jax.Array  # i32[num_prefill_blocks] recurrent state slot of each block's sequence
    prefill_lens: jax.Array  # i32[num_prefill_blocks] real (non-padding) tokens in each block
    decode_slots: jax.Array  # i32[num_decode] recurrent state slot of each decode token's sequence
    decode_write_slots: jax.Array | None = None  # i32[num_decode] slot each decode row's final state goes to
    # i32[4]: the real tokens are rows [live_rows[0], live_rows[1]) and [live_rows[2], live_rows[3]) (the used
    # prefill blocks, the used decode rows); products may skip the rest (kernels/cpu `live_rows`). None: all.
    live_rows: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_decode(self) -> int:
        return self.decode_pages.shape[0]

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode

    @property
    def prefill_block_size(self) -> int:
        blocks = self.prefill_pages.shape[0]
        return self.num_prefill_tokens // blocks if blocks else 0


def by_section(batch: ForwardBatch, prefill: Callable, decode: Callable, *tokens: jax.Array):
    """`prefill(*rows)` over the prefill section's rows of each `tokens` array f[T, ...], `decode(*rows)`
    over the decode section's, their results joined along the leading axis (every leaf of a pytree result,
    such as (output, final states), is concatenated: prefill rows first, as in the batch).

    A section without tokens is not run: its function may assume at least one block or one decode row.
    """
    num_prefill = batch.num_prefill_tokens
    parts = []
    if num_prefill:
        parts.append(prefill(*(x[:num_prefill] for x in tokens)))
    if batch.num_decode:
        parts.append(decode(*(x[num_prefill:] for x in tokens)))
    if len(parts) == 1:
        return parts[0]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts)


class PrefillSegments(NamedTuple):
    """How the prefill blocks group into sequences, for recurrent layers (see ForwardBatch)."""

    slots: jax.Array  # i32[num_blocks] state slot of each block's sequence (0: padding)
    lens: jax.Array  # i32[num_blocks] real tokens in each block (only a sequence's last block is partial)
    starts: jax.Array  # bool[num_blocks] first block of its sequence in this step
    ends: jax.Array  # bool[num_blocks] last block of its sequence in this step
    has_init: jax.Array  # bool[num_blocks] the sequence continues the state in its slot (first position > 0)


def prefill_segments(batch: ForwardBatch) -> PrefillSegments:
    """Derives the per-block sequence structure of the prefill section (traceable)."""
    slots = batch.prefill_slots
    change = slots[1:] != slots[:-1]
    edge = jnp.ones((min(1, slots.shape[0]),), bool)  # empty when there are no prefill blocks
    starts = jnp.concatenate([edge, change])
    ends = jnp.concatenate([change, edge])
    bs = batch.prefill_block_size
    first_positions = batch.positions[: batch.num_prefill_tokens : bs] if bs else batch.positions[:0]
    return PrefillSegments(slots, batch.prefill_lens, starts, ends, first_positions > 0)
