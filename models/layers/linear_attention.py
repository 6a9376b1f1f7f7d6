"""Lightning attention (simple gated linear attention) over a step's tokens, from and to the rows' states."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.gla import gla_decode, gla_prefill
from models.batch import ForwardBatch, by_section
from models.recurrent import LayerStates, decode_rows, split_rows, state_rows


def lightning_mix(q, k, v, log_decay, batch: ForwardBatch, states: LayerStates, *, scale: float):
    """Simple GLA of a step's tokens q/k/v f[T, H, D] from the rows' initial states (models/recurrent.py):
    each prefill block is one chunk, each decode token one recurrent step. Returns (f32[T, H, D], finals)."""
    prefill_states, decode_states = split_rows(states, batch.prefill_pages.shape[0])

    def prefill(q, k, v):
        (t, h, hd), nb, bs = q.shape, batch.prefill_pages.shape[0], batch.prefill_block_size
        rows = state_rows(batch)
        # Padding tokens get k = 0 and no decay, so they leave the state as the last real token left it.
        real = (jnp.arange(bs)[None, :] < rows.lens[:, None])[..., None]  # bool[nb, bs, 1]
        qp, kp, vp = (a.reshape(nb, bs, h, hd) for a in (q, k, v))
        kp = jnp.where(real[..., None], kp, jnp.zeros((), kp.dtype))
        g = jnp.where(real, log_decay, 0.0)  # f32[nb, bs, H]
        with jax.named_scope("lightning_prefill"):
            o, final = gla_prefill(qp, kp, vp, g, prefill_states.ssm, rows.starts, scale=scale)
        return o.reshape(t, h, hd), LayerStates(final, None)

    def decode(q, k, v):
        def rows(states):
            o, final = gla_decode(q, k, v, log_decay, states.ssm, scale=scale)
            return o, LayerStates(final, None)

        with jax.named_scope("lightning_decode"):  # draft rows continue the row before (models/recurrent.py)
            return decode_rows(rows, decode_states, batch)

    return by_section(batch, prefill, decode, q, k, v)
