"""Plain-jnp Mamba-1 selective scan over block-laid-out sequences, reading and writing an SSM-state pool."""

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
    ssm_pool: jax.Array,  # f32[num_layers, slots, Dn, N]
    layer: jax.Array | int,
    slots: jax.Array,  # i32[num_blocks] state slot of each block's sequence (0: padding)
    starts: jax.Array,  # bool[num_blocks] first block of its sequence this step
    ends: jax.Array,  # bool[num_blocks] last block of its sequence this step
    has_init: jax.Array,  # bool[num_blocks] continue from the slot's state (else zeros)
) -> tuple[jax.Array, jax.Array]:
    """y[t] = C[t] . h[t] with h[t] = exp(dt[t] A) * h[t-1] + dt[t] B[t] u[t], per channel d and state n.

    Each prefill block is one chunk: an associative scan over its tokens from a zero state gives the
    block-local states, a `lax.scan` over blocks carries the incoming state (at a block that `starts` a
    sequence: the slot's state if `has_init`, else zeros; the slot is not read otherwise, so stale or
    NaN contents never leak in), and the incoming state's decayed contribution is added to every
    token's output. dt must be 0 on padding tokens so they leave the state unchanged (decay 1, input 0).
    The D skip and the z gate are the caller's. Returns (y f32[num_blocks, block_size, Dn], ssm_pool) with
    each sequence's final state written to its slot at its `ends` block (other blocks write the dummy 0).
    """
    nb, bs, dn = u.shape
    n = A.shape[1]
    if dt.shape != (nb, bs, dn) or B.shape != (nb, bs, n) or C.shape != (nb, bs, n):
        raise ValueError(f"shapes disagree: u {u.shape}, dt {dt.shape}, A {A.shape}, B {B.shape}, C {C.shape}")
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
        stored = ssm_pool[layer, slots]  # [nb, Dn, N]
        fresh = jnp.where(has_init[:, None, None], stored, 0.0)

        def step(carry, block):
            start, fresh_b, decay_last, local_last = block
            incoming = jnp.where(start, fresh_b, carry)
            return decay_last * incoming + local_last, incoming

        _, incoming = jax.lax.scan(
            step, jnp.zeros((dn, n), jnp.float32), (starts, fresh, decay[:, -1], local[:, -1])
        )  # incoming: [nb, Dn, N] state before each block's first token
    states = local + decay * incoming[:, None]  # [nb, bs, Dn, N]
    y = jnp.einsum("btdn,btn->btd", states, C)
    # Padding leaves the state alone, so the state after a block's last row is the one after its last real token.
    write_to = jnp.where(ends, slots, 0)
    ssm_pool = ssm_pool.at[layer, write_to].set(states[:, -1].astype(ssm_pool.dtype))
    return y, ssm_pool


def selective_scan_decode(
    u: jax.Array,  # f[D, Dn] one input per decode row
    dt: jax.Array,  # f32[D, Dn] softplus'd, bias added
    A: jax.Array,  # f32[Dn, N]
    B: jax.Array,  # f[D, N]
    C: jax.Array,  # f[D, N]
    ssm_pool: jax.Array,  # f32[num_layers, slots, Dn, N]
    layer: jax.Array | int,
    slots: jax.Array,  # i32[D] (0: padding row)
) -> tuple[jax.Array, jax.Array]:
    """One recurrence step per decode row from its slot's state: returns (y f32[D, Dn], ssm_pool updated)."""
    dt = dt.astype(jnp.float32)
    decay = jnp.exp(dt[..., None] * A.astype(jnp.float32))  # [D, Dn, N]; r below indexes decode rows
    inputs = (dt * u.astype(jnp.float32))[..., None] * B.astype(jnp.float32)[:, None, :]
    state = decay * ssm_pool[layer, slots] + inputs  # [D, Dn, N]
    y = jnp.einsum("rdn,rn->rd", state, C.astype(jnp.float32))
    return y, ssm_pool.at[layer, slots].set(state.astype(ssm_pool.dtype))
