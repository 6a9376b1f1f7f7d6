"""What a model's forward reads about the batch: flat tokens in two sections and their page tables."""

from __future__ import annotations

from typing import NamedTuple

import jax


class ForwardBatch(NamedTuple):
    """Flat tokens: a prefill section of fixed-size query blocks, then a decode section of single tokens.

    Every prefill block holds `prefill_block_size` consecutive tokens of one sequence (padded), so the
    block can read that sequence's pages once; each decode token reads its own sequence's pages.
    Padding tokens point at the dummy page 0 and position 0.
    """

    input_ids: jax.Array  # i32[T], T = num_prefill_blocks * prefill_block_size + num_decode
    positions: jax.Array  # i32[T]
    out_cache_loc: jax.Array  # i32[T] flat KV slot (page * page_size + offset) each token's K/V goes to
    prefill_pages: jax.Array  # i32[num_prefill_blocks, pages_per_seq] page table row of each block
    decode_pages: jax.Array  # i32[num_decode, pages_per_seq] page table row of each decode token

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
