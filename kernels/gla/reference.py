"""Plain-jnp chunked Lightning / simple-GLA linear attention over block-laid-out sequences.

The recurrence (MiniMax's Lightning attention; simple GLA with a scalar decay per head and token):
S[t] = exp(g[t]) S[t-1] + k[t]^T v[t] and o[t] = scale * q[t] S[t], so a token attends to itself.
Initial states come in, final states go out (see kernels/ssd/reference.py for the same layout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def gla_prefill(
    q: jax.Array,  # f[nb, bs, H, K] queries of the prefill blocks
    k: jax.Array,  # f[nb, bs, H, K] keys; 0 on padding tokens
    v: jax.Array,  # f[nb, bs, H, V] values
    log_decay: jax.Array,  # f32[H] (per head, every token) or f32[nb, bs, H] log decays g <= 0; 0 on padding
    init: jax.Array,  # f32[nb, H, K, V] state entering each block that starts a sequence (0 for a new one)
    starts: jax.Array,  # bool[nb] first block of its sequence this step (other blocks' init is not read)
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """o[t] = scale * q[t] S[t], S[t] = exp(g[t]) S[t-1] + k[t]^T v[t], one block per chunk.

    Each block is one chunk: its outputs are the masked quadratic form within the block (decays in float32
    log space) plus the decayed contribution of the state entering it. States pass from block to block by
    a `lax.scan`; a block that starts a sequence takes its `init`. Padding tokens must not change the
    state: pass k = 0 (or v = 0) and g = 0 on them (a per-head `log_decay` [H] decays them too, so give
    the [nb, bs, H] form when blocks are padded).

    Returns (o f32[nb, bs, H, V], final f32[nb, H, K, V]): the state after each block's last token (the
    state to keep where the block ends its sequence).
    """
    nb, bs, h, _ = q.shape
    q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    g = jnp.broadcast_to(log_decay.astype(jnp.float32), (nb, bs, h))  # [nb, bs, H]
    g_cum = jnp.cumsum(g, axis=1)  # [nb, bs, H] log decay from the block start through each token

    with jax.named_scope("gla_intra_block"):
        decay = jnp.exp(_segment_sum(jnp.moveaxis(g, 1, 2)))  # [nb, H, l, s], 0 above the diagonal
        scores = jnp.einsum("blhk,bshk->bhls", q, k) * decay
        o = jnp.einsum("bhls,bshv->blhv", scores, v)  # [nb, bs, H, V]

    with jax.named_scope("gla_block_states"):
        # State each block builds from zeros: sum_s exp(g_cum[last] - g_cum[s]) k[s]^T v[s].
        to_end = jnp.exp(g_cum[:, -1:] - g_cum)  # [nb, bs, H]
        block_states = jnp.einsum("bshk,bsh,bshv->bhkv", k, to_end, v)
        block_decay = jnp.exp(g_cum[:, -1])  # [nb, H] decay across the whole block

    with jax.named_scope("gla_inter_block"):
        def step(carry, blk):
            start, init, decay_b, state_b = blk
            entering = jnp.where(start, init, carry)
            leaving = entering * decay_b[:, None, None] + state_b
            return leaving, (entering, leaving)

        _, (entering, leaving) = jax.lax.scan(
            step,
            jnp.zeros(init.shape[1:], jnp.float32),
            (starts, init.astype(jnp.float32), block_decay, block_states),
        )
        # Output of the state entering the block, decayed to each token: exp(g_cum[l]) q[l] S_in.
        o = o + jnp.einsum("blhk,bhkv->blhv", q * jnp.exp(g_cum)[..., None], entering)

    return o * scale, leaving


def gla_decode(
    q: jax.Array,  # f[D, H, K] one query per decode row
    k: jax.Array,  # f[D, H, K]
    v: jax.Array,  # f[D, H, V]
    log_decay: jax.Array,  # f32[H] or f32[D, H] log decays g <= 0
    state: jax.Array,  # f32[D, H, K, V] each row's state before this token
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """One recurrent step per decode row; returns (o f32[D, H, V], new state f32[D, H, K, V])."""
    d, h, _ = q.shape
    q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    decay = jnp.exp(jnp.broadcast_to(log_decay.astype(jnp.float32), (d, h)))  # [D, H]
    state = state.astype(jnp.float32)
    new_state = state * decay[..., None, None] + jnp.einsum("dhk,dhv->dhkv", k, v)
    # o = q . new_state, expanded so that it reads the old state: otherwise XLA computes the new state
    # twice (once for o, once for the caller's scatter), a full pass over the states each.
    o = decay[..., None] * jnp.einsum("dhk,dhkv->dhv", q, state)
    o = o + jnp.einsum("dhk,dhk->dh", q, k)[..., None] * v
    return o * scale, new_state
