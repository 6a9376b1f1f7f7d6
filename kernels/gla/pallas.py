"""Portable Pallas chunked Lightning / simple-GLA prefill: a program per head walks its blocks, state on chip.

Grid and carry. The state passes from block to block, and a block's sequence boundaries (`starts`) are
data, so the chunks of a head are walked in order by a `lax.fori_loop` INSIDE one program, with the state
f32[K, V] in the loop carry; the grid is over heads only. A grid axis over chunks carrying the state in
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
Triton wants bs, K and V powers of two and at least 16 (its dot tile), as real models have.
On GPU the kernel asks for Triton explicitly (a bare pallas_call goes to Mosaic GPU in this jax); it lowers
to Mosaic (TPU) and Triton (GPU) IR from a CPU host (`.lower(lowering_platforms=...)`).

Numerics. Log decays, their in-chunk cumulative sums, the decay matrix and the state are float32; the
cumulative sums are masked row sums (no cumsum op: Mosaic has none). Dots of two inputs (q k^T) run in
the input dtype with float32 accumulation; the masked scores and the decay-scaled keys are cast to the
input dtype for the MXU, while the dot that reads the float32 state stays float32. float32 dots ask for
HIGHEST precision (no TF32 / single bf16 pass).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.pallas_common import compiler_params, cumulative, dot


def _gla_kernel(starts_ref, g_ref, q_ref, k_ref, v_ref, init_ref, o_ref, final_ref, *, scale: float):
    """One head: chunk by chunk, the masked intra-chunk form plus the entering state, then the next state.

    starts_ref i32[nb, 1, 1]; g_ref f32[nb, 1, bs]; q_ref, k_ref f[nb, bs, K]; v_ref f[nb, bs, V];
    init_ref f32[nb, K, V]; outputs o_ref f32[nb, bs, V], final_ref f32[nb, K, V].
    """
    nb, bs, dk = q_ref.shape
    dv = v_ref.shape[-1]
    lower = lax.broadcasted_iota(jnp.int32, (bs, bs), 1) <= lax.broadcasted_iota(jnp.int32, (bs, bs), 0)

    def chunk(c, state):  # state f32[K, V] entering chunk c unless chunk c starts a sequence
        state = jnp.where(starts_ref[c] != 0, init_ref[c], state)
        q, k, v = q_ref[c], k_ref[c], v_ref[c]  # f[bs, K], f[bs, K], f[bs, V]
        with jax.named_scope("gla_decay"):
            cum_col, cum_row, total = cumulative(g_ref[c])
            # decay[l, s] = exp(g[s+1] + ... + g[l]) for s <= l; exp(-inf) = 0 above the diagonal (the
            # mask goes in before exp: exp of the unmasked difference can overflow there).
            decay = jnp.exp(jnp.where(lower, cum_col - cum_row, -jnp.inf))  # f32[bs, bs]
        with jax.named_scope("gla_intra_chunk"):
            scores = dot(q, k, (1, 1)) * decay  # f32[bs, bs]
            o = dot(scores.astype(v.dtype), v, (1, 0))  # f32[bs, V]
        with jax.named_scope("gla_entering_state"):
            # exp(g_cum[l]) q[l] S_in: the entering state decayed to each token.
            o = o + jnp.exp(cum_col) * dot(q.astype(jnp.float32), state, (1, 0))
        o_ref[c] = o * scale
        with jax.named_scope("gla_next_state"):
            # sum_s exp(g_cum[last] - g_cum[s]) k[s]^T v[s], plus the entering state decayed across.
            to_end = jnp.exp(total - cum_col)  # f32[bs, 1]
            state = jnp.exp(total) * state + dot((k * to_end).astype(v.dtype), v, (0, 0))  # f32[K, V]
        final_ref[c] = state
        return state

    lax.fori_loop(0, nb, chunk, jnp.zeros((dk, dv), jnp.float32))


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def gla_prefill(
    q: jax.Array,  # f[nb, bs, H, K] queries of the prefill blocks
    k: jax.Array,  # f[nb, bs, H, K] keys; 0 on padding tokens
    v: jax.Array,  # f[nb, bs, H, V] values
    log_decay: jax.Array,  # f32[H] (per head, every token) or f32[nb, bs, H] log decays g <= 0; 0 on padding
    init: jax.Array,  # f32[nb, H, K, V] state entering each block that starts a sequence
    starts: jax.Array,  # bool[nb] first block of its sequence this step (other blocks' init is not read)
    *,
    scale: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """kernels/gla/reference.py:gla_prefill as one Pallas kernel (same contract); `interpret` runs it in the
    Pallas interpreter (CPU).

    Returns (o f32[nb, bs, H, V], final f32[nb, H, K, V]): the state after each block.
    """
    nb, bs, h, dk = q.shape
    dv = v.shape[-1]
    # One dtype for the MXU operands (the models pass one already; the reference accepts a mix).
    q, k, v = (t.astype(jnp.result_type(q, k, v)) for t in (q, k, v))

    # Head-major operands: each program's block is one head's whole prefill section.
    qt, kt, vt = (t.transpose(2, 0, 1, 3) for t in (q, k, v))  # [H, nb, bs, K or V]
    g = jnp.broadcast_to(log_decay.astype(jnp.float32), (nb, bs, h))
    gt = g.transpose(2, 0, 1)[:, :, None, :]  # [H, nb, 1, bs]
    init_t = init.astype(jnp.float32).transpose(1, 0, 2, 3)  # [H, nb, K, V]
    starts_i = starts.astype(jnp.int32).reshape(nb, 1, 1)

    def head(*trailing):  # the head's block of a head-major array
        return pl.BlockSpec((None, *trailing), lambda i: (i,) + (0,) * len(trailing))

    o, final = pl.pallas_call(
        functools.partial(_gla_kernel, scale=scale),
        grid=(h,),
        in_specs=[
            pl.BlockSpec((nb, 1, 1), lambda i: (0, 0, 0)),
            head(nb, 1, bs),
            head(nb, bs, dk),
            head(nb, bs, dk),
            head(nb, bs, dv),
            head(nb, dk, dv),
        ],
        out_specs=[head(nb, bs, dv), head(nb, dk, dv)],
        out_shape=[
            jax.ShapeDtypeStruct((h, nb, bs, dv), jnp.float32),
            jax.ShapeDtypeStruct((h, nb, dk, dv), jnp.float32),
        ],
        compiler_params=compiler_params(interpret),
        interpret=interpret,
        name="gla_prefill",
    )(starts_i, gt, qt, kt, vt, init_t)
    return o.transpose(1, 2, 0, 3), final.transpose(1, 0, 2, 3)
