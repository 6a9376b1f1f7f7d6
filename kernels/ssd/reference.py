"""Plain-jnp chunked SSD (Mamba-2 state-space duality) over block-laid-out sequences: initial states in,
final out."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.chains import run_chained, update_pool_chained


def _segment_sum(a: jax.Array) -> jax.Array:
    """f32[..., L, L]: out[..., l, s] = sum(a[..., s+1 : l+1]) for s <= l, -inf above the diagonal

    Summing the masked increments directly (as HF's `segment_sum` does) instead of subtracting two
    cumulative sums keeps the decay exact when the cumulative sums grow large and negative.
    """
    n = a.shape[-1]
    strictly_lower = jnp.tril(jnp.ones((n, n), bool), -1)  # a static mask: no data-dependent loop
    increments = jnp.where(strictly_lower, a[..., :, None], 0.0)  # [..., l, s] = a[l] if l > s
    sums = jnp.cumsum(increments, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((n, n), bool)), sums, -jnp.inf)


def _group_heads(t: jax.Array, groups: int) -> jax.Array:
    """Splits axis 2 (heads) into (groups, heads per group): head h belongs to group h // heads_per_group."""
    return t.reshape(*t.shape[:2], groups, t.shape[2] // groups, *t.shape[3:])


def ssd_prefill(
    x: jax.Array,  # f[nb, bs, H, P] inputs of the prefill blocks
    dt: jax.Array,  # f32[nb, bs, H] softplus'd, biased, clamped step sizes; 0 on padding tokens
    A: jax.Array,  # f32[H] negative decay rates
    B: jax.Array,  # f[nb, bs, G, N]
    C: jax.Array,  # f[nb, bs, G, N]
    # f32[nb, H, P, N] state entering each block that starts a sequence (zeros for a new one)
    init: jax.Array,
    starts: jax.Array,  # bool[nb] first block of its sequence this step (other blocks' init is not read)
) -> tuple[jax.Array, jax.Array]:
    """y[t] = C[t] . h[t], h[t] = exp(dt[t] A) h[t-1] + dt[t] x[t] B[t]^T, one block per SSD chunk.

    Each block is one chunk: its outputs are the masked quadratic ("attention") form within the block
    plus the decayed contribution of the state entering it. States pass from block to block by a
    `lax.scan`; a block that starts a sequence takes its `init`. Head h uses B/C group h // (H // G), as
    HF does. The D skip and the gate are the caller's. Padding tokens need dt = 0 (then they neither
    decay nor feed the state) and finite x.

    Returns (y f32[nb, bs, H, P], final f32[nb, H, P, N]): the state after each block's last real token
    (the state to keep where the block ends its sequence).
    """
    nb, bs, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if h % g:
        raise ValueError(f"num_heads={h} must be a multiple of n_groups={g}")
    x = _group_heads(x.astype(jnp.float32), g)  # [nb, bs, G, R, P], R = H // G
    B, C = B.astype(jnp.float32), C.astype(jnp.float32)
    dt = dt.astype(jnp.float32)
    a = dt * A.astype(jnp.float32)  # [nb, bs, H] log decay of each token, <= 0
    a_cum = jnp.cumsum(a, axis=1)  # [nb, bs, H] log decay from the block start through each token

    with jax.named_scope("ssd_intra_block"):
        decay = jnp.exp(_segment_sum(jnp.moveaxis(a, 1, 2)))  # [nb, H, l, s], 0 above the diagonal
        decay = _group_heads(decay.transpose(0, 2, 1, 3), g)  # [nb, l, G, R, s]
        scores = jnp.einsum("blgn,bsgn->blgs", C, B)  # [nb, l, G, s]
        weights = scores[:, :, :, None, :] * decay * _group_heads(dt, g).transpose(0, 2, 3, 1)[:, None]
        y = jnp.einsum("blgrs,bsgrp->blgrp", weights, x)  # [nb, bs, G, R, P]

    with jax.named_scope("ssd_block_states"):
        # State each block builds from zeros: sum_s exp(a_cum[last] - a_cum[s]) dt[s] x[s] B[s]^T.
        to_end = _group_heads(jnp.exp(a_cum[:, -1:] - a_cum) * dt, g)  # [nb, bs, G, R]
        block_states = jnp.einsum("bsgn,bsgr,bsgrp->bgrpn", B, to_end, x).reshape(nb, h, p, n)
        block_decay = jnp.exp(a_cum[:, -1])  # [nb, H] decay across the whole block

    with jax.named_scope("ssd_inter_block"):
        def step(carry, blk):
            start, init, decay_b, state_b = blk
            entering = jnp.where(start, init, carry)
            leaving = entering * decay_b[:, None, None] + state_b
            return leaving, (entering, leaving)

        _, (entering, leaving) = jax.lax.scan(
            step, jnp.zeros((h, p, n), jnp.float32),
            (starts, init.astype(jnp.float32), block_decay, block_states),
        )
        # Output of the state entering the block, decayed to each token: exp(a_cum[l]) C[l] . h_in.
        entering = entering.reshape(nb, g, h // g, p, n)
        y = y + jnp.einsum("blgn,bgrpn->blgrp", C, entering) * _group_heads(jnp.exp(a_cum), g)[..., None]

    return y.reshape(nb, bs, h, p), leaving


def ssd_decode(
    x: jax.Array,  # f[D, H, P] one input per decode row
    dt: jax.Array,  # f32[D, H] softplus'd, biased, clamped step sizes
    A: jax.Array,  # f32[H] negative decay rates
    B: jax.Array,  # f[D, G, N]
    C: jax.Array,  # f[D, G, N]
    state: jax.Array,  # f32[D, H, P, N] each row's state before this token
) -> tuple[jax.Array, jax.Array]:
    """One recurrent step per decode row (no D skip, no gate); returns (y f32[D, H, P], new state)."""
    d, h, p = x.shape
    g = B.shape[1]
    x32 = x.astype(jnp.float32).reshape(d, g, h // g, p)
    dt = dt.astype(jnp.float32).reshape(d, g, h // g)
    decay = jnp.exp(dt * A.astype(jnp.float32).reshape(g, h // g))  # [D, G, R]
    state = state.astype(jnp.float32).reshape(d, g, h // g, p, -1)
    B, C = B.astype(jnp.float32), C.astype(jnp.float32)
    new_state = state * decay[..., None, None] + jnp.einsum("dgr,dgrp,dgn->dgrpn", dt, x32, B)
    # y = C . new_state, expanded so that it reads the old state instead: otherwise XLA computes the new
    # state twice (once for y, once for the caller's scatter), a full pass over the states each.
    y = decay[..., None] * jnp.einsum("dgrpn,dgn->dgrp", state, C)
    y = y + (dt * jnp.einsum("dgn,dgn->dg", B, C)[..., None])[..., None] * x32
    return y.reshape(d, h, p), new_state.reshape(d, h, p, -1)


def ssd_decode_rows(
    x: jax.Array,  # f[D, H, P]
    dt: jax.Array,  # f32[D, H]
    A: jax.Array,  # f32[H]
    B: jax.Array,  # f[D, G, N]
    C: jax.Array,  # f[D, G, N]
    state: jax.Array,  # f32[D, H, P, N] each row's own initial state
    chained: jax.Array | None = None,  # bool[D] the row continues the row before it (kernels/chains.py)
) -> tuple[jax.Array, jax.Array]:
    """`ssd_decode` where a chained row starts from the state the row before it ends with (speculative draft
    rows): the multi-step state update, every intermediate state kept (one per row)."""
    return run_chained(lambda s: ssd_decode(x, dt, A, B, C, s), state, chained)


def ssd_decode_update(
    x: jax.Array,  # f[D, H, P]
    dt: jax.Array,  # f32[D, H]
    A: jax.Array,  # f32[H]
    B: jax.Array,  # f[D, G, N]
    C: jax.Array,  # f[D, G, N]
    pool: jax.Array,  # f32[layers, slots, H, P, N] the SSM state pool
    layer: jax.Array | int,
    slots: jax.Array,  # i32[D] each decode row's slot (its state is read from there)
    write_slots: jax.Array | None = None,  # i32[D] where each row's new state goes (default: `slots`)
) -> tuple[jax.Array, jax.Array]:
    """`ssd_decode` on rows `slots` of layer `layer` of the pool; returns (y f32[D, H, P], updated pool).

    With `write_slots`, a row that reads the slot the row before it writes continues that row's state (a
    chain of draft rows, kernels/chains.py)."""
    return update_pool_chained(lambda s: ssd_decode(x, dt, A, B, C, s), pool, layer, slots, write_slots)
