"""Lightning attention (simple gated linear attention) over a step's tokens, from and to the rows' states."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.gla import gla_decode, gla_prefill
from models.batch import ForwardBatch
from models.recurrent import LayerStates, concat_rows, split_rows, state_rows


def lightning_mix(q, k, v, log_decay, batch: ForwardBatch, states: LayerStates, *, scale: float):
    """Simple GLA of a step's tokens q/k/v f[T, H, D] from the rows' initial states (models/recurrent.py):
    each prefill block is one chunk, each decode token one recurrent step. Returns (f32[T, H, D], finals)."""
    _, h, hd = q.shape
    num_prefill = batch.num_prefill_tokens
    prefill_states, decode_states = split_rows(states, batch.prefill_pages.shape[0])
    outs, finals = [], []
    if num_prefill:
        nb, bs = batch.prefill_pages.shape[0], batch.prefill_block_size
        rows = state_rows(batch)
        # Padding tokens get k = 0 and no decay, so they leave the state as the last real token left it.
        real = (jnp.arange(bs)[None, :] < rows.lens[:, None])[..., None]  # bool[nb, bs, 1]
        qp, kp, vp = (a[:num_prefill].reshape(nb, bs, h, hd) for a in (q, k, v))
        kp = jnp.where(real[..., None], kp, jnp.zeros((), kp.dtype))
        g = jnp.where(real, log_decay, 0.0)  # f32[nb, bs, H]
        with jax.named_scope("lightning_prefill"):
            o, final = gla_prefill(qp, kp, vp, g, prefill_states.ssm, rows.starts, scale=scale)
        outs.append(o.reshape(num_prefill, h, hd))
        finals.append(LayerStates(final, None))
    if batch.num_decode:
        with jax.named_scope("lightning_decode"):
            o, final = gla_decode(
                q[num_prefill:], k[num_prefill:], v[num_prefill:], log_decay, decode_states.ssm, scale=scale
            )
        outs.append(o)
        finals.append(LayerStates(final, None))
    return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)), concat_rows(finals)
