"""Portable Pallas chunked SSD (Mamba-2) prefill: a program per head walks its blocks with the state on chip.

Grid and carry. The state passes from block to block, and a block's sequence boundaries (`starts`) are
data, so the chunks of a head are walked in order by a `lax.fori_loop` INSIDE one program, with the state
f32[P, N] in the loop carry; the grid is over heads only. A grid axis over chunks carrying the state in
scratch would need the grid to run sequentially, which Mosaic (TPU) does for an "arbitrary" axis but Triton
(GPU) does not: its programs run in parallel. Heads are independent, so the head axis is the parallel one
on both. (Blocks of different sequences are independent too, but where sequences split is only known at
run time, so they are not a grid axis.)

Blocks and layout. The wrapper lays the operands out head-major ([H, nb, bs, ...]) so that each program's
BlockSpec block is one head's whole prefill section with full trailing dims (what Mosaic's (8, 128) tiling
asks for), and the loop reads chunk c as `ref[c]`: Triton loads just that chunk through a pointer; Mosaic
copies the head's section into VMEM once, so VMEM per program grows with nb (inputs, outputs and the
per-block init/final states, double-buffered): long chunked-prefill budgets may need a raised VMEM limit
(not measured: no TPU here). Chunk = prefill block: bs tokens.
Triton wants bs, P and N powers of two and at least 16 (its dot tile), as real Mamba-2 configs have.
On GPU the kernel asks for Triton explicitly (a bare pallas_call goes to Mosaic GPU in this jax); it lowers
to Mosaic (TPU) and Triton (GPU) IR from a CPU host (`.lower(lowering_platforms=...)`).

Numerics. Log decays, their in-chunk cumulative sums, the decay matrix and the state are float32; the
cumulative sums are masked row sums (no cumsum op: Mosaic has none). Dots of two inputs (C B^T) run in
the input dtype with float32 accumulation; the masked weights and the decay-scaled B are cast to the
input dtype for the MXU (as mamba_ssm's Triton kernels do), while the dot that reads the float32 state
stays float32. float32 dots ask for HIGHEST precision (no TF32 / single bf16 pass).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.pallas_common import compiler_params, cumulative, dot


def _head_specs(heads_per_group: int):
    """BlockSpec makers for a grid over heads: `head(*trailing)` the head's block of a head-major array,
    `group(*trailing)` the block of the head's B/C group."""
    def head(*trailing):
        return pl.BlockSpec((None, *trailing), lambda i: (i,) + (0,) * len(trailing))

    def group(*trailing):
        # lax.div: i >= 0, so truncating division is floor division, and it lowers without a sign op.
        return pl.BlockSpec(
            (None, *trailing), lambda i: (lax.div(i, heads_per_group),) + (0,) * len(trailing)
        )

    return head, group


def _ssd_kernel(starts_ref, a_ref, dt_ref, x_ref, b_ref, c_ref, init_ref, y_ref, final_ref):
    """One head: chunk by chunk, the masked intra-chunk form plus the entering state, then the next state.

    starts_ref i32[nb, 1, 1]; a_ref f32[1, 1] (A of this head); dt_ref f32[nb, 1, bs]; x_ref f[nb, bs, P];
    b_ref, c_ref f[nb, bs, N] (this head's group); init_ref f32[nb, P, N]; outputs y_ref f32[nb, bs, P],
    final_ref f32[nb, P, N].
    """
    nb, bs, p = x_ref.shape
    n = b_ref.shape[-1]
    lower = lax.broadcasted_iota(jnp.int32, (bs, bs), 1) <= lax.broadcasted_iota(jnp.int32, (bs, bs), 0)
    diagonal = lax.broadcasted_iota(jnp.int32, (bs, bs), 1) == lax.broadcasted_iota(jnp.int32, (bs, bs), 0)

    def chunk(c, state):  # state f32[P, N] entering chunk c unless chunk c starts a sequence
        state = jnp.where(starts_ref[c] != 0, init_ref[c], state)
        x, b, cm = x_ref[c], b_ref[c], c_ref[c]  # f[bs, P], f[bs, N], f[bs, N]
        dt = dt_ref[c]  # f32[1, bs]
        with jax.named_scope("ssd_decay"):
            cum_col, cum_row, total = cumulative(dt * a_ref[...])  # log decays a = dt A <= 0
            # decay[l, s] = exp(a[s+1] + ... + a[l]) for s <= l; exp(-inf) = 0 above the diagonal (the
            # mask goes in before exp: exp of the unmasked difference can overflow there).
            decay = jnp.exp(jnp.where(lower, cum_col - cum_row, -jnp.inf))  # f32[bs, bs]
            dt_col = jnp.sum(jnp.where(diagonal, dt, 0.0), axis=1, keepdims=True)  # f32[bs, 1]
        with jax.named_scope("ssd_intra_chunk"):
            weights = dot(cm, b, (1, 1)) * decay * dt  # f32[bs, bs]: (C[l] . B[s]) decay[l, s] dt[s]
            y = dot(weights.astype(x.dtype), x, (1, 0))  # f32[bs, P]
        with jax.named_scope("ssd_entering_state"):
            # exp(a_cum[l]) C[l] . state: the entering state decayed to each token.
            y = y + jnp.exp(cum_col) * dot(cm.astype(jnp.float32), state, (1, 1))
        y_ref[c] = y
        with jax.named_scope("ssd_next_state"):
            # sum_s exp(a_cum[last] - a_cum[s]) dt[s] x[s] B[s]^T, plus the entering state decayed across.
            to_end = jnp.exp(total - cum_col) * dt_col  # f32[bs, 1]
            state = jnp.exp(total) * state + dot(x, (b * to_end).astype(x.dtype), (0, 0))  # f32[P, N]
        final_ref[c] = state
        return state

    lax.fori_loop(0, nb, chunk, jnp.zeros((p, n), jnp.float32))


@functools.partial(jax.jit, static_argnames=("interpret",))
def ssd_prefill(
    x: jax.Array,  # f[nb, bs, H, P] inputs of the prefill blocks
    dt: jax.Array,  # f32[nb, bs, H] softplus'd, biased, clamped step sizes; 0 on padding tokens
    A: jax.Array,  # f32[H] negative decay rates
    B: jax.Array,  # f[nb, bs, G, N]
    C: jax.Array,  # f[nb, bs, G, N]
    init: jax.Array,  # f32[nb, H, P, N] state entering each block that starts a sequence
    starts: jax.Array,  # bool[nb] first block of its sequence this step (other blocks' init is not read)
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """kernels/ssd/reference.py:ssd_prefill as one Pallas kernel (same contract); `interpret` runs it in the
    Pallas interpreter (CPU).

    Returns (y f32[nb, bs, H, P], final f32[nb, H, P, N]): the state after each block.
    """
    nb, bs, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if h % g:
        raise ValueError(f"num_heads={h} must be a multiple of n_groups={g}")
    heads_per_group = h // g
    # One dtype for the MXU operands (the models pass one already; the reference accepts a mix).
    x, B, C = (t.astype(jnp.result_type(x, B, C)) for t in (x, B, C))

    # Head-major operands: each program's block is one head's (or group's) whole prefill section.
    xt = x.transpose(2, 0, 1, 3)  # [H, nb, bs, P]
    bt, ct = (t.transpose(2, 0, 1, 3) for t in (B, C))  # [G, nb, bs, N]
    dtt = dt.astype(jnp.float32).transpose(2, 0, 1)[:, :, None, :]  # [H, nb, 1, bs]
    a = A.astype(jnp.float32).reshape(h, 1, 1)  # [H, 1, 1]
    init_t = init.astype(jnp.float32).transpose(1, 0, 2, 3)  # [H, nb, P, N]
    starts_i = starts.astype(jnp.int32).reshape(nb, 1, 1)

    head, group = _head_specs(heads_per_group)
    y, final = pl.pallas_call(
        _ssd_kernel,
        grid=(h,),
        in_specs=[
            pl.BlockSpec((nb, 1, 1), lambda i: (0, 0, 0)),
            head(1, 1),
            head(nb, 1, bs),
            head(nb, bs, p),
            group(nb, bs, n),
            group(nb, bs, n),
            head(nb, p, n),
        ],
        out_specs=[head(nb, bs, p), head(nb, p, n)],
        out_shape=[
            jax.ShapeDtypeStruct((h, nb, bs, p), jnp.float32),
            jax.ShapeDtypeStruct((h, nb, p, n), jnp.float32),
        ],
        compiler_params=compiler_params(interpret),
        interpret=interpret,
        name="ssd_prefill",
    )(starts_i, a, dtt, xt, bt, ct, init_t)
    return y.transpose(1, 2, 0, 3), final.transpose(1, 0, 2, 3)


def _ssd_decode_kernel(chained_ref, a_ref, dt_ref, x_ref, b_ref, c_ref, state_ref, y_ref, new_ref):
    """One head: the decode rows in order, one recurrence step each, a chained row starting from the state the
    row before it left (the carry) instead of its own.

    chained_ref i32[D, 1, 1]; a_ref f32[1, 1]; dt_ref f32[D, 1, 1]; x_ref f[D, 1, P]; b_ref, c_ref f[D, 1, N]
    (this head's group); state_ref f32[D, P, N]; outputs y_ref f32[D, 1, P], new_ref f32[D, P, N].
    """
    d, p, n = state_ref.shape

    def row(r, carry):
        s = jnp.where(chained_ref[r] != 0, carry, state_ref[r])  # f32[P, N]
        dt = dt_ref[r]  # f32[1, 1]
        x, b = x_ref[r].astype(jnp.float32), b_ref[r].astype(jnp.float32)  # [1, P], [1, N]
        s = jnp.exp(dt * a_ref[...]) * s + dot(x * dt, b, (0, 0))  # decay S + dt x (outer) B
        y_ref[r] = dot(c_ref[r].astype(jnp.float32), s, (1, 1))  # [1, P]: C . S
        new_ref[r] = s
        return s

    lax.fori_loop(0, d, row, jnp.zeros((p, n), jnp.float32))


@functools.partial(jax.jit, static_argnames=("interpret",))
def ssd_decode_rows(
    x: jax.Array,  # f[D, H, P] one input per decode row
    dt: jax.Array,  # f32[D, H]
    A: jax.Array,  # f32[H]
    B: jax.Array,  # f[D, G, N]
    C: jax.Array,  # f[D, G, N]
    state: jax.Array,  # f32[D, H, P, N] each row's own initial state
    chained: jax.Array | None = None,  # bool[D] the row continues the row before it (kernels/chains.py)
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """kernels/ssd/reference.py:ssd_decode_rows as one Pallas kernel (same contract): the multi-step state
    update of speculative draft rows in one pass over the rows (the reference recomputes all rows once per
    chain step), a program per head with the state in the loop carry (grid and layout as `ssd_prefill`).

    Returns (y f32[D, H, P], new state f32[D, H, P, N]).
    """
    d, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    if h % g:
        raise ValueError(f"num_heads={h} must be a multiple of n_groups={g}")
    heads_per_group = h // g
    chained = jnp.zeros((d,), jnp.int32) if chained is None else chained.astype(jnp.int32)
    xt = x.transpose(1, 0, 2)[:, :, None, :]  # [H, D, 1, P]
    bt, ct = (t.transpose(1, 0, 2)[:, :, None, :] for t in (B, C))  # [G, D, 1, N]
    dtt = dt.astype(jnp.float32).T.reshape(h, d, 1, 1)
    a = A.astype(jnp.float32).reshape(h, 1, 1)
    state_t = state.astype(jnp.float32).transpose(1, 0, 2, 3)  # [H, D, P, N]

    head, group = _head_specs(heads_per_group)
    y, new = pl.pallas_call(
        _ssd_decode_kernel,
        grid=(h,),
        in_specs=[
            pl.BlockSpec((d, 1, 1), lambda i: (0, 0, 0)),
            head(1, 1),
            head(d, 1, 1),
            head(d, 1, p),
            group(d, 1, n),
            group(d, 1, n),
            head(d, p, n),
        ],
        out_specs=[head(d, 1, p), head(d, p, n)],
        out_shape=[
            jax.ShapeDtypeStruct((h, d, 1, p), jnp.float32),
            jax.ShapeDtypeStruct((h, d, p, n), jnp.float32),
        ],
        compiler_params=compiler_params(interpret),
        interpret=interpret,
        name="ssd_decode_rows",
    )(chained.reshape(d, 1, 1), a, dtt, xt, bt, ct, state_t)
    return y[:, :, 0].transpose(1, 0, 2), new.transpose(1, 0, 2, 3)
