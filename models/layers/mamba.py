"""The Mamba-1 selective-SSM mixer (Mamba, Falcon-Mamba, Jamba's SSM layers)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.conv1d import causal_conv1d_decode, causal_conv1d_prefill
from kernels.selective_scan import selective_scan_decode, selective_scan_prefill
from models.batch import ForwardBatch, by_section, prefill_segments
from models.layers.linear import Linear
from models.layers.mlp import ACTIVATIONS
from models.layers.norm import RMSNorm, weightless_rms
from models.recurrent import LayerStates, decode_rows, split_rows

BCDT_NORMS = (None, "weightless", "weighted")


class MambaMixer(nnx.Module):
    """Mamba-1 mixer: in_proj -> (x, z); causal conv + act on x; selective scan; (y + D x) * silu(z);
    out_proj.

    dt (low rank), B and C come from x_proj; `bcdt_norm` adds an RMSNorm on each of them after x_proj:
    "weightless" (Falcon-Mamba, eps `bcdt_norm_eps`) or "weighted" (Jamba's dt/b/c_layernorm).
    Its recurrent state per sequence: ssm f32[Dn, N] and conv [Dn, conv_kernel - 1] (one pool layer).
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, state_size: int, *, conv_kernel: int,
        time_step_rank: int,
        use_bias: bool, use_conv_bias: bool, hidden_act: str, bcdt_norm: str | None = None,
        bcdt_norm_eps: float = 1e-6, dtype,
    ):
        if bcdt_norm not in BCDT_NORMS:
            raise ValueError(f"bcdt_norm={bcdt_norm!r} must be one of {BCDT_NORMS}")
        i, n, r = intermediate_size, state_size, time_step_rank
        self.intermediate_size, self.state_size, self.time_step_rank = i, n, r
        self.in_proj = Linear(hidden_size, 2 * i, bias=use_bias, dtype=dtype)
        # [Dn, K]; tap K-1 is the current token
        self.conv_weight = nnx.Param(jnp.zeros((i, conv_kernel), dtype))
        self.conv_bias = nnx.Param(jnp.zeros((i,), dtype)) if use_conv_bias else None
        self.x_proj = Linear(i, r + 2 * n, bias=False, dtype=dtype)
        self.dt_proj = Linear(r, i, bias=True, dtype=dtype)
        self.A_log = nnx.Param(jnp.zeros((i, n), dtype))  # A = -exp(A_log), in float32
        self.D = nnx.Param(jnp.zeros((i,), dtype))
        self.out_proj = Linear(i, hidden_size, bias=use_bias, dtype=dtype)
        self.act = ACTIVATIONS[hidden_act]
        self.bcdt_norm, self.bcdt_norm_eps = bcdt_norm, bcdt_norm_eps
        if bcdt_norm == "weighted":
            self.dt_norm = RMSNorm(r, eps=bcdt_norm_eps, dtype=dtype)
            self.b_norm = RMSNorm(n, eps=bcdt_norm_eps, dtype=dtype)
            self.c_norm = RMSNorm(n, eps=bcdt_norm_eps, dtype=dtype)

    def _dt_b_c(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x f[T, Dn] -> (dt f32[T, Dn] softplus'd, B f[T, N], C f[T, N])."""
        dtype, r, n = self.D.dtype, self.time_step_rank, self.state_size
        proj = self.x_proj(x).astype(dtype)  # [T, R + 2N]
        dt_low, B, C = proj[:, :r], proj[:, r : r + n], proj[:, r + n :]
        if self.bcdt_norm == "weightless":
            dt_low, B, C = (weightless_rms(v, self.bcdt_norm_eps) for v in (dt_low, B, C))
        elif self.bcdt_norm == "weighted":
            dt_low, B, C = self.dt_norm(dt_low, dtype), self.b_norm(B, dtype), self.c_norm(C, dtype)
        # dt_proj's bias and the softplus stay in float32 (HF adds the bias in the model dtype; same in fp32).
        return jax.nn.softplus(self.dt_proj(dt_low)), B, C

    def __call__(
        self, x: jax.Array, batch: ForwardBatch, states: LayerStates
    ) -> tuple[jax.Array, LayerStates]:
        """Mixes x f[T, hidden] (normed) from the step's initial states: (f32[T, hidden], final states).

        `states` has one row per prefill block, then one per decode token (see models/recurrent.py); a
        prefill block's row is read only where it starts its sequence, and every row's final state is
        the one after its last real token.
        """
        dtype, i = self.D.dtype, self.intermediate_size
        prefill_states, decode_states = split_rows(states, batch.prefill_pages.shape[0])
        xz = self.in_proj(x).astype(dtype)
        xs, z = xz[:, :i], xz[:, i:]  # [T, Dn] each
        y, finals = by_section(batch, lambda xs: self._prefill(xs, batch, prefill_states),
                               lambda xs: self._decode(xs, decode_states, batch), xs)  # f32[T, Dn]
        y = y * jax.nn.silu(z.astype(jnp.float32))
        return self.out_proj(y.astype(dtype)), finals

    def _conv_args(self):
        return self.conv_weight[...], None if self.conv_bias is None else self.conv_bias[...]

    def _skip(self, y: jax.Array, xc: jax.Array) -> jax.Array:
        return y + xc.astype(jnp.float32) * self.D[...].astype(jnp.float32)

    def _prefill(
        self, xs: jax.Array, batch: ForwardBatch, states: LayerStates
    ) -> tuple[jax.Array, LayerStates]:
        """Scan output f32[num_prefill, Dn] (D skip included) of the prefill blocks, xs f[num_prefill, Dn]."""
        dtype, i, n = self.D.dtype, self.intermediate_size, self.state_size
        nb, bs = batch.prefill_pages.shape[0], batch.prefill_block_size
        seg = prefill_segments(batch)
        with jax.named_scope("conv"):
            xc, conv = causal_conv1d_prefill(
                xs.reshape(nb, bs, i), *self._conv_args(), states.conv, seg.starts, seg.lens
            )
            xc = self.act(xc).astype(dtype).reshape(nb * bs, i)
        with jax.named_scope("selective_scan"):
            dt, B, C = self._dt_b_c(xc)
            # Padding tokens get dt = 0: decay 1 and no input, so they leave the state as it was.
            real = jnp.arange(bs)[None, :] < seg.lens[:, None]  # [nb, bs]
            dt = jnp.where(real[:, :, None], dt.reshape(nb, bs, i), 0.0)
            y, ssm = selective_scan_prefill(
                xc.reshape(nb, bs, i), dt, self._A(), B.reshape(nb, bs, n), C.reshape(nb, bs, n), states.ssm,
                seg.starts,
            )
        return self._skip(y.reshape(nb * bs, i), xc), LayerStates(ssm, conv)

    def _decode(self, xs: jax.Array, states: LayerStates,
                batch: ForwardBatch) -> tuple[jax.Array, LayerStates]:
        """Scan output f32[D, Dn] (D skip included) of the decode rows: one O(1) state update each (draft rows
        continuing the row before them, models/recurrent.py)."""
        return decode_rows(lambda st: self._decode_step(xs, st), states, batch)

    def _decode_step(self, xs: jax.Array, states: LayerStates) -> tuple[jax.Array, LayerStates]:
        with jax.named_scope("conv"):
            xc, conv = causal_conv1d_decode(xs, *self._conv_args(), states.conv)
            xc = self.act(xc).astype(self.D.dtype)  # [D, Dn]
        with jax.named_scope("selective_scan"):
            dt, B, C = self._dt_b_c(xc)
            y, ssm = selective_scan_decode(xc, dt, self._A(), B, C, states.ssm)
        return self._skip(y, xc), LayerStates(ssm, conv)

    def _A(self) -> jax.Array:
        return -jnp.exp(self.A_log[...].astype(jnp.float32))  # f32[Dn, N]


def mixer_params_from_hf(
    get, prefix: str, *, use_bias: bool, use_conv_bias: bool, bcdt_norm: str | None = None
) -> dict[tuple[str, ...], np.ndarray]:
    """One `MambaMixer`'s parameters (paths relative to the mixer) from HF tensors named `prefix + ...`.

    `prefix` is e.g. "backbone.layers.3.mixer." (Mamba) or "model.layers.3.mamba." (Jamba). HF linear
    weights are [out, in], ours [in, out]; the depthwise conv weight [Dn, 1, K] loses its middle axis.
    """
    out = {
        ("in_proj", "kernel"): get(prefix + "in_proj.weight").T,
        ("conv_weight",): get(prefix + "conv1d.weight")[:, 0, :],
        ("x_proj", "kernel"): get(prefix + "x_proj.weight").T,
        ("dt_proj", "kernel"): get(prefix + "dt_proj.weight").T,
        ("dt_proj", "bias"): get(prefix + "dt_proj.bias"),
        ("A_log",): get(prefix + "A_log"),
        ("D",): get(prefix + "D"),
        ("out_proj", "kernel"): get(prefix + "out_proj.weight").T,
    }
    if use_bias:
        out[("in_proj", "bias")] = get(prefix + "in_proj.bias")
        out[("out_proj", "bias")] = get(prefix + "out_proj.bias")
    if use_conv_bias:
        out[("conv_bias",)] = get(prefix + "conv1d.bias")
    if bcdt_norm == "weighted":
        for ours, theirs in (("dt_norm", "dt_layernorm"), ("b_norm", "b_layernorm"),
                             ("c_norm", "c_layernorm")):
            out[(ours, "weight")] = get(prefix + theirs + ".weight")
    return out
