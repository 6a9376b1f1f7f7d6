"""Portable Pallas multi-step delta-rule decode (speculative verify rows), Gated DeltaNet and KDA alike.

What it computes. kernels/delta_rule/reference.py:`gated_delta_decode_rows` and `kda_decode_rows`: one
delta-rule step per decode row, rows in order, a chained row (a draft row, kernels/chains.py) starting from
the state the row before it ends with instead of its own, every row's final state kept so that rolling back
rejected drafts is choosing a state. The reference re-runs all rows once per chain step (`run_chained`);
here each row is computed once. The two forms share one kernel: Gated DeltaNet is KDA with the decay equal
over the key channels, passed as a width-1 decay that broadcasts.

Grid and carry (as kernels/ssd/pallas.py:`ssd_decode_rows`). A program per value head walks the rows by a
`lax.fori_loop` with the state f32[Dk, Dv] in the loop carry; heads are the parallel grid axis.

Blocks and layout. The operands keep their row-major layout ([D, H, ...]; the wrapper only reshapes, it
transposes nothing, so the states make no extra pass through HBM): a head's block is every row's slice of
that head, the head axis squeezed, and the loop reads row r as `ref[r]` (a leading, untiled axis). VMEM per
program grows with D (the rows' initial and final states, f32[D, Dk, Dv] each, double-buffered: 256 KiB a
row at Dk = Dv = 128): about 60 rows fit a 16 MiB scoped VMEM limit (not measured: no TPU here).

Numerics. Everything is float32 (q, k, v cast up inside the kernel). Every product is elementwise: the
state's decay per key channel, the reads k S' and q S as sublane sums of a key column times the state, and
the write k^T delta as a column times a row. A matrix-vector product on the MXU would load the whole state as
weights for one row. The key-channel vectors (q, k, the decay) arrive as rows [1, Dk] and are turned into
columns by `_column`, exactly: a [Dk, Dk] select and lane sum each, about the vector work of the state update
itself, chosen over a transpose of a [1, Dk] value (an unaligned shape that Mosaic may refuse) and over
[Dk, 1] blocks (lane-padded 128 times in VMEM).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.pallas_common import compiler_params


def _column(row: jax.Array) -> jax.Array:
    """f32[n, 1] from f32[1, n]: the row read back off the diagonal of its broadcast (a transpose by a masked
    lane sum: exact, and only ops that Mosaic and Triton both lower)."""
    n = row.shape[-1]
    diagonal = lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.sum(jnp.where(diagonal, row, 0.0), axis=1, keepdims=True)


def _rows_kernel(chained_ref, g_ref, beta_ref, q_ref, k_ref, v_ref, state_ref, o_ref, new_ref, *, scale):
    """One value head: the decode rows in order, one delta-rule step each, a chained row starting from the
    state the row before it left (the carry) instead of its own.

    chained_ref i32[D, 1, 1]; g_ref f32[D, 1, Dk] (KDA) or f32[D, 1, 1] (one decay for the head);
    beta_ref f32[D, 1, 1]; q_ref, k_ref f[D, 1, Dk]; v_ref f[D, 1, Dv]; state_ref f32[D, Dk, Dv]; outputs
    o_ref f32[D, 1, Dv], new_ref f32[D, Dk, Dv].
    """
    d, dk, dv = state_ref.shape

    def row(r, carry):
        s = jnp.where(chained_ref[r] != 0, carry, state_ref[r])  # f32[Dk, Dv]
        decay = jnp.exp(g_ref[r])  # f32[1, Dk] or f32[1, 1]
        if decay.shape[-1] > 1:  # per key channel: it scales the state's rows
            decay = _column(decay)
        q, k = (_column(x[r].astype(jnp.float32)) for x in (q_ref, k_ref))  # f32[Dk, 1] each
        s = decay * s  # S'
        v = v_ref[r].astype(jnp.float32)  # f32[1, Dv]
        delta = beta_ref[r] * (v - jnp.sum(k * s, axis=0, keepdims=True))  # f32[1, Dv]
        s = s + k * delta  # S' + k^T beta (v - k S')
        o_ref[r] = scale * jnp.sum(q * s, axis=0, keepdims=True)  # [1, Dv]: a token reads its own write
        new_ref[r] = s
        return s

    lax.fori_loop(0, d, row, jnp.zeros((dk, dv), jnp.float32))


def _decode_rows(q, k, v, g, beta, state, chained, *, scale: float, interpret: bool, name: str):
    """The shared wrapper: g f32[D, H, Dk] or f32[D, H, 1]."""
    d, h, dk = q.shape
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:2] != (d, h) or state.shape != (d, h, dk, dv):
        raise ValueError(f"{name}: q {q.shape}, k {k.shape}, v {v.shape} and state {state.shape} must be "
                         "[D, H, Dk], [D, H, Dk], [D, H, Dv] and [D, H, Dk, Dv]")
    if beta.shape != (d, h):
        raise ValueError(f"{name}: beta {beta.shape} must be [D, H] = {(d, h)}")
    chained = jnp.zeros((d,), jnp.int32) if chained is None else chained.astype(jnp.int32)

    def head(*trailing):  # head i's slice of every row of a [D, H, ...] array (the head axis squeezed)
        return pl.BlockSpec((d, None, *trailing), lambda i: (0, i) + (0,) * len(trailing))

    def rows(t):  # [D, H, n] -> [D, H, 1, n]: a row vector per (row, head); a reshape, no copy
        return t.reshape(d, h, 1, -1)

    gw = g.shape[-1]
    o, new = pl.pallas_call(
        functools.partial(_rows_kernel, scale=scale),
        grid=(h,),
        in_specs=[
            pl.BlockSpec((d, 1, 1), lambda i: (0, 0, 0)),
            head(1, gw),
            head(1, 1),
            head(1, dk),
            head(1, dk),
            head(1, dv),
            head(dk, dv),
        ],
        out_specs=[head(1, dv), head(dk, dv)],
        out_shape=[
            jax.ShapeDtypeStruct((d, h, 1, dv), jnp.float32),
            jax.ShapeDtypeStruct((d, h, dk, dv), jnp.float32),
        ],
        compiler_params=compiler_params(interpret),
        interpret=interpret,
        name=name,
    )(chained.reshape(d, 1, 1), rows(g.astype(jnp.float32)), rows(beta.astype(jnp.float32)), rows(q),
      rows(k), rows(v), state.astype(jnp.float32))
    return o.reshape(d, h, dv), new


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def gated_delta_decode_rows(
    q: jax.Array,  # f[D, H, Dk] (L2-normalised)
    k: jax.Array,  # f[D, H, Dk] (L2-normalised)
    v: jax.Array,  # f[D, H, Dv]
    g: jax.Array,  # f32[D, H] log decays g <= 0
    beta: jax.Array,  # f32[D, H] write strengths in [0, 1]
    state: jax.Array,  # f32[D, H, Dk, Dv] each row's own initial state
    chained: jax.Array | None = None,  # bool[D] the row continues the row before it (kernels/chains.py)
    *,
    scale: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """kernels/delta_rule/reference.py:gated_delta_decode_rows as one Pallas kernel (same contract);
    `interpret` runs it in the Pallas interpreter (CPU).

    Returns (o f32[D, H, Dv], new state f32[D, H, Dk, Dv]).
    """
    if g.shape != q.shape[:2]:
        raise ValueError(f"gated_delta_decode_rows: g {g.shape} must be [D, H] = {q.shape[:2]}")
    return _decode_rows(q, k, v, g[..., None], beta, state, chained, scale=scale, interpret=interpret,
                        name="gated_delta_decode_rows")


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def kda_decode_rows(
    q: jax.Array,  # f[D, H, Dk] (L2-normalised)
    k: jax.Array,  # f[D, H, Dk] (L2-normalised)
    v: jax.Array,  # f[D, H, Dv]
    g: jax.Array,  # f32[D, H, Dk] log decays g <= 0, one per key channel
    beta: jax.Array,  # f32[D, H] write strengths in [0, 1]
    state: jax.Array,  # f32[D, H, Dk, Dv] each row's own initial state
    chained: jax.Array | None = None,  # bool[D] the row continues the row before it (kernels/chains.py)
    *,
    scale: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """kernels/delta_rule/reference.py:kda_decode_rows as one Pallas kernel (same contract); `interpret` runs
    it in the Pallas interpreter (CPU).

    Returns (o f32[D, H, Dv], new state f32[D, H, Dk, Dv]).
    """
    if g.shape != q.shape:
        raise ValueError(f"kda_decode_rows: g {g.shape} must be [D, H, Dk] = {q.shape}")
    return _decode_rows(q, k, v, g, beta, state, chained, scale=scale, interpret=interpret,
                        name="kda_decode_rows")
