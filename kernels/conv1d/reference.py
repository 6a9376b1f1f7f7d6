"""Plain-jnp depthwise causal conv1d over block-laid-out sequences, with initial and final conv states."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.chains import update_pool_chained


def causal_conv1d_prefill(
    x: jax.Array,  # f[num_blocks, block_size, C] conv inputs of the prefill blocks
    weight: jax.Array,  # f[C, K] depthwise taps; tap K-1 multiplies the current token
    bias: jax.Array | None,  # f[C]
    init: jax.Array,  # f[num_blocks, C, K-1] inputs before the block, oldest first (read where `starts`)
    starts: jax.Array,  # bool[num_blocks] first block of its sequence this step
    lens: jax.Array,  # i32[num_blocks] real tokens in each block
) -> tuple[jax.Array, jax.Array]:
    """y[b, i] = bias + sum_k weight[:, k] * u[b, i + k - (K-1)], u = the sequence's inputs with its history.

    A sequence's blocks are consecutive and only its last block is partial, so the K-1 inputs before a
    block are the previous block's last K-1 inputs, or `init` for a block that starts its sequence (zeros
    for a sequence at position 0: the caller passes them). Returns (y f32[num_blocks, block_size, C],
    final f[num_blocks, C, K-1]): the last K-1 inputs up to each block's last real token (the conv state
    to keep where the block ends its sequence).
    """
    nb, bs, c = x.shape
    k = weight.shape[1]
    if bs < k - 1:
        raise ValueError(f"block_size={bs} must be >= conv_kernel - 1 = {k - 1}")
    x = x.astype(jnp.float32)
    prev_tail = jnp.concatenate([jnp.zeros((1, k - 1, c), x.dtype), x[:-1, bs - (k - 1) :]], axis=0)
    history = jnp.where(starts[:, None, None], init.astype(jnp.float32).transpose(0, 2, 1), prev_tail)
    ext = jnp.concatenate([history, x], axis=1)  # [nb, K-1+bs, C]
    w = weight.astype(jnp.float32)
    y = sum(ext[:, j : j + bs] * w[:, j] for j in range(k))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    # The K-1 inputs ending at the block's last real token: ext[lens .. lens+K-2].
    idx = lens[:, None] + jnp.arange(k - 1)[None, :]  # [nb, K-1]
    tail = jnp.take_along_axis(ext, idx[:, :, None], axis=1)  # [nb, K-1, C]
    return y, tail.transpose(0, 2, 1).astype(init.dtype)


def causal_conv1d_decode(
    x: jax.Array,  # f[D, C] one new input per decode row
    weight: jax.Array,  # f[C, K]
    bias: jax.Array | None,  # f[C]
    state: jax.Array,  # f[D, C, K-1] the row's last K-1 inputs, oldest first
) -> tuple[jax.Array, jax.Array]:
    """One conv step per decode row: returns (y f32[D, C], state shifted by one with x appended)."""
    window = jnp.concatenate([state.astype(jnp.float32), x.astype(jnp.float32)[:, :, None]], axis=2)
    y = jnp.einsum("dck,ck->dc", window, weight.astype(jnp.float32))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y, window[:, :, 1:].astype(state.dtype)


def conv1d_decode_update(
    x: jax.Array,  # f[D, C]
    weight: jax.Array,  # f[C, K]
    bias: jax.Array | None,  # f[C]
    pool: jax.Array,  # [layers, slots, C, K-1] the conv-state pool
    layer: jax.Array | int,
    slots: jax.Array,  # i32[D] each decode row's slot (its state is read from there)
    write_slots: jax.Array | None = None,  # i32[D] where each row's new state goes (default: `slots`)
) -> tuple[jax.Array, jax.Array]:
    """`causal_conv1d_decode` on rows `slots` of layer `layer` of the pool; returns (y f32[D, C], pool).
    With `write_slots`: chained rows as in `kernels/ssd/reference.ssd_decode_update`."""
    return update_pool_chained(lambda s: causal_conv1d_decode(x, weight, bias, s), pool, layer, slots,
                               write_slots)
