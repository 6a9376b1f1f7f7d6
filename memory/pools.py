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

    For MLA (a latent pool) each token keeps one compressed vector that serves as both key and value:
    it lives in `k` (kv_heads 1, head_dim kv_lora_rank + rope_dim) and `v` is None.

    Stored flat by slot (slot = page * page_size + offset) so a token write is a plain row scatter:
    with a [pages, page_size] layout XLA turns a one-token write into a dynamic-update-slice that
    copied the whole pool each layer (3.6 s instead of 44 ms per SmolLM2 decode step).
    """

    k: jax.Array  # f[num_layers, num_pages * page_size, kv_heads, head_dim]
    v: jax.Array | None  # f[num_layers, num_pages * page_size, kv_heads, head_dim]; None for a latent pool
    page_size: int

    @classmethod
    def create(
        cls, num_layers, num_pages, page_size, kv_heads, head_dim, dtype, *, latent: bool = False
    ) -> KVPool:
        shape = (num_layers, num_pages * page_size, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), None if latent else jnp.zeros(shape, dtype), page_size)

    @property
    def num_pages(self) -> int:
        return self.k.shape[1] // self.page_size


class PenaltyPool(NamedTuple):
    """Per-request-row token state: the statistics of frequency/presence/repetition penalties, and the last
    sampled token; row 0 is the dummy."""

    output_counts: jax.Array  # i32[rows, vocab] times each token was generated
    prompt_seen: jax.Array  # bool[rows, vocab] token occurs in the prompt
    # i32[rows] the token each row's decode row sampled last: a step dispatched before the previous one's
    # tokens reach the host (the overlap schedule, scheduler/stepping.py) feeds placeholders read from here
    last_ids: jax.Array

    @classmethod
    def create(cls, rows: int, vocab_size: int) -> PenaltyPool:
        return cls(jnp.zeros((rows, vocab_size), jnp.int32), jnp.zeros((rows, vocab_size), jnp.bool_),
                   jnp.zeros((rows,), jnp.int32))


@dataclasses.dataclass(frozen=True)
class RecurrentSpec:
    """Per-slot state shapes of a model's recurrent layers (SSM or linear attention).

    The SSM/linear-attention state is float32 whatever the model dtype (it accumulates over the whole
    sequence); the conv state holds the last `conv_kernel - 1` inputs and uses the model dtype.
    """

    num_layers: int  # layers that own a recurrent state
    ssm_shape: tuple[int, ...]  # per slot, e.g. (heads, head_dim, state) for Mamba-2
    conv_shape: tuple[int, ...] | None = None  # per slot, e.g. (channels, conv_kernel - 1); None: no conv
    # ssm_shape[0] is heads and the conv channels come grouped by head (models/fused.py): tensor parallelism
    # splits both with the layers' weights (runtime/mesh.py); else they stay whole on every device.
    split_heads: bool = False

    def __post_init__(self):
        if self.num_layers <= 0 or not self.ssm_shape or min(self.ssm_shape) <= 0:
            raise ValueError(f"bad recurrent spec: {self.num_layers=}, {self.ssm_shape=}")

    def bytes_per_slot(self, dtype) -> int:
        conv = int(np.prod(self.conv_shape)) * np.dtype(dtype).itemsize if self.conv_shape else 0
        return self.num_layers * (int(np.prod(self.ssm_shape)) * 4 + conv)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a model keeps per request: paged KV for its attention layers, a state slot for its recurrent
    ones."""

    num_kv_layers: int  # attention layers owning KV pages (0: none, e.g. pure Mamba)
    num_kv_heads: int = 0
    head_dim: int = 0
    recurrent: RecurrentSpec | None = None
    latent_kv: bool = False  # MLA: one vector per token and layer serves as key and value (KVPool.v is None)

    def __post_init__(self):
        if self.num_kv_layers < 0 or (self.num_kv_layers and min(self.num_kv_heads, self.head_dim) <= 0):
            raise ValueError(f"bad cache spec: {self.num_kv_layers=}, {self.num_kv_heads=}, {self.head_dim=}")
        if not self.num_kv_layers and self.recurrent is None:
            raise ValueError("a model needs attention layers or recurrent layers")
        if self.latent_kv and self.num_kv_heads != 1:
            raise ValueError(f"a latent KV pool has one vector per token, not {self.num_kv_heads=}")

    @property
    def has_kv(self) -> bool:
        return self.num_kv_layers > 0

    def kv_bytes_per_token(self, dtype) -> int:
        """Bytes one token occupies in the KV pool across all attention layers."""
        per_layer = self.num_kv_heads * self.head_dim * np.dtype(dtype).itemsize
        return self.num_kv_layers * per_layer * (1 if self.latent_kv else 2)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ssm", "conv"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RecurrentStatePool:
    """Fixed-size state per request slot for every recurrent layer; slot 0 is the dummy padding writes into.

    A request's slot is its `ReqToTokenPool` row, held from admission to finish, abort or retraction.
    A sequence whose first token this step is at position 0 starts from zeros (whatever the slot held);
    one at a later position continues from the state in its slot.
    """

    ssm: jax.Array  # f32[num_layers, slots, *ssm_shape]
    conv: jax.Array | None  # dtype[num_layers, slots, *conv_shape] last conv inputs, oldest first

    @classmethod
    def create(cls, spec: RecurrentSpec, num_slots: int, dtype) -> RecurrentStatePool:
        ssm = jnp.zeros((spec.num_layers, num_slots, *spec.ssm_shape), jnp.float32)
        conv = (None if spec.conv_shape is None
                else jnp.zeros((spec.num_layers, num_slots, *spec.conv_shape), dtype))
        return cls(ssm, conv)

    @property
    def num_slots(self) -> int:
        return self.ssm.shape[1]


def copy_state_slots(dst: RecurrentStatePool, src: RecurrentStatePool | None,
                     pairs: jax.Array) -> RecurrentStatePool:
    """`dst` with slot `pairs[i, 1]` set to `src`'s slot `pairs[i, 0]` (every layer, SSM and conv state), for
    the leading rows i of `pairs` (i32[n, 2]) before the first with a 0 (the dummy slot) in either column.
    `src` None: copies between slots of `dst` itself (no source slot may be a destination).

    A loop of one-slot slices rather than one gather/scatter of all rows: its cost is the copies actually
    made, so a step with none pays nothing for the rows it could have held; `dst` is updated in place.
    (Passing `dst` as `src` too would keep the pool's old value alive beside the loop's: XLA copies the
    whole pool for that, 0.3 s a step for a 24-layer Mamba-2 pool.)
    """
    n = pairs.shape[0]
    if n == 0:
        return dst

    def more(carry):
        i = carry[0]
        row = pairs[jnp.minimum(i, n - 1)]
        return (i < n) & (row[0] > 0) & (row[1] > 0)

    def copy(carry):
        i, *arrays = carry
        sources = arrays if src is None else jax.tree.leaves(src)
        out = [jax.lax.dynamic_update_slice_in_dim(d, jax.lax.dynamic_slice_in_dim(s, pairs[i, 0], 1, axis=1),
                                                   pairs[i, 1], axis=1)
               for d, s in zip(arrays, sources)]
        return (i + 1, *out)

    _, *arrays = jax.lax.while_loop(more, copy, (jnp.int32(0), *jax.tree.leaves(dst)))
    return jax.tree.unflatten(jax.tree.structure(dst), arrays)


class MemoryPools(NamedTuple):
    """Everything a compiled step updates in place; passed with `donate_argnames=("pools",)`.

    A model reads and replaces `kv` and `recurrent` (either may be None when it has no such layers);
    the step updates `penalty`, and copies states between `recurrent` and `snapshots` (the prefix cache's
    saved states, scheduler/prefix_cache.py; None without one) before and after the model.
    """

    kv: KVPool | None
    penalty: PenaltyPool
    recurrent: RecurrentStatePool | None = None
    snapshots: RecurrentStatePool | None = None

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))


def kv_pool_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of K plus V one token occupies across all layers."""
    return 2 * num_layers * kv_heads * head_dim * np.dtype(dtype).itemsize
