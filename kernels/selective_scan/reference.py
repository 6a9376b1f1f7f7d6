"""Plain-jnp Mamba-1 selective scan over block-laid-out sequences, with initial and final SSM states."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _combine(left, right):
    """Composes two steps h -> a * h + b (left first): the associative operator of a linear recurrence."""
    a_left, b_left = left
    a_right, b_right = right
    return a_left * a_right, a_right * b_left + b_right


def selective_scan_prefill(
    u: jax.Array,  # f[num_blocks, block_size, Dn] scan inputs (the conv output x)
    dt: jax.Array,  # f32[num_blocks, block_size, Dn] softplus(dt_proj + bias); 0 on padding tokens
    A: jax.Array,  # f32[Dn, N] negative (-exp(A_log))
    B: jax.Array,  # f[num_blocks, block_size, N]
    C: jax.Array,  # f[num_blocks, block_size, N]
    init: jax.Array,  # f32[num_blocks, Dn, N] state before the block (read only where `starts`)
    starts: jax.Array,  # bool[num_blocks] first block of its sequence this step
) -> tuple[jax.Array, jax.Array]:
    """y[t] = C[t] . h[t] with h[t] = exp(dt[t] A) * h[t-1] + dt[t] B[t] u[t], per channel d and state n.

    Each prefill block is one chunk: an associative scan over its tokens from a zero state gives the
    block-local states, a `lax.scan` over blocks carries the incoming state (at a block that `starts` a
    sequence: `init`, which the caller sets to zeros for a sequence at position 0; `init` is not read
    elsewhere, so whatever it holds there never leaks in), and the incoming state's decayed contribution
    is added to every token's output. dt must be 0 on padding tokens so they leave the state unchanged
    (decay 1, input 0). The D skip and the z gate are the caller's. Returns (y f32[num_blocks, block_size,
    Dn], final f32[num_blocks, Dn, N]): the state after each block's last real token (the one to keep
    where the block ends its sequence).
    """
    nb, bs, dn = u.shape
    n = A.shape[1]
    if dt.shape != (nb, bs, dn) or {B.shape, C.shape} != {(nb, bs, n)} or init.shape != (nb, dn, n):
        raise ValueError(
            f"shapes disagree: u {u.shape}, dt {dt.shape}, A {A.shape}, B {B.shape}, C {C.shape}, "
            f"init {init.shape}"
        )
    dt = dt.astype(jnp.float32)
    B, C = B.astype(jnp.float32), C.astype(jnp.float32)
    log_decay = dt[..., None] * A.astype(jnp.float32)  # [nb, bs, Dn, N] <= 0
    inputs = (dt * u.astype(jnp.float32))[..., None] * B[:, :, None, :]  # [nb, bs, Dn, N]
    with jax.named_scope("intra_block"):
        # decay[t] = prod_{s<=t} exp(dt[s] A) is the factor the block's incoming state picks up by token t;
        # summed in float32 log space (as the SSD kernels keep decay) rather than multiplied factor by factor.
        decay = jnp.exp(jnp.cumsum(log_decay, axis=1))
        _, local = jax.lax.associative_scan(_combine, (jnp.exp(log_decay), inputs), axis=1)  # from zero state
    with jax.named_scope("inter_block"):

        def step(carry, block):
            start, init_b, decay_last, local_last = block
            incoming = jnp.where(start, init_b.astype(jnp.float32), carry)
            return decay_last * incoming + local_last, incoming

        _, incoming = jax.lax.scan(
            step, jnp.zeros((dn, n), jnp.float32), (starts, init, decay[:, -1], local[:, -1])
        )  # incoming: [nb, Dn, N] state before each block's first token
    states = local + decay * incoming[:, None]  # [nb, bs, Dn, N]
    y = jnp.einsum("btdn,btn->btd", states, C)
    # Padding leaves the state alone: the state after a block's last row is the one after its last real token.
    return y, states[:, -1]


def selective_scan_decode(
    u: jax.Array,  # f[D, Dn] one input per decode row
    dt: jax.Array,  # f32[D, Dn] softplus'd, bias added
    A: jax.Array,  # f32[Dn, N]
    B: jax.Array,  # f[D, N]
    C: jax.Array,  # f[D, N]
    state: jax.Array,  # f32[D, Dn, N] each row's state before its token
) -> tuple[jax.Array, jax.Array]:
    """One recurrence step per decode row: returns (y f32[D, Dn], the rows' new states f32[D, Dn, N])."""
    dt = dt.astype(jnp.float32)
    decay = jnp.exp(dt[..., None] * A.astype(jnp.float32))  # [D, Dn, N]; r below indexes decode rows
    inputs = (dt * u.astype(jnp.float32))[..., None] * B.astype(jnp.float32)[:, None, :]
    new_state = decay * state.astype(jnp.float32) + inputs  # [D, Dn, N]
    y = jnp.einsum("rdn,rn->rd", new_state, C.astype(jnp.float32))
    return y, new_state
