"""A step's recurrent states: each layer reads its rows from the slot pool, all layers write back once at the end.

Rows are the prefill blocks followed by the decode rows (R = num_prefill_blocks + num_decode). Reading a
layer's rows from the step's input pool and scattering every layer's final states after the layer loop
keeps the pool out of the loop carry: XLA copies a carried buffer that is both gathered from and scattered
into (the whole pool, every layer), but updates a donated one in place after the loop.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from memory import RecurrentStatePool
from models.batch import ForwardBatch, prefill_segments


class StateRows(NamedTuple):
    """Which slot each state row starts from and where its final state goes."""

    read_slots: jax.Array  # i32[R] slot a row's initial state comes from (0 where it starts from zeros)
    has_init: jax.Array  # bool[R] the row starts from its slot's state (else zeros)
    write_slots: jax.Array  # i32[R] slot a row's final state goes to (0, the dummy, unless it ends a sequence)
    starts: jax.Array  # bool[num_prefill_blocks] block starts its sequence's portion (its row's state is used)
    lens: jax.Array  # i32[num_prefill_blocks] real tokens in each block


def state_rows(batch: ForwardBatch) -> StateRows:
    seg = prefill_segments(batch)
    init = seg.starts & seg.has_init
    decode_real = batch.decode_slots > 0
    return StateRows(
        read_slots=jnp.concatenate([jnp.where(init, seg.slots, 0), batch.decode_slots]),
        has_init=jnp.concatenate([init, decode_real]),
        write_slots=jnp.concatenate([jnp.where(seg.ends, seg.slots, 0), batch.decode_slots]),
        starts=seg.starts,
        lens=seg.lens,
    )


class LayerStates(NamedTuple):
    """One layer's states for the rows of a step (see StateRows)."""

    ssm: jax.Array  # f32[R, *ssm_shape]
    conv: jax.Array | None  # [R, *conv_shape]


def read_layer_states(pool: RecurrentStatePool, layer: jax.Array | int, rows: StateRows) -> LayerStates:
    """Layer `layer`'s initial states: the slot's state, or zeros for rows that start fresh."""

    def read(x):
        got = x[layer, rows.read_slots]
        return jnp.where(rows.has_init.reshape(-1, *([1] * (got.ndim - 1))), got, jnp.zeros((), got.dtype))

    return LayerStates(read(pool.ssm), None if pool.conv is None else read(pool.conv))


def write_states(pool: RecurrentStatePool, rows: StateRows, finals: LayerStates) -> RecurrentStatePool:
    """Scatters every layer's final states (finals.ssm f32[num_layers, R, ...]) into the rows' slots."""
    ssm = pool.ssm.at[:, rows.write_slots].set(finals.ssm.astype(pool.ssm.dtype))
    conv = None if pool.conv is None else pool.conv.at[:, rows.write_slots].set(finals.conv.astype(pool.conv.dtype))
    return RecurrentStatePool(ssm, conv)


def split_rows(states: LayerStates, num_prefill_blocks: int) -> tuple[LayerStates, LayerStates]:
    """(prefill block rows, decode rows) of one layer's states."""
    def part(sl):
        return LayerStates(states.ssm[sl], None if states.conv is None else states.conv[sl])

    return part(slice(0, num_prefill_blocks)), part(slice(num_prefill_blocks, None))


def concat_rows(parts: list[LayerStates]) -> LayerStates:
    if len(parts) == 1:
        return parts[0]
    ssm = jnp.concatenate([p.ssm for p in parts])
    conv = None if parts[0].conv is None else jnp.concatenate([p.conv for p in parts])
    return LayerStates(ssm, conv)
