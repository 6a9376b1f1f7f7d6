"""Portable Pallas chunked gated delta rule (Gated DeltaNet) prefill: a program per head walks its blocks with
the state on chip.

Grid and carry (as kernels/gla/pallas.py and kernels/ssd/pallas.py). The state passes from block to block,
and a block's sequence boundaries (`starts`) are data, so the chunks of a head are walked in order by a
`lax.fori_loop` INSIDE one program, with the state f32[Dk, Dv] in the loop carry; the grid is over heads
only (the parallel axis on Mosaic and Triton alike). Chunk = prefill block: bs tokens.

Blocks and layout. The wrapper lays the operands out head-major ([H, nb, bs, ...]) so that each program's
BlockSpec block is one head's whole prefill section with full trailing dims (what Mosaic's (8, 128) tiling
asks for), and the loop reads chunk c as `ref[c]`. Mosaic copies the head's section into VMEM once, so VMEM
per program grows with nb (not measured: no TPU here). Triton wants bs, Dk and Dv powers of two and at least
16 (its dot tile), as real models have.

The triangular part. Within a chunk the corrections u[t] = beta[t] (v[t] - k[t] S') solve the unit
lower-triangular system (I + A) u = beta v - beta exp(G) k S0, A[i, j] = beta[i] (k[i] . k[j])
exp(G[i] - G[j]) for j < i (the reference's docstring). Neither Mosaic nor Triton has a triangular solve,
so the kernel builds T = (I + A)^-1 [bs, bs] by FORWARD SUBSTITUTION, one row per step of an inner
`lax.fori_loop` (T[i] = e_i - sum_{j<i} A[i, j] T[j], the rows j < i already final), and then applies T to
both right-hand sides with two MXU dots: w = T (beta v), kc = T (beta exp(G) k), u = w - kc S0. A step is
a masked select of A's row i (read as a column of A^T, built directly, so that no transpose is needed), a
broadcast multiply with T and a sublane sum: elementwise work and reductions only, no M = 1 dot (which
Triton cannot tile). Forward substitution is chosen over the doubling product (I - A)(I + A^2)(I + A^4)...
for accuracy: the product is exact in exact arithmetic (A is nilpotent), but its factors A^(2^m) hold the
alternating Neumann terms, which can be much larger than the inverse they sum to (binomial growth when
keys are close and decays near 1), so float32 loses everything to cancellation (bs = 64, near-parallel
keys, g ~ -0.05, beta ~ 0.9: max |A^32| ~ 1e14 for max |T| ~ 1, and the product's error is ~1e7 times T's
scale, against ~1e-7 for substitution); substitution is the backward stable triangular solve and only ever
forms T's own rows (what fla's `solve_tril` does within its 16-row blocks). Its cost, bs sequential steps
of O(bs^2) vector work per chunk, is small next to the dots.

Numerics. Everything is float32: q, k, v are cast up inside the kernel (HBM traffic stays in the input
dtype) and every dot asks for HIGHEST precision, as the reference's einsums. The in-chunk cumulative log
decays are masked row sums (no cumsum op: Mosaic has none), the decay matrices are masked before exp (the
unmasked difference can overflow), and decays only ever appear as exp of a non-positive number. Padding
tokens (beta = 0, g = 0, finite q, k, v) write nothing: their rows of A and of both right-hand sides are 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels.pallas_common import compiler_params, cumulative, dot


def _inverse_unit_lower(a_t: jax.Array) -> jax.Array:
    """f32[n, n] T = (I + A)^-1 for A strictly lower triangular, given A^T (strictly upper), by forward
    substitution: row i of T is e_i - sum_{j < i} A[i, j] T[j], rows j < i already final."""
    n = a_t.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    col = lax.broadcasted_iota(jnp.int32, (n, n), 1)

    def step(i, t):
        a_i = jnp.sum(jnp.where(col == i, a_t, 0.0), axis=1, keepdims=True)  # f32[n, 1]: A[i, j] at row j
        # Row i of t is still e_i; A[i, j] = 0 for j >= i, so the sum reads only the final rows j < i.
        update = jnp.sum(a_i * t, axis=0, keepdims=True)  # f32[1, n]
        return t - jnp.where(row == i, update, 0.0)

    return lax.fori_loop(1, n, step, (row == col).astype(jnp.float32))


def _delta_kernel(starts_ref, g_ref, beta_ref, q_ref, k_ref, v_ref, init_ref, o_ref, final_ref, *, scale):
    """One head: chunk by chunk, the UT solve, the outputs from the entering state, then the next state.

    starts_ref i32[nb, 1, 1]; g_ref, beta_ref f32[nb, 1, bs]; q_ref, k_ref f[nb, bs, Dk]; v_ref f[nb, bs, Dv];
    init_ref f32[nb, Dk, Dv]; outputs o_ref f32[nb, bs, Dv], final_ref f32[nb, Dk, Dv].
    """
    nb, bs, dk = q_ref.shape
    dv = v_ref.shape[-1]
    row = lax.broadcasted_iota(jnp.int32, (bs, bs), 0)
    col = lax.broadcasted_iota(jnp.int32, (bs, bs), 1)

    def chunk(c, state):  # state f32[Dk, Dv] entering chunk c unless chunk c starts a sequence
        state = jnp.where(starts_ref[c] != 0, init_ref[c], state)
        q, k, v = (r[c].astype(jnp.float32) for r in (q_ref, k_ref, v_ref))  # [bs, Dk], [bs, Dk], [bs, Dv]
        beta_row = beta_ref[c]  # f32[1, bs]
        with jax.named_scope("gated_delta_decay"):
            cum_col, cum_row, total = cumulative(g_ref[c])  # G as [bs, 1], [1, bs], and G[last] [1, 1]
            beta_col = jnp.sum(jnp.where(row == col, beta_row, 0.0), axis=1, keepdims=True)  # f32[bs, 1]
            # decay[l, s] = exp(G[l] - G[s]) for s <= l, 0 above the diagonal (masked before exp).
            decay = jnp.exp(jnp.where(col <= row, cum_col - cum_row, -jnp.inf))  # f32[bs, bs]
            # The transposed strict decay, decay_t[j, i] = exp(G[i] - G[j]) for j < i, built directly.
            decay_t = jnp.exp(jnp.where(row < col, cum_row - cum_col, -jnp.inf))
        with jax.named_scope("gated_delta_ut_solve"):
            # A^T[j, i] = beta[i] (k[i] . k[j]) exp(G[i] - G[j]) for j < i (k k^T is symmetric).
            a_t = dot(k, k, (1, 1)) * decay_t * beta_row
            t = _inverse_unit_lower(a_t)  # (I + A)^-1
            w = dot(t, v * beta_col, (1, 0))  # f32[bs, Dv]
            kc = dot(t, k * (beta_col * jnp.exp(cum_col)), (1, 0))  # f32[bs, Dk]
            u = w - dot(kc, state, (1, 0))  # f32[bs, Dv]: each token's correction
        with jax.named_scope("gated_delta_outputs"):
            # Within the chunk (a token reads itself) plus the entering state decayed to each token.
            o = dot(dot(q, k, (1, 1)) * decay, u, (1, 0))
            o = o + jnp.exp(cum_col) * dot(q, state, (1, 0))
        o_ref[c] = o * scale
        with jax.named_scope("gated_delta_next_state"):
            # exp(G[last]) S0 + sum_s exp(G[last] - G[s]) k[s]^T u[s].
            to_end = jnp.exp(total - cum_col)  # f32[bs, 1]
            state = jnp.exp(total) * state + dot(k * to_end, u, (0, 0))  # f32[Dk, Dv]
        final_ref[c] = state
        return state

    lax.fori_loop(0, nb, chunk, jnp.zeros((dk, dv), jnp.float32))


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def gated_delta_prefill(
    q: jax.Array,  # f[nb, bs, H, Dk] queries of the prefill blocks (L2-normalised)
    k: jax.Array,  # f[nb, bs, H, Dk] keys (L2-normalised); finite on padding tokens
    v: jax.Array,  # f[nb, bs, H, Dv] values
    g: jax.Array,  # f32[nb, bs, H] log decays g <= 0; 0 on padding tokens
    beta: jax.Array,  # f32[nb, bs, H] write strengths in [0, 1]; 0 on padding tokens
    init: jax.Array,  # f32[nb, H, Dk, Dv] state entering each block that starts a sequence (0 for a new one)
    starts: jax.Array,  # bool[nb] first block of its sequence this step (other blocks' init is not read)
    *,
    scale: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """kernels/delta_rule/reference.py:gated_delta_prefill as one Pallas kernel (same contract); `interpret`
    runs it in the Pallas interpreter (CPU).

    Returns (o f32[nb, bs, H, Dv], final f32[nb, H, Dk, Dv]): the state after each block's last token.
    """
    nb, bs, h, dk = q.shape
    dv = v.shape[-1]

    # Head-major operands: each program's block is one head's whole prefill section.
    qt, kt, vt = (t.transpose(2, 0, 1, 3) for t in (q, k, v))  # [H, nb, bs, Dk or Dv]
    gt, betat = (t.astype(jnp.float32).transpose(2, 0, 1)[:, :, None, :] for t in (g, beta))  # [H, nb, 1, bs]
    init_t = init.astype(jnp.float32).transpose(1, 0, 2, 3)  # [H, nb, Dk, Dv]
    starts_i = starts.astype(jnp.int32).reshape(nb, 1, 1)

    def head(*trailing):  # the head's block of a head-major array
        return pl.BlockSpec((None, *trailing), lambda i: (i,) + (0,) * len(trailing))

    o, final = pl.pallas_call(
        functools.partial(_delta_kernel, scale=scale),
        grid=(h,),
        in_specs=[
            pl.BlockSpec((nb, 1, 1), lambda i: (0, 0, 0)),
            head(nb, 1, bs),
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
        name="gated_delta_prefill",
    )(starts_i, gt, betat, qt, kt, vt, init_t)
    return o.transpose(1, 2, 0, 3), final.transpose(1, 0, 2, 3)
