"""Portable Pallas chunked gated delta rule prefills, Gated DeltaNet's and KDA's (a decay per key channel): a
program per head walks its blocks with the state on chip.

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

KDA. Both rules share everything past the decayed products (`_Decays`): the solve, the outputs, the next
state. With a decay per key channel, exp(G[i] - G[j]) is a vector per pair, so A and the scores are no
longer a [bs, bs] decay matrix times k k^T. fla splits k[i] exp(G[i] - G[j]) . k[j] at a reference point r,
(k[i] exp(G[i] - G[r])) . (k[j] exp(G[r] - G[j])), which has a positive exponent unless G[i] <= G[r] <= G[j],
so it takes r per 16-row sub-block and fills the diagonal sub-blocks pair by pair. Here r is the row itself:
`_kda_decays` walks the chunk a token at a time keeping the keys decayed to the current token as a running
product (each step one exp(g) <= 1 per channel), and reads row i of A and of the scores off it with two
lane sums. That is O(bs^2 Dk) vector work per chunk (bs steps of [bs, Dk]; about Dk / bs times the
substitution's), where the sub-block split does most of it on the MXU; the step needs no 3-D arrays and no
sub-block bookkeeping, and lowers for any bs (not measured on a TPU: none here).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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


class _Decays(NamedTuple):
    """A chunk's decayed products, all the WY form needs from the decay (G: cumulative log decay from the
    chunk start, per head or per key channel; bs tokens). Transposed [s, l] where a token l reads s <= l, so
    that each is built without a transpose and read by a dot contracting dim 0."""

    kk_t: jax.Array  # f32[bs, bs] A^T / beta: (k[i] . k[j]) decayed from j to i at [j, i] for j < i, else 0
    scores_t: jax.Array  # f32[bs, bs] (q[l] . k[s]) decayed from s to l at [s, l] for s <= l, else 0
    q_start: jax.Array  # f32[bs, Dk] queries decayed from the chunk start: q[l] exp(G[l])
    k_start: jax.Array  # f32[bs, Dk] keys decayed from the chunk start: k[l] exp(G[l])
    k_end: jax.Array  # f32[bs, Dk] keys decayed to the chunk end: k[s] exp(G[last] - G[s])
    chunk_decay: jax.Array  # f32[1, 1] or [Dk, 1] the decay across the whole chunk, a diagonal: exp(G[last])


def _gated_decays(q: jax.Array, k: jax.Array, g: jax.Array) -> _Decays:
    """The per-head decay (gated delta rule): g f32[1, bs], one log decay per token; exp(G[l] - G[s]) is one
    [bs, bs] matrix, masked before exp (the unmasked difference can overflow)."""
    bs = k.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (bs, bs), 0)
    col = lax.broadcasted_iota(jnp.int32, (bs, bs), 1)
    cum_col, cum_row, total = cumulative(g)  # G as [bs, 1], [1, bs], and G[last] [1, 1]
    decay_t = jnp.exp(jnp.where(row <= col, cum_row - cum_col, -jnp.inf))  # [s, l] = exp(G[l] - G[s])
    from_start = jnp.exp(cum_col)  # f32[bs, 1]
    return _Decays(
        kk_t=jnp.where(row < col, dot(k, k, (1, 1)) * decay_t, 0.0),
        scores_t=dot(k, q, (1, 1)) * decay_t,
        q_start=q * from_start,
        k_start=k * from_start,
        k_end=k * jnp.exp(total - cum_col),
        chunk_decay=jnp.exp(total),
    )


def _kda_decays(q: jax.Array, k: jax.Array, g: jax.Array) -> _Decays:
    """The per-key-channel decay (KDA): g f32[bs, Dk]. The pairwise decays exp(G[i] - G[j]) differ per
    channel, a [bs, bs, Dk] tensor, so the products are built a token i at a time against the keys decayed
    to token i, k_dec[j] = k[j] exp(G[i] - G[j]) for j <= i (0 for j > i), kept as a running product:
    k_dec *= exp(g[i]), then row i set to k[i]. Every exp is of a single g <= 0, none of a difference of
    cumulative sums (which loses digits where the sums grow large; the reference sums the masked increments
    for the same reason). Column i of kk_t and scores_t is k_dec . k[i] and k_dec . q[i]; the last k_dec is
    k_end.
    """
    bs, dk = k.shape
    rows = lax.broadcasted_iota(jnp.int32, (bs, dk), 0)
    row = lax.broadcasted_iota(jnp.int32, (bs, bs), 0)
    col = lax.broadcasted_iota(jnp.int32, (bs, bs), 1)
    token_decay = jnp.exp(g)  # f32[bs, Dk]

    def token(i, carry):
        k_dec, kk_t, scores_t = carry
        at_i = rows == i
        # Row i of each, as a masked sublane sum (no dynamic slice of a value).
        decay_i, k_i, q_i = (
            jnp.sum(jnp.where(at_i, x, 0.0), axis=0, keepdims=True) for x in (token_decay, k, q)
        )  # f32[1, Dk] each
        k_dec = jnp.where(at_i, k, k_dec * decay_i)  # f32[bs, Dk] k[j] exp(G[i] - G[j]) for j <= i
        kk_t = jnp.where(col == i, jnp.sum(k_dec * k_i, axis=1, keepdims=True), kk_t)
        scores_t = jnp.where(col == i, jnp.sum(k_dec * q_i, axis=1, keepdims=True), scores_t)
        return k_dec, kk_t, scores_t

    zeros = jnp.zeros((bs, bs), jnp.float32)
    k_end, kk_t, scores_t = lax.fori_loop(0, bs, token, (jnp.zeros((bs, dk), jnp.float32), zeros, zeros))
    # G per channel as a dot with the lower triangle (no cumsum in Mosaic); exp(G[last]) as a column [Dk, 1]
    # that scales the state's rows, read off the diagonal by a masked lane sum (no [1, Dk] transpose).
    from_start = jnp.exp(dot((col <= row).astype(jnp.float32), g, (1, 0)))  # f32[bs, Dk]
    eye = lax.broadcasted_iota(jnp.int32, (dk, dk), 0) == lax.broadcasted_iota(jnp.int32, (dk, dk), 1)
    total = jnp.sum(jnp.where(eye, jnp.sum(g, axis=0, keepdims=True), 0.0), axis=1, keepdims=True)  # [Dk, 1]
    return _Decays(
        kk_t=jnp.where(row < col, kk_t, 0.0),  # the diagonal k[i] . k[i] is not in A
        scores_t=scores_t,
        q_start=q * from_start,
        k_start=k * from_start,
        k_end=k_end,
        chunk_decay=jnp.exp(total),
    )


def _delta_kernel(
    starts_ref, g_ref, beta_ref, q_ref, k_ref, v_ref, init_ref, o_ref, final_ref, *, decays, scale
):
    """One head: chunk by chunk, the decayed products (`decays`: `_gated_decays` or `_kda_decays`), the UT
    solve, the outputs from the entering state, then the next state.

    starts_ref i32[nb, 1, 1]; g_ref f32[nb, 1, bs] (per head) or f32[nb, bs, Dk] (per key channel); beta_ref
    f32[nb, 1, bs]; q_ref, k_ref f[nb, bs, Dk]; v_ref f[nb, bs, Dv]; init_ref f32[nb, Dk, Dv]; outputs o_ref
    f32[nb, bs, Dv], final_ref f32[nb, Dk, Dv].
    """
    nb, bs, dk = q_ref.shape
    dv = v_ref.shape[-1]
    row = lax.broadcasted_iota(jnp.int32, (bs, bs), 0)
    col = lax.broadcasted_iota(jnp.int32, (bs, bs), 1)

    def chunk(c, state):  # state f32[Dk, Dv] entering chunk c unless chunk c starts a sequence
        state = jnp.where(starts_ref[c] != 0, init_ref[c], state)
        q, k, v = (r[c].astype(jnp.float32) for r in (q_ref, k_ref, v_ref))  # [bs, Dk], [bs, Dk], [bs, Dv]
        beta_row = beta_ref[c]  # f32[1, bs]
        beta_col = jnp.sum(jnp.where(row == col, beta_row, 0.0), axis=1, keepdims=True)  # f32[bs, 1]
        with jax.named_scope("delta_decay"):
            d = decays(q, k, g_ref[c])
        with jax.named_scope("delta_ut_solve"):
            t = _inverse_unit_lower(d.kk_t * beta_row)  # (I + A)^-1, A[i, j] = beta[i] kk_t[j, i]
            w = dot(t, v * beta_col, (1, 0))  # f32[bs, Dv]
            kc = dot(t, d.k_start * beta_col, (1, 0))  # f32[bs, Dk]
            u = w - dot(kc, state, (1, 0))  # f32[bs, Dv]: each token's correction
        with jax.named_scope("delta_outputs"):
            # Within the chunk (a token reads itself) plus the entering state decayed to each token.
            o = dot(d.scores_t, u, (0, 0)) + dot(d.q_start, state, (1, 0))
        o_ref[c] = o * scale
        with jax.named_scope("delta_next_state"):
            state = d.chunk_decay * state + dot(d.k_end, u, (0, 0))  # f32[Dk, Dv]
        final_ref[c] = state
        return state

    lax.fori_loop(0, nb, chunk, jnp.zeros((dk, dv), jnp.float32))


def _prefill(name, decays, gt, q, k, v, beta, init, starts, *, scale, interpret):
    """The pallas_call `name` over heads, given `decays` (`_gated_decays` or `_kda_decays`) and the
    head-major log decays it reads, gt f32[H, nb, 1, bs] or f32[H, nb, bs, Dk]; the rest as the public
    functions take them."""
    nb, bs, h, dk = q.shape
    dv = v.shape[-1]

    # Head-major operands: each program's block is one head's whole prefill section.
    qt, kt, vt = (t.transpose(2, 0, 1, 3) for t in (q, k, v))  # [H, nb, bs, Dk or Dv]
    betat = beta.astype(jnp.float32).transpose(2, 0, 1)[:, :, None, :]  # [H, nb, 1, bs]
    init_t = init.astype(jnp.float32).transpose(1, 0, 2, 3)  # [H, nb, Dk, Dv]
    starts_i = starts.astype(jnp.int32).reshape(nb, 1, 1)

    def head(*trailing):  # the head's block of a head-major array
        return pl.BlockSpec((None, *trailing), lambda i: (i,) + (0,) * len(trailing))

    o, final = pl.pallas_call(
        functools.partial(_delta_kernel, decays=decays, scale=scale),
        grid=(h,),
        in_specs=[
            pl.BlockSpec((nb, 1, 1), lambda i: (0, 0, 0)),
            head(*gt.shape[1:]),
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
        name=name,
    )(starts_i, gt, betat, qt, kt, vt, init_t)
    return o.transpose(1, 2, 0, 3), final.transpose(1, 0, 2, 3)


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
    gt = g.astype(jnp.float32).transpose(2, 0, 1)[:, :, None, :]  # [H, nb, 1, bs]
    return _prefill("gated_delta_prefill", _gated_decays, gt, q, k, v, beta, init, starts, scale=scale,
                    interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def kda_prefill(
    q: jax.Array,  # f[nb, bs, H, Dk] queries of the prefill blocks (L2-normalised)
    k: jax.Array,  # f[nb, bs, H, Dk] keys (L2-normalised); finite on padding tokens
    v: jax.Array,  # f[nb, bs, H, Dv] values
    g: jax.Array,  # f32[nb, bs, H, Dk] log decays g <= 0, one per key channel; 0 on padding tokens
    beta: jax.Array,  # f32[nb, bs, H] write strengths in [0, 1]; 0 on padding tokens
    init: jax.Array,  # f32[nb, H, Dk, Dv] state entering each block that starts a sequence (0 for a new one)
    starts: jax.Array,  # bool[nb] first block of its sequence this step (other blocks' init is not read)
    *,
    scale: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """kernels/delta_rule/reference.py:kda_prefill (the per-key-channel decay) as one Pallas kernel (same
    contract); `interpret` runs it in the Pallas interpreter (CPU). Raises ValueError if g is not per key
    channel (shaped as k).

    Returns (o f32[nb, bs, H, Dv], final f32[nb, H, Dk, Dv]): the state after each block's last token.
    """
    if g.shape != k.shape:
        raise ValueError(f"{g.shape=} must be {k.shape=}: one log decay per key channel")
    gt = g.astype(jnp.float32).transpose(2, 0, 1, 3)  # [H, nb, bs, Dk]
    return _prefill("kda_prefill", _kda_decays, gt, q, k, v, beta, init, starts, scale=scale,
                    interpret=interpret)
