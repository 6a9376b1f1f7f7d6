"""Device buffers a step reads and writes, gathered in one donated `MemoryPools` pytree."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=["page_size"])
@dataclasses.dataclass(frozen=True)
class KVPool:
    """Paged K and V for every attention layer; page 0 is the dummy that padding writes into.

    Stored flat by slot (slot = page * page_size + offset) so a token write is a plain row scatter:
    with a [pages, page_size] layout XLA turns a one-token write into a dynamic-update-slice that
    copied the whole pool each layer (3.6 s instead of 44 ms per SmolLM2 decode step).
    """

    k: jax.Array  # f[num_layers, num_pages * page_size, kv_heads, head_dim]
    v: jax.Array  # f[num_layers, num_pages * page_size, kv_heads, head_dim]
    page_size: int

    @classmethod
    def create(cls, num_layers, num_pages, page_size, kv_heads, head_dim, dtype) -> KVPool:
        shape = (num_layers, num_pages * page_size, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), page_size)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1] // self.page_size


class PenaltyPool(NamedTuple):
    """Per-request token statistics for frequency/presence/repetition penalties; row 0 is the dummy."""

    output_counts: jax.Array  # i32[rows, vocab] times each token was generated
    prompt_seen: jax.Array  # bool[rows, vocab] token occurs in the prompt

    @classmethod
    def create(cls, rows: int, vocab_size: int) -> PenaltyPool:
        return cls(jnp.zeros((rows, vocab_size), jnp.int32), jnp.zeros((rows, vocab_size), jnp.bool_))


class MemoryPools(NamedTuple):
    """Everything a compiled step updates in place; passed with `donate_argnames=("pools",)`."""

    kv: KVPool
    penalty: PenaltyPool

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))


def kv_pool_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of K plus V one token occupies across all layers."""
    return 2 * num_layers * kv_heads * head_dim * np.dtype(dtype).itemsize
