"""The Mamba-2 (SSD) mixer, as the Mamba-2 models and the SSM+attention hybrids use it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.chains import run_chained
from kernels.conv1d import causal_conv1d_decode, causal_conv1d_prefill, conv1d_decode_update
from kernels.ssd import ssd_decode_rows, ssd_decode_update, ssd_prefill
from models.batch import ForwardBatch, by_section
from models.layers.linear import Linear
from models.layers.norm import GatedRMSNorm
from models.recurrent import InPlace, LayerStates, decode_chained, split_rows, state_rows


def parse_time_step_limit(value: Any) -> tuple[float, float]:
    """HF `time_step_limit` as (low, high); transformers 5 writes infinity as {"__float__": "Infinity"}."""
    if value is None:
        return (0.0, math.inf)

    def one(v):
        return float(v["__float__"]) if isinstance(v, dict) else float(v)

    low, high = (one(v) for v in value)
    return (low, high)


def mixer_config_from_mamba_keys(hf: dict[str, Any], hidden: int, norm_eps: float) -> Mamba2MixerConfig:
    """The Mamba-2 mixer of a hybrid whose config spells it `mamba_*` (Bamba, GraniteMoeHybrid)."""
    num_heads, expand = int(hf.get("mamba_n_heads", 128)), int(hf.get("mamba_expand", 2))
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = expand * hidden // num_heads if head_dim == "auto" else int(head_dim)
    if num_heads * head_dim != expand * hidden:  # HF's mixer is expand * hidden wide
        raise ValueError(
            f"mamba_n_heads * mamba_d_head = {num_heads * head_dim} must equal "
            f"mamba_expand * hidden_size = {expand * hidden}"
        )
    n_groups, proj_bias = int(hf.get("mamba_n_groups", 1)), bool(hf.get("mamba_proj_bias", False))
    return Mamba2MixerConfig(
        hidden_size=hidden, num_heads=num_heads, head_dim=head_dim, n_groups=n_groups,
        state_size=int(hf.get("mamba_d_state", 256)), conv_kernel=int(hf.get("mamba_d_conv", 4)),
        norm_groups=n_groups, norm_eps=norm_eps, use_conv_bias=bool(hf.get("mamba_conv_bias", True)),
        in_proj_bias=proj_bias, out_proj_bias=proj_bias,
        time_step_limit=parse_time_step_limit(hf.get("time_step_limit")),
    )


@dataclasses.dataclass(frozen=True)
class Mamba2MixerConfig:
    """Shape and options of one Mamba-2 mixer; hybrids (NemotronH, Bamba, Falcon-H1) build it from theirs."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int  # B/C groups; head h reads group h // (num_heads // n_groups)
    state_size: int
    conv_kernel: int
    norm_groups: int  # the gated RMSNorm normalizes this many equal slices separately (HF Mamba2: n_groups)
    norm_eps: float
    use_conv_bias: bool = True
    in_proj_bias: bool = False
    out_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    gated_norm: bool = True  # False: y * silu(z) with no norm (Falcon-H1's mamba_rms_norm=False)
    norm_before_gate: bool = False  # True: norm(y) * silu(z) (Falcon-H1 option); False: norm(y * silu(z))

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "head_dim", "n_groups", "state_size", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.n_groups:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups}")
        if self.norm_groups <= 0 or self.intermediate_size % self.norm_groups:
            raise ValueError(f"{self.norm_groups=} must divide intermediate size {self.intermediate_size}")
        if not self.time_step_limit[0] <= self.time_step_limit[1]:
            raise ValueError(f"time_step_limit={self.time_step_limit} must be (low, high) with low <= high")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: x, B and C together."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def num_params(self) -> int:
        d, i, h, c = self.hidden_size, self.intermediate_size, self.num_heads, self.conv_dim
        in_out = d * (i + c + h) + (i + c + h) * self.in_proj_bias + i * d + d * self.out_proj_bias
        return in_out + c * self.conv_kernel + c * self.use_conv_bias + 3 * h + i * self.gated_norm


class Mamba2Mixer(nnx.Module):
    """in_proj -> (z, xBC, dt); causal conv + SiLU on xBC; SSD scan with D skip; gated norm; out_proj.

    A, D and dt_bias are kept in float32 whatever the model dtype: they set the decay, computed in
    float32 log space.
    """

    def __init__(self, mc: Mamba2MixerConfig, *, dtype):
        self.mc = mc
        i, c, h = mc.intermediate_size, mc.conv_dim, mc.num_heads
        self.in_proj = Linear(mc.hidden_size, i + c + h, bias=mc.in_proj_bias, dtype=dtype)
        self.conv_weight = nnx.Param(jnp.zeros((c, mc.conv_kernel), dtype))  # f[C, K]; tap K-1: current token
        self.conv_bias = nnx.Param(jnp.zeros((c,), dtype)) if mc.use_conv_bias else None
        self.dt_bias = nnx.Param(jnp.zeros((h,), jnp.float32))
        self.A_log = nnx.Param(jnp.zeros((h,), jnp.float32))
        self.D = nnx.Param(jnp.zeros((h,), jnp.float32))
        self.norm = (
            GatedRMSNorm(i, groups=mc.norm_groups, eps=mc.norm_eps, norm_before_gate=mc.norm_before_gate,
                         dtype=dtype)
            if mc.gated_norm
            else None
        )
        self.out_proj = Linear(i, mc.hidden_size, bias=mc.out_proj_bias, dtype=dtype)

    def __call__(self, x: jax.Array, batch: ForwardBatch,
                 states: LayerStates) -> tuple[jax.Array, LayerStates]:
        """Mixes x f[T, hidden] (already normed) from the step's initial states (rows: prefill blocks, then
        decode rows; see models/recurrent.py); returns f32[T, hidden] and the rows' final states."""
        mc = self.mc
        dtype = self.out_proj.dtype
        i, c = mc.intermediate_size, mc.conv_dim
        # Rounded to the model dtype where HF's activations are (a no-op in float32).
        zxbcdt = self.in_proj(x).astype(dtype)
        z, xbc, dt = zxbcdt[:, :i], zxbcdt[:, i : i + c], zxbcdt[:, i + c :]
        # Step sizes are clamped in prefill and decode alike. HF's (and mamba_ssm's) decode step skips
        # the clamp, which only matters for checkpoints with a finite `time_step_limit`.
        dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...]), *mc.time_step_limit)
        prefill_states, decode_states = split_rows(states, batch.prefill_pages.shape[0])
        # y f32[T, I]
        y, finals = by_section(batch, lambda xbc, dt: self._prefill(xbc, dt, batch, prefill_states),
                               lambda xbc, dt: self._decode(xbc, dt, decode_states, batch), xbc, dt)
        with jax.named_scope("gated_norm"):
            y = self.norm(y, z) if self.norm is not None else y * jax.nn.silu(z.astype(jnp.float32))
        return self.out_proj(y.astype(dtype)), finals

    def _conv_args(self):
        return self.conv_weight[...], None if self.conv_bias is None else self.conv_bias[...]

    def _split_xbc(self, u: jax.Array):
        """x f[..., H, P], B f[..., G, N], C f[..., G, N] from the conv output u f[..., conv_dim]."""
        mc = self.mc
        i, gn = mc.intermediate_size, mc.n_groups * mc.state_size
        lead = u.shape[:-1]
        return (u[..., :i].reshape(*lead, mc.num_heads, mc.head_dim),
                u[..., i : i + gn].reshape(*lead, mc.n_groups, mc.state_size),
                u[..., i + gn :].reshape(*lead, mc.n_groups, mc.state_size))

    def _prefill(self, xbc, dt, batch: ForwardBatch, states: LayerStates):
        """SSM output f32[num_prefill, I] (with the D skip) of the prefill blocks, xbc f[num_prefill, C]."""
        nb, bs = batch.prefill_pages.shape[0], batch.prefill_block_size
        dtype = self.out_proj.dtype
        rows = state_rows(batch)
        with jax.named_scope("conv1d"):
            u, conv = causal_conv1d_prefill(xbc.reshape(nb, bs, -1), *self._conv_args(), states.conv,
                                            rows.starts, rows.lens)
            x, B, C = self._split_xbc(jax.nn.silu(u).astype(dtype))
        # dt = 0 on padding tokens: they neither decay nor feed the state (see ssd_prefill).
        real = jnp.arange(bs)[None, :] < rows.lens[:, None]  # bool[nb, bs]
        dt = jnp.where(real[:, :, None], dt.reshape(nb, bs, -1), 0.0)
        with jax.named_scope("ssd"):
            y, ssm = ssd_prefill(x, dt, -jnp.exp(self.A_log[...]), B, C, states.ssm, rows.starts)
        y = y + x.astype(jnp.float32) * self.D[...][:, None]
        return y.reshape(nb * bs, -1), LayerStates(ssm, conv)

    def _decode(self, xbc, dt, states: LayerStates, batch: ForwardBatch):
        """SSM output f32[D, I] (D skip included) of the decode rows: one O(1) state update each (draft rows
        continuing the row before them, models/recurrent.py)."""
        dtype = self.out_proj.dtype
        A = -jnp.exp(self.A_log[...])
        if isinstance(states.ssm, InPlace):  # the pools, updated in place (models/recurrent.py)
            c, s = states.conv, states.ssm
            with jax.named_scope("conv1d"):
                u, conv_pool = conv1d_decode_update(xbc, *self._conv_args(), c.pool, c.layer, c.slots,
                                                    c.write_slots)
                x, B, C = self._split_xbc(jax.nn.silu(u).astype(dtype))
            with jax.named_scope("ssd"):
                y, ssm_pool = ssd_decode_update(x, dt, A, B, C, s.pool, s.layer, s.slots, s.write_slots)
            finals = LayerStates(s._replace(pool=ssm_pool), c._replace(pool=conv_pool))
        else:
            chained = decode_chained(batch)
            with jax.named_scope("conv1d"):
                u, conv = run_chained(lambda c: causal_conv1d_decode(xbc, *self._conv_args(), c), states.conv,
                                      chained)
                x, B, C = self._split_xbc(jax.nn.silu(u).astype(dtype))
            with jax.named_scope("ssd"):
                y, ssm = ssd_decode_rows(x, dt, A, B, C, states.ssm, chained)
            finals = LayerStates(ssm, conv)
        y = y + x.astype(jnp.float32) * self.D[...][:, None]
        return y.reshape(y.shape[0], -1), finals


def mixer_params_from_hf(
    mc: Mamba2MixerConfig, get: Callable[[str], np.ndarray], prefix: str
) -> dict[tuple[str, ...], np.ndarray]:
    """One mixer's parameters {path inside Mamba2Mixer: array} from HF tensors named `prefix + name`.

    `prefix` is e.g. "backbone.layers.3.mixer."; HF linear weights are [out, in], ours [in, out], and
    HF's depthwise conv weight [C, 1, K] is stored [C, K].
    """
    out = {
        ("in_proj", "kernel"): get(prefix + "in_proj.weight").T,
        ("conv_weight",): get(prefix + "conv1d.weight")[:, 0, :],
        ("dt_bias",): get(prefix + "dt_bias"),
        ("A_log",): get(prefix + "A_log"),
        ("D",): get(prefix + "D"),
        ("out_proj", "kernel"): get(prefix + "out_proj.weight").T,
    }
    if mc.in_proj_bias:
        out[("in_proj", "bias")] = get(prefix + "in_proj.bias")
    if mc.use_conv_bias:
        out[("conv_bias",)] = get(prefix + "conv1d.bias")
    if mc.gated_norm:
        out[("norm", "weight")] = get(prefix + "norm.weight")
    if mc.out_proj_bias:
        out[("out_proj", "bias")] = get(prefix + "out_proj.bias")
    return out
