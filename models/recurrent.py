"""A step's recurrent states: each layer gathers its rows from the slot pool, scatters its final states back.

Rows are the prefill blocks followed by the decode rows (R = num_prefill_blocks + num_decode). The pool
rides in the layer loop's carry and is updated in place. A step with a single row (one decode token) adds
a dummy row on slot 0 that is gathered and scattered but never computed, keeping every gather/scatter at
>= 2 indices: with one index XLA turns them into a dynamic-slice / dynamic-update-slice pair on the
carried pool and then copies the whole pool twice per layer (most of a 287 ms Mamba-2-130m decode step
at batch 1; 2.4 s in a 33-slot toy).
With the native CPU kernels, decode-only Mamba-2 steps skip all of this: each layer's states are updated where
they live in the pools (`InPlace`, kernels/cpu/ssd.cc).
Decode rows may form chains (speculative draft rows, kernels/chains.py): a chained row's gathered initial
state is replaced by the final state of the row before it (`decode_chained`, `run_chained`), and each
decode row's final state goes to its own write slot (a scratch slot for a draft row).
The alternative of emitting the finals as scan outputs and scattering once after the loop costs a
transpose of all layers' states ([L, R] -> [R, L], 480 ms at batch 32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.chains import chain_links, run_chained
from kernels.cpu import native_in_use
from memory import RecurrentStatePool
from models.batch import ForwardBatch, prefill_segments
from models.layers.stack import scan_layers


class StateRows(NamedTuple):
    """Which slot each state row starts from and where its final state goes."""

    read_slots: jax.Array  # i32[R (+1)] slot a row's initial state comes from (0 where it starts from zeros)
    has_init: jax.Array  # bool[R (+1)] the row starts from its slot's state (else zeros)
    # i32[R (+1)] slot a row's final state goes to (0, the dummy, unless it ends a sequence)
    write_slots: jax.Array
    # bool[num_prefill_blocks] block starts its sequence's portion (its row's state is used)
    starts: jax.Array
    lens: jax.Array  # i32[num_prefill_blocks] real tokens in each block
    padded: bool  # the slot arrays end with the dummy row (only when R == 1)
    # i32[num_decode] slot each decode row's final state goes to (None: the slot it reads)
    decode_write_slots: jax.Array | None = None


def state_rows(batch: ForwardBatch) -> StateRows:
    seg = prefill_segments(batch)
    init = seg.starts & seg.has_init
    decode_real = batch.decode_slots > 0
    padded = seg.slots.shape[0] + batch.num_decode == 1
    dummy = jnp.zeros((int(padded),), jnp.int32)
    decode_writes = batch.decode_slots if batch.decode_write_slots is None else batch.decode_write_slots
    return StateRows(
        read_slots=jnp.concatenate([jnp.where(init, seg.slots, 0), batch.decode_slots, dummy]),
        has_init=jnp.concatenate([init, decode_real, dummy.astype(bool)]),
        write_slots=jnp.concatenate([jnp.where(seg.ends, seg.slots, 0), decode_writes, dummy]),
        starts=seg.starts,
        lens=seg.lens,
        padded=padded,
        decode_write_slots=batch.decode_write_slots,
    )


def decode_chained(batch: ForwardBatch) -> jax.Array | None:
    """bool[num_decode]: decode row i continues row i - 1's state (a draft row); None when the step cannot
    have chains (no write slots of their own)."""
    if batch.decode_write_slots is None or batch.num_decode < 2:
        return None
    return chain_links(batch.decode_slots, batch.decode_write_slots)


def decode_rows(step: Callable, states: LayerStates, batch: ForwardBatch):
    """`step(states) -> (out, finals)` over a step's decode rows, chained rows continuing the row before
    them (`kernels.chains.run_chained`)."""
    return run_chained(step, states, decode_chained(batch))


class InPlace(NamedTuple):
    """A decode-only step's SSM or conv states left where they live: the whole pool, to be updated in place
    by a native CPU kernel (kernels/cpu/ssd.cc) instead of gathered, updated and scattered back by XLA."""

    pool: jax.Array  # [layers, slots, *state_shape]
    layer: jax.Array  # i32[] this layer
    slots: jax.Array  # i32[D] each decode row's slot (read)
    write_slots: jax.Array | None = None  # i32[D] where each row's final state goes (None: `slots`)


class LayerStates(NamedTuple):
    """One layer's states for the rows of a step (see StateRows)."""

    ssm: jax.Array | InPlace  # f32[R, *ssm_shape]
    conv: jax.Array | InPlace | None  # [R, *conv_shape]


def read_layer_states(pool: RecurrentStatePool, layer: jax.Array | int, rows: StateRows,
                      in_place: bool = False) -> LayerStates:
    """Layer `layer`'s initial states for the R rows: the slot's state, or zeros for rows that start fresh.
    `in_place` (decode-only steps): the states stay in the pools (`InPlace`)."""

    nb = rows.starts.shape[0]

    def read(x):
        got = x[layer, rows.read_slots]
        # Only prefill rows can start fresh (a decode row always continues; a padding one reads the dummy
        # slot, whose finite garbage stays in that row): selecting over decode rows would be another pass.
        fresh = ~rows.has_init[:nb].reshape(-1, *([1] * (got.ndim - 1)))
        got = got.at[:nb].set(jnp.where(fresh, jnp.zeros((), got.dtype), got[:nb])) if nb else got
        return got[:-1] if rows.padded else got  # without the dummy row

    if in_place:  # a decode-only step: the rows are the decode rows (then the dummy, when padded)
        slots = rows.read_slots[: rows.read_slots.shape[0] - int(rows.padded)]
        writes = rows.decode_write_slots
        layer = jnp.asarray(layer, jnp.int32)
        conv = None if pool.conv is None else InPlace(pool.conv, layer, slots, writes)
        return LayerStates(InPlace(pool.ssm, layer, slots, writes), conv)
    return LayerStates(read(pool.ssm), None if pool.conv is None else read(pool.conv))


def write_layer_states(
    pool: RecurrentStatePool, layer: jax.Array | int, rows: StateRows, final: LayerStates
) -> RecurrentStatePool:
    """Scatters layer `layer`'s final states (R rows) into the rows' slots; returns the updated pool. States
    updated in place (`InPlace`) come back as the whole pool."""

    def write(x, new):
        if isinstance(new, InPlace):
            return new.pool
        new = new.astype(x.dtype)
        if rows.padded:
            new = jnp.concatenate([new, jnp.zeros((1, *new.shape[1:]), x.dtype)])  # + the dummy row
        return x.at[layer, rows.write_slots].set(new)

    return RecurrentStatePool(write(pool.ssm, final.ssm),
                              None if pool.conv is None else write(pool.conv, final.conv))


def split_rows(states: LayerStates, num_prefill_blocks: int) -> tuple[LayerStates, LayerStates]:
    """(prefill block rows, decode rows) of one layer's states."""
    def part(sl):
        return LayerStates(states.ssm[sl], None if states.conv is None else states.conv[sl])

    if isinstance(states.ssm, InPlace):  # a decode-only step: every row is a decode row
        return LayerStates(None, None), states
    return part(slice(0, num_prefill_blocks)), part(slice(num_prefill_blocks, None))


def concat_rows(parts: list[LayerStates]) -> LayerStates:
    if len(parts) == 1:
        return parts[0]
    ssm = jnp.concatenate([p.ssm for p in parts])
    conv = None if parts[0].conv is None else jnp.concatenate([p.conv for p in parts])
    return LayerStates(ssm, conv)


# The native kernels a Mamba-2 mixer's in-place decode uses (models/layers/mamba2.py).
MAMBA2_IN_PLACE = ("ssd_decode_update", "conv1d_decode_update")


def decode_in_place(batch: ForwardBatch, pool: RecurrentStatePool, ops: tuple[str, ...]) -> bool:
    """Whether this step's recurrent layers get `InPlace` states: a decode-only step, the native kernels
    `ops` (the layers' in-place updates) in use, and float32 pools (what those kernels update)."""
    return (bool(ops) and batch.prefill_pages.shape[0] == 0 and batch.num_decode > 0
            and all(native_in_use(op) for op in ops) and pool.ssm.dtype == jnp.float32
            and (pool.conv is None or pool.conv.dtype == jnp.float32))


def scan_recurrent_layers(
    layers: nnx.Module, num_layers: int, x: jax.Array, batch: ForwardBatch, pool: RecurrentStatePool,
    in_place_ops: tuple[str, ...] = (),
) -> tuple[jax.Array, RecurrentStatePool]:
    """Runs a `layer_stack` (each `layer(x, batch, states) -> (x, final states)`) by one `lax.scan`, the pool
    in the carry; returns (x, updated pool). `in_place_ops`: the native kernels with which the layers update
    `InPlace` states (e.g. MAMBA2_IN_PLACE), given in decode-only steps when they run (`decode_in_place`)."""
    rows = state_rows(batch)
    in_place = decode_in_place(batch, pool, in_place_ops)

    def step(layer, index, carry):
        x, rec = carry
        x, final = layer(x, batch, read_layer_states(rec, index, rows, in_place))
        return x, write_layer_states(rec, index, rows, final)

    x, pool = scan_layers(layers, num_layers, step, (x, pool))
    return x, pool
