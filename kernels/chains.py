"""Decode rows in chains: speculative decoding verifies a request's draft as consecutive decode rows (its last
token, then the draft tokens), and on a recurrent layer each of those rows must start from the state the row
before it ends with, not from the request's slot.

A step says so with two slots per decode row: the one its state is read from and the one its final state is
written to. Row i continues row i - 1 (is *chained*) when it reads the slot row i - 1 writes: a request's
first row reads and writes its own slot, each draft row reads the slot the row before writes and writes a
scratch slot of its own (runtime/batch_builder.py). Kernels that update a pool in place run a chain's rows
in order; the gathered forms (`run_chained`) recompute the rows a chain-depth number of times.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def chain_links(read_slots: jax.Array, write_slots: jax.Array) -> jax.Array:
    """bool[D]: row i starts from row i - 1's final state (it reads the slot row i - 1 writes; never for the
    dummy slot 0 that padding rows use)."""
    prev = jnp.concatenate([jnp.full((1,), -1, write_slots.dtype), write_slots[:-1]])
    return (read_slots == prev) & (read_slots > 0)


def chain_depth(chained: jax.Array) -> jax.Array:
    """i32[]: the most rows any row is behind the first row of its chain (0: no row is chained)."""
    idx = jnp.arange(chained.shape[0], dtype=jnp.int32)
    start = jax.lax.cummax(jnp.where(chained, 0, idx))
    return jnp.max(idx - start, initial=0)


def run_chained(step: Callable, init, chained: jax.Array | None):
    """`step(states) -> (out, finals)` (row-wise over D rows; `states`, `finals` pytrees of [D, ...] arrays of
    the same structure) with every chained row starting from the row before's finals instead of `init`.

    Rounds of the whole row-wise step: after round r every row at most r behind its chain's first row has
    its right initial state, so `chain_depth` rounds after the first settle all of them (a step without
    chains runs `step` once: the loop has no iteration).
    """
    out, finals = step(init)
    if chained is None:
        return out, finals

    def again(_, carry):
        _, finals = carry
        states = jax.tree.map(
            lambda f, s: jnp.where(chained.reshape(-1, *([1] * (s.ndim - 1))), jnp.roll(f, 1, axis=0), s),
            finals, init)
        return step(states)

    return jax.lax.fori_loop(0, chain_depth(chained), again, (out, finals))


def update_pool_chained(step: Callable, pool: jax.Array, layer, read_slots: jax.Array,
                        write_slots: jax.Array | None):
    """The gathered form of an in-place state update: `step(states) -> (out, new states)` on the rows' states
    read from `pool[layer, read_slots]` (chained rows continuing the row before, `run_chained`), the new
    states written to `pool[layer, write_slots]` (default: the slots read). Returns (out, pool)."""
    chained = None if write_slots is None else chain_links(read_slots, write_slots)
    out, new = run_chained(step, pool[layer, read_slots], chained)
    dest = read_slots if write_slots is None else write_slots
    return out, pool.at[layer, dest].set(new.astype(pool.dtype))
