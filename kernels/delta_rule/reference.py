"""Plain-jnp chunked gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention) over block-laid-out
sequences.

The recurrence, per value head with state S [Dk, Dv] (HF's `torch_recurrent_gated_delta_rule`): for each
token t, S' = exp(g[t]) S[t-1], S[t] = S' + k[t]^T beta[t] (v[t] - k[t] S') and o[t] = scale * q[t] S[t],
so a token attends to itself. q and k come L2-normalised and repeated to the value heads by the caller.
Initial states come in, final states go out (see kernels/gla/reference.py for the same layout).

Kimi Delta Attention (KDA, Kimi-Linear) is the same rule with a log decay per key channel, diag(exp(g[t])) S:
`kda_prefill`, `kda_decode` and `kda_decode_update` below, sharing the per-head form's WY block machinery.
"""

from __future__ import annotations

import os

# XLA:CPU runs solve_triangular as a LAPACK call into scipy's OpenBLAS, which scipy loads at the first solve
# and which then starts a thread per core next to XLA's own: on 2 shared cores a [64, 8, 64, 64] x 256
# solve took 488 ms against 90 ms single-threaded (prefill of Qwen3-Next fell from 230 to 50 tokens/s).
# Set here, before scipy is loaded (a value the user set is kept; too late once scipy is loaded).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels.chains import run_chained, update_pool_chained  # noqa: E402

_HIGHEST = jax.lax.Precision.HIGHEST  # float32-accurate contractions on every backend (TPU defaults to bf16)


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=_HIGHEST)


def _segment_sum(a: jax.Array) -> jax.Array:
    """f32[..., L, L]: out[..., l, s] = sum(a[..., s+1 : l+1]) for s <= l, -inf above the diagonal.

    Summing the masked increments (rather than subtracting two cumulative sums) keeps the decay exact
    when the cumulative sums grow large and negative.
    """
    n = a.shape[-1]
    strictly_lower = jnp.tril(jnp.ones((n, n), bool), -1)  # static masks: no data-dependent loop
    increments = jnp.where(strictly_lower, a[..., :, None], 0.0)  # [..., l, s] = a[l] if l > s
    sums = jnp.cumsum(increments, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((n, n), bool)), sums, -jnp.inf)


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
) -> tuple[jax.Array, jax.Array]:
    """o[t] = scale * q[t] S[t] under the gated delta rule, one block per chunk (the WY / UT-transform form).

    Within a block, with G the cumulative log decay from the block start and S0 the state entering it, the
    corrections u[t] = beta[t] (v[t] - k[t] S') that each token writes solve the unit lower-triangular
    system (I + A) u = beta v - beta exp(G) k S0 with A[i, j] = beta[i] (k[i] . k[j]) exp(G[i] - G[j]) for
    j < i. The solve is done once per block for both right-hand sides (u = w - kc S0), so that the block is
    an affine map of its entering state: S_out = (exp(G[last]) I - K_dec^T kc) S0 + K_dec^T w, with
    K_dec[j] = exp(G[last] - G[j]) k[j]. States pass from block to block by a `lax.scan` over those maps;
    a block that starts a sequence takes its `init`. The outputs are then, for every block at once, the
    masked quadratic form over u within the block plus the decayed read of the entering state. Decays only
    ever appear as exp of a non-positive number. Padding tokens must not change the state: pass beta = 0
    and g = 0 on them (with finite q, k, v).

    Returns (o f32[nb, bs, H, Dv], final f32[nb, H, Dk, Dv]): the state after each block's last token (the
    state to keep where the block ends its sequence).
    """
    q, k, v, g, beta = (t.astype(jnp.float32) for t in (q, k, v, g, beta))
    g_cum = jnp.cumsum(g, axis=1)  # [nb, bs, H] log decay from the block start through each token

    with jax.named_scope("gated_delta_intra_block"):
        decay = jnp.exp(_segment_sum(jnp.moveaxis(g, 1, 2)))  # [nb, H, l, s], 0 above the diagonal
        # The UT system: only its strictly lower triangle is read (the solve takes a unit diagonal).
        a = _einsum("blhk,bshk->bhls", k, k) * decay * jnp.moveaxis(beta, 1, 2)[..., None]
        scores = _einsum("blhk,bshk->bhls", q, k) * decay  # [nb, H, l, s], token l reads s <= l

    from_start = jnp.exp(g_cum)[..., None]  # [nb, bs, H, 1]
    to_end = jnp.exp(g_cum[:, -1:] - g_cum)[..., None]  # [nb, bs, H, 1] decay from each token to the end
    block_decay = jnp.exp(g_cum[:, -1])[..., None, None]  # [nb, H, 1, 1] decay across the whole block
    o, leaving = _wy_blocks("gated_delta", a, scores, q * from_start, k * from_start, k * to_end, v, beta,
                            block_decay, init, starts)
    return o * scale, leaving


def _wy_blocks(
    name: str,
    a: jax.Array,  # f32[nb, H, l, s] UT system, strictly lower triangle read: beta[l] decayed (k[l] . k[s])
    scores: jax.Array,  # f32[nb, H, l, s] decayed (q[l] . k[s]) for s <= l, 0 above the diagonal
    q_start: jax.Array,  # f32[nb, bs, H, Dk] queries decayed from the block start: q[l] exp(G[l])
    k_start: jax.Array,  # f32[nb, bs, H, Dk] keys decayed from the block start: k[l] exp(G[l])
    k_end: jax.Array,  # f32[nb, bs, H, Dk] keys decayed to the block end: k[s] exp(G[last] - G[s])
    v: jax.Array,  # f32[nb, bs, H, Dv]
    beta: jax.Array,  # f32[nb, bs, H]
    block_decay: jax.Array,  # f32[nb, H, Dk or 1, 1] the decay across the whole block, a diagonal
    init: jax.Array,
    starts: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The WY form of a delta rule given its decayed within-block products (shared by the per-head and the
    per-key-channel decays): the UT solve, the blocks' affine maps of their entering states, the scan over
    them and the outputs. Returns (o unscaled f32[nb, bs, H, Dv], the state after each block)."""
    dk, dv = k_start.shape[-1], v.shape[-1]
    with jax.named_scope(f"{name}_intra_block"):
        # Both right-hand sides in one solve: beta v (-> w) and beta exp(G) k (-> kc, read against S0).
        rhs = jnp.concatenate([v, k_start], axis=-1) * beta[..., None]
        sol = jax.scipy.linalg.solve_triangular(a, jnp.moveaxis(rhs, 1, 2), lower=True, unit_diagonal=True)
        sol = jnp.moveaxis(sol, 2, 1)  # [nb, bs, H, Dv + Dk]
        w, kc = sol[..., :dv], sol[..., dv:]  # u = w - kc S0: [nb, bs, H, Dv], [nb, bs, H, Dk]

    with jax.named_scope(f"{name}_block_maps"):
        # Each block maps the state S0 entering it to transitions @ S0 + block_states.
        block_states = _einsum("bshk,bshv->bhkv", k_end, w)  # the state the block builds from zeros
        transitions = block_decay * jnp.eye(dk, dtype=jnp.float32) - _einsum("bshk,bshj->bhkj", k_end, kc)

    with jax.named_scope(f"{name}_inter_block"):
        def step(carry, blk):
            start, init, transition, state_b = blk
            entering = jnp.where(start, init, carry)
            leaving = _einsum("hkj,hjv->hkv", transition, entering) + state_b
            return leaving, (entering, leaving)

        _, (entering, leaving) = jax.lax.scan(
            step,
            jnp.zeros(init.shape[1:], jnp.float32),
            (starts, init.astype(jnp.float32), transitions, block_states),
        )
        u = w - _einsum("blhk,bhkv->blhv", kc, entering)  # [nb, bs, H, Dv] each token's correction
        # Within the block plus the entering state decayed to each token: exp(G[l]) q[l] S_in.
        o = _einsum("bhls,bshv->blhv", scores, u)
        o = o + _einsum("blhk,bhkv->blhv", q_start, entering)
    return o, leaving


def gated_delta_decode(
    q: jax.Array,  # f[D, H, Dk] one query per decode row (L2-normalised)
    k: jax.Array,  # f[D, H, Dk] (L2-normalised)
    v: jax.Array,  # f[D, H, Dv]
    g: jax.Array,  # f32[D, H] log decays g <= 0
    beta: jax.Array,  # f32[D, H] write strengths in [0, 1]
    state: jax.Array,  # f32[D, H, Dk, Dv] each row's state before this token
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """One recurrent step per decode row; returns (o f32[D, H, Dv], new state f32[D, H, Dk, Dv])."""
    q, k, v, g, beta = (t.astype(jnp.float32) for t in (q, k, v, g, beta))
    decay = jnp.exp(g)[..., None, None]  # [D, H, 1, 1]
    state = state.astype(jnp.float32)
    # Both reads of the old state (k's for the delta, q's for the output) in one pass over it, and o
    # expanded so that it reads the old state: otherwise XLA computes the new state twice (once for o, once
    # for the caller's scatter), a full pass over the states each.
    reads = decay * _einsum("dhnk,dhkv->dhnv", jnp.stack([k, q], axis=2), state)  # [D, H, 2, Dv]
    delta = beta[..., None] * (v - reads[:, :, 0])  # [D, H, Dv] the correction this token writes
    new_state = state * decay + k[..., :, None] * delta[..., None, :]
    o = reads[:, :, 1] + _einsum("dhk,dhk->dh", q, k)[..., None] * delta  # q . new_state
    return o * scale, new_state


def gated_delta_decode_rows(
    q: jax.Array,  # f[D, H, Dk]
    k: jax.Array,  # f[D, H, Dk]
    v: jax.Array,  # f[D, H, Dv]
    g: jax.Array,  # f32[D, H]
    beta: jax.Array,  # f32[D, H]
    state: jax.Array,  # f32[D, H, Dk, Dv] each row's own initial state
    chained: jax.Array | None = None,  # bool[D] the row continues the row before it (kernels/chains.py)
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """`gated_delta_decode` where a chained row starts from the state the row before it ends with (speculative
    draft rows): the multi-step state update, every intermediate state kept (one per row), so that rolling
    back a rejected draft is choosing a state. Returns (o f32[D, H, Dv], new state f32[D, H, Dk, Dv])."""
    return run_chained(lambda s: gated_delta_decode(q, k, v, g, beta, s, scale=scale), state, chained)


def gated_delta_decode_update(
    q: jax.Array,  # f[D, H, Dk]
    k: jax.Array,  # f[D, H, Dk]
    v: jax.Array,  # f[D, H, Dv]
    g: jax.Array,  # f32[D, H]
    beta: jax.Array,  # f32[D, H]
    pool: jax.Array,  # f32[layers, slots, H, Dk, Dv] the recurrent state pool
    layer: jax.Array | int,
    slots: jax.Array,  # i32[D] each decode row's slot (its state is read from there)
    write_slots: jax.Array | None = None,  # i32[D] where each row's new state goes (default: `slots`)
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """`gated_delta_decode` on rows `slots` of layer `layer` of the pool f32[layers, slots, H, Dk, Dv];
    returns (o f32[D, H, Dv], updated pool).

    With `write_slots`, a row that reads the slot the row before it writes continues that row's state (a
    chain of draft rows, kernels/chains.py)."""
    return update_pool_chained(lambda s: gated_delta_decode(q, k, v, g, beta, s, scale=scale), pool, layer,
                               slots, write_slots)


# Kimi Delta Attention (KDA, Kimi-Linear's linear attention): the gated delta rule with one log decay per key
# channel instead of one per head. Per value head, for each token t (HF's `recurrent_kimi_delta_attention`):
# S' = diag(exp(g[t])) S[t-1], S[t] = S' + k[t]^T beta[t] (v[t] - k[t] S'), o[t] = scale * q[t] S[t].


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
) -> tuple[jax.Array, jax.Array]:
    """`gated_delta_prefill` with a decay per key channel (KDA), one block per chunk (the WY form).

    With G[t] the cumulative log decay per channel from the block start, the decays become elementwise
    over the key channels: A[i, j] = beta[i] sum_c k[i, c] k[j, c] exp(G[i, c] - G[j, c]) for j < i, the
    scores q[l] . (k[s] exp(G[l] - G[s])) for s <= l, the entering state read as (q[l] exp(G[l])) S0, and the
    block's map S_out = diag(exp(G[last])) S0 + sum_j (k[j] exp(G[last] - G[j]))^T u[j]. The pairwise
    products are matmuls of keys and queries decayed to a reference point between the two tokens
    (`_kda_pairs`), every decay a product of exp(g) <= 1, so never the exp of a positive number. Padding
    tokens: beta = 0 and g = 0 (with finite q, k, v).

    Returns (o f32[nb, bs, H, Dv], final f32[nb, H, Dk, Dv]): the state after each block's last token.
    """
    q, k, v, g, beta = (t.astype(jnp.float32) for t in (q, k, v, g, beta))
    with jax.named_scope("kda_intra_block"):
        kk, scores, from_start, to_end = _kda_pairs(q, k, g)
        a = kk * jnp.moveaxis(beta, 1, 2)[..., None]  # [nb, H, l, s] the UT system
    block_decay = from_start[:, :, -1, :, None]  # [nb, H, Dk, 1] the diagonal decay across the whole block
    from_start, to_end = jnp.moveaxis(from_start, 1, 2), jnp.moveaxis(to_end, 1, 2)  # [nb, bs, H, Dk]
    o, leaving = _wy_blocks("kda", a, scores, q * from_start, k * from_start, k * to_end, v, beta,
                            block_decay, init, starts)
    return o * scale, leaving


def _kda_pairs(
    q: jax.Array,  # f32[nb, bs, H, Dk]
    k: jax.Array,  # f32[nb, bs, H, Dk]
    g: jax.Array,  # f32[nb, bs, H, Dk] log decays <= 0
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """KDA's decayed within-block products by recursive halving: (kk f32[nb, H, l, s], decayed k[l] . k[s]
    for s < l, 0 on and above the diagonal; scores f32[nb, H, l, s], decayed q[l] . k[s] for s <= l, 0 above;
    from_start f32[nb, H, bs, Dk], exp(G[l]); to_end f32[nb, H, bs, Dk], exp(G[last] - G[s])).

    The block (padded to a power of two with g = 0, q = k = 0 tokens: a block of 100 costs one of 128 here)
    is split in halves, each half in halves, down to single tokens. Tokens i > j first separated at some
    level sit in the right and the left half of one span, r the boundary between them, and exp(G[i] - G[j])
    = exp(G[i] - G[r]) exp(G[r] - G[j]): each span's cross block is one matmul of (x[i] exp(G[i] - G[r])) by
    (k[j] exp(G[r] - G[j])), both decays <= 1 (if one underflows to 0, the true product is smaller still).
    Going up a level, the decays from each span's start and to its end are multiplied by the other half's
    whole decay, so every decay is a product of exp(g) <= 1 (bs x Dk exps in all, never one of a difference
    of cumulative sums). Why not explicit [c, c, Dk] decays within sub-chunks of c tokens and matmuls across
    them: measured on CPU (32 heads of 128), with c = 16 those products took 116 ms for 4 x 64 tokens and
    1.2 s for 16 x 128, against 18 ms and 0.2-0.4 s here: the explicit decays are c passes over bs x Dk, an
    exp and a reduction over Dk each, and the decays across sub-chunks differ per pair of sub-chunks.
    """
    nb, bs, h, dk = k.shape
    size = 1 << (bs - 1).bit_length()
    q, k, g = (jnp.moveaxis(jnp.pad(t, [(0, 0), (0, size - bs), (0, 0), (0, 0)]), 2, 1) for t in (q, k, g))
    # [nb, H, size, Dk]: each token's decays from its span's start (through itself) and to its span's end.
    from_start, to_end = jnp.exp(g), jnp.ones_like(g)
    # [nb, H, size / span, 2, span, span]: the spans' diagonal blocks of kk (row 0) and scores (row 1); for
    # single tokens 0 (A's unit diagonal is the solve's) and q . k (a token reads itself).
    diagonal = jnp.sum(q * k, axis=-1)  # [nb, H, size]
    pairs = jnp.stack([jnp.zeros_like(diagonal), diagonal], axis=-1)[..., None, None]
    span = 1
    while span < size:
        m = size // (2 * span)  # spans of 2 * span tokens, each a left and a right half

        def halves(t):  # [nb, H, size, Dk] -> [nb, H, m, 2, span, Dk]
            return t.reshape(nb, h, m, 2, span, dk)

        f, e, kh, qh = halves(from_start), halves(to_end), halves(k), halves(q)
        right = jnp.stack([kh[:, :, :, 1], qh[:, :, :, 1]], axis=3) * f[:, :, :, 1, None]  # [.., m, 2, i, Dk]
        cross = _einsum("bhmxid,bhmjd->bhmxij", right, kh[:, :, :, 0] * e[:, :, :, 0])  # [nb, H, m, 2, i, j]
        blocks = pairs.reshape(nb, h, m, 2, 2, span, span)  # [.., m, half, x, i, j]
        top = jnp.concatenate([blocks[:, :, :, 0], jnp.zeros_like(cross)], axis=-1)
        bottom = jnp.concatenate([cross, blocks[:, :, :, 1]], axis=-1)
        pairs = jnp.concatenate([top, bottom], axis=-2)  # [nb, H, m, 2, 2 span, 2 span]
        # The right half's tokens now also decay through the left half; the left half's, through the right.
        left_decay, right_decay = f[:, :, :, 0, -1:], f[:, :, :, 1, -1:]  # [nb, H, m, 1, Dk] whole halves
        from_start = jnp.concatenate([f[:, :, :, 0], f[:, :, :, 1] * left_decay], axis=3).reshape(g.shape)
        to_end = jnp.concatenate([e[:, :, :, 0] * right_decay, e[:, :, :, 1]], axis=3).reshape(g.shape)
        span *= 2
    pairs = pairs.reshape(nb, h, 2, size, size)[..., :bs, :bs]
    return pairs[:, :, 0], pairs[:, :, 1], from_start[:, :, :bs], to_end[:, :, :bs]


def kda_decode(
    q: jax.Array,  # f[D, H, Dk] one query per decode row (L2-normalised)
    k: jax.Array,  # f[D, H, Dk] (L2-normalised)
    v: jax.Array,  # f[D, H, Dv]
    g: jax.Array,  # f32[D, H, Dk] log decays g <= 0, one per key channel
    beta: jax.Array,  # f32[D, H] write strengths in [0, 1]
    state: jax.Array,  # f32[D, H, Dk, Dv] each row's state before this token
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """One KDA step per decode row; returns (o f32[D, H, Dv], new state f32[D, H, Dk, Dv]).

    As `gated_delta_decode`, o is expanded to read the old state only: with S' = diag(exp(g)) S,
    k S' = (k exp(g)) S and q S[t] = (q exp(g)) S + (q . k) delta."""
    q, k, v, g, beta = (t.astype(jnp.float32) for t in (q, k, v, g, beta))
    decay = jnp.exp(g)  # [D, H, Dk]
    state = state.astype(jnp.float32)
    reads = _einsum("dhnk,dhkv->dhnv", jnp.stack([k * decay, q * decay], axis=2), state)  # [D, H, 2, Dv]
    delta = beta[..., None] * (v - reads[:, :, 0])  # [D, H, Dv] the correction this token writes
    new_state = state * decay[..., None] + k[..., :, None] * delta[..., None, :]
    o = reads[:, :, 1] + _einsum("dhk,dhk->dh", q, k)[..., None] * delta  # q . new_state
    return o * scale, new_state


def kda_decode_rows(
    q: jax.Array,  # f[D, H, Dk]
    k: jax.Array,  # f[D, H, Dk]
    v: jax.Array,  # f[D, H, Dv]
    g: jax.Array,  # f32[D, H, Dk]
    beta: jax.Array,  # f32[D, H]
    state: jax.Array,  # f32[D, H, Dk, Dv] each row's own initial state
    chained: jax.Array | None = None,  # bool[D] the row continues the row before it (kernels/chains.py)
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """`kda_decode` with chained rows continuing the row before (as `gated_delta_decode_rows`); returns
    (o f32[D, H, Dv], new state f32[D, H, Dk, Dv])."""
    return run_chained(lambda s: kda_decode(q, k, v, g, beta, s, scale=scale), state, chained)


def kda_decode_update(
    q: jax.Array,  # f[D, H, Dk]
    k: jax.Array,  # f[D, H, Dk]
    v: jax.Array,  # f[D, H, Dv]
    g: jax.Array,  # f32[D, H, Dk]
    beta: jax.Array,  # f32[D, H]
    pool: jax.Array,  # f32[layers, slots, H, Dk, Dv] the recurrent state pool
    layer: jax.Array | int,
    slots: jax.Array,  # i32[D] each decode row's slot (its state is read from there)
    write_slots: jax.Array | None = None,  # i32[D] where each row's new state goes (default: `slots`)
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """`kda_decode` on rows `slots` of layer `layer` of the pool, chained rows continuing the row before
    (as `gated_delta_decode_update`); returns (o f32[D, H, Dv], updated pool)."""
    return update_pool_chained(lambda s: kda_decode(q, k, v, g, beta, s, scale=scale), pool, layer, slots,
                               write_slots)
