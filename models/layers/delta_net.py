"""Gated DeltaNet (Qwen3-Next's linear-attention layers): a delta-rule recurrence with a per-head decay over a
step's tokens, from and to the rows' states (models/recurrent.py), after a short causal conv."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.chains import run_chained
from kernels.conv1d import causal_conv1d_decode, causal_conv1d_prefill, conv1d_decode_update
from kernels.delta_rule import gated_delta_decode_rows, gated_delta_decode_update, gated_delta_prefill
from models.batch import ForwardBatch, by_section
from models.fused import grouped_rows
from models.layers.linear import Linear
from models.recurrent import InPlace, LayerStates, decode_chained, split_rows, state_rows


@dataclasses.dataclass(frozen=True)
class DeltaNetConfig:
    hidden_size: int
    num_k_heads: int  # query/key heads; each serves num_v_heads // num_k_heads consecutive value heads
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    norm_eps: float

    def __post_init__(self):
        if min(self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim, self.conv_kernel) <= 0:
            raise ValueError(f"bad Gated DeltaNet shape: {self}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads={self.num_v_heads} must be a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim={self.conv_kernel} must be >= 2")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:  # q, k and v go through the conv
        return 2 * self.key_dim + self.value_dim

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.k_head_dim, self.v_head_dim)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def num_params(self) -> int:
        d, c = self.hidden_size, self.conv_dim
        return (d * (c + self.value_dim) + d * 2 * self.num_v_heads + c * self.conv_kernel
                + 2 * self.num_v_heads + self.v_head_dim + self.value_dim * d)


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """As FLA's (and HF's) l2norm: x / sqrt(sum(x^2) + eps), in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class DeltaRuleMixer(nnx.Module):
    """What Gated DeltaNet and KDA share: their decode rows, from the conv's inputs and the gates, in place on
    the pools in decode-only steps (native kernels; draft rows chained by the read and write slots,
    kernels/chains.py) or gathered (the conv re-run per chain step, the delta rule by the multi-step update).
    A subclass gives `conv_weight`, `o`, `_heads(u)` (q, k, v from the conv's activated output), `scale` and
    its form's two kernels, `decode_update` and `decode_rows` (kernels/delta_rule)."""

    decode_update: Callable
    decode_rows: Callable
    scale: float

    def _decode(self, states: LayerStates, batch: ForwardBatch, qkv, g, beta):
        """(o f32[D, H, Dv], final states) of the decode rows: one O(1) state update each, draft rows
        continuing the row before them (models/recurrent.py)."""
        dtype = self.o.dtype
        if isinstance(states.ssm, InPlace):  # the pools, updated in place (models/recurrent.py)
            c, s = states.conv, states.ssm
            with jax.named_scope("conv1d"):
                u, conv_pool = conv1d_decode_update(qkv, self.conv_weight[...], None, c.pool, c.layer,
                                                    c.slots, c.write_slots)
                q, k, v = self._heads(jax.nn.silu(u).astype(dtype))
            with jax.named_scope("delta_rule_decode"):
                o, ssm_pool = self.decode_update(q, k, v, g, beta, s.pool, s.layer, s.slots, s.write_slots,
                                                 scale=self.scale)
            return o, LayerStates(s._replace(pool=ssm_pool), c._replace(pool=conv_pool))
        chained = decode_chained(batch)
        with jax.named_scope("conv1d"):
            u, conv = run_chained(lambda c: causal_conv1d_decode(qkv, self.conv_weight[...], None, c),
                                  states.conv, chained)
            q, k, v = self._heads(jax.nn.silu(u).astype(dtype))
        with jax.named_scope("delta_rule_decode"):
            o, final = self.decode_rows(q, k, v, g, beta, states.ssm, chained, scale=self.scale)
        return o, LayerStates(final, conv)


class GatedDeltaNet(DeltaRuleMixer):
    """qkvz -> (q, k, v, z) and ba -> (b, a); causal conv + SiLU on q, k, v; L2-normed q, k (repeated to the
    value heads); g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); the gated delta rule
    (kernels/delta_rule); per-head RMSNorm gated by silu(z); o.

    Grouped by key head (models/fused.py), as HF Qwen3-Next's fused projections are: qkvz's outputs are, per
    key head, its q, its k, then the v and z of its value heads; ba's its value heads' b then a; the conv
    channels (and so the conv state) per key head q, k, v. Tensor parallelism splits them into whole key
    heads with their value heads (runtime/mesh.py), the recurrent state with them, and no activation moves
    between devices inside the layer.
    """

    decode_update = staticmethod(gated_delta_decode_update)
    decode_rows = staticmethod(gated_delta_decode_rows)

    def __init__(self, cfg: DeltaNetConfig, *, dtype):
        self.cfg = cfg
        self.scale = cfg.k_head_dim**-0.5
        d = cfg.hidden_size
        self.qkvz = Linear(d, cfg.conv_dim + cfg.value_dim, bias=False, dtype=dtype)
        self.ba = Linear(d, 2 * cfg.num_v_heads, bias=False, dtype=dtype)
        self.conv_weight = nnx.Param(jnp.zeros((cfg.conv_dim, cfg.conv_kernel), dtype))
        self.dt_bias = nnx.Param(jnp.zeros((cfg.num_v_heads,), jnp.float32))
        self.A_log = nnx.Param(jnp.zeros((cfg.num_v_heads,), jnp.float32))
        self.norm_weight = nnx.Param(jnp.ones((cfg.v_head_dim,), dtype))
        self.o = Linear(cfg.value_dim, d, bias=False, dtype=dtype)

    def __call__(self, x: jax.Array, batch: ForwardBatch,
                 states: LayerStates) -> tuple[jax.Array, LayerStates]:
        """Mixes x f[T, hidden] (normed) from the rows' initial states; returns (f32[T, hidden], finals)."""
        cfg = self.cfg
        dtype = self.o.dtype
        t, hk, hv = x.shape[0], cfg.num_k_heads, cfg.num_v_heads
        proj = self.qkvz(x).astype(dtype).reshape(t, hk, -1)  # per key head [q, k, v, z]
        qkv = proj[..., : cfg.conv_dim // hk].reshape(t, cfg.conv_dim)
        z = proj[..., cfg.conv_dim // hk :]
        ba = self.ba(x).astype(jnp.float32).reshape(t, hk, 2, hv // hk)  # per key head [b, a]
        beta = jax.nn.sigmoid(ba[:, :, 0].reshape(t, hv))
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(ba[:, :, 1].reshape(t, hv) + self.dt_bias[...])
        prefill_states, decode_states = split_rows(states, batch.prefill_pages.shape[0])

        o, finals = by_section(batch, lambda *a: self._prefill(batch, prefill_states, *a),  # o f32[T, Hv, Dv]
                               lambda *a: self._decode(decode_states, batch, *a), qkv, g, beta)
        with jax.named_scope("gated_norm"):  # per head: norm, then the weight, then silu(z)
            var = jnp.mean(o * o, axis=-1, keepdims=True)
            normed = (o * jax.lax.rsqrt(var + cfg.norm_eps)).astype(dtype)
            gate = jax.nn.silu(z.astype(jnp.float32)).reshape(t, cfg.num_v_heads, cfg.v_head_dim)
            o = (self.norm_weight[...] * normed).astype(jnp.float32) * gate
        return self.o(o.reshape(t, cfg.value_dim).astype(dtype)), finals

    def _heads(self, u: jax.Array):
        """(q, k) f32[..., Hv, Dk] L2-normed and repeated to the value heads, v f[..., Hv, Dv], from the
        conv's activated output u f[..., conv_dim] (per key head q, k, v)."""
        cfg = self.cfg
        lead, dk = u.shape[:-1], cfg.k_head_dim
        u = u.reshape(*lead, cfg.num_k_heads, -1)
        q, k = u[..., :dk], u[..., dk : 2 * dk]
        v = u[..., 2 * dk :].reshape(*lead, cfg.num_v_heads, cfg.v_head_dim)
        r = cfg.num_v_heads // cfg.num_k_heads
        q, k = (jnp.repeat(_l2norm(a), r, axis=-2) if r > 1 else _l2norm(a) for a in (q, k))
        return q, k, v

    def _prefill(self, batch: ForwardBatch, states: LayerStates, qkv, g, beta):
        cfg = self.cfg
        nb, bs = batch.prefill_pages.shape[0], batch.prefill_block_size
        rows = state_rows(batch)
        with jax.named_scope("conv1d"):
            u, conv = causal_conv1d_prefill(qkv.reshape(nb, bs, -1), self.conv_weight[...], None, states.conv,
                                            rows.starts, rows.lens)
            q, k, v = self._heads(jax.nn.silu(u).astype(self.o.dtype))
        # Padding tokens get no decay and no write, so they leave the state as the last real token left it.
        real = (jnp.arange(bs)[None, :] < rows.lens[:, None])[..., None]  # bool[nb, bs, 1]
        g = jnp.where(real, g.reshape(nb, bs, -1), 0.0)
        beta = jnp.where(real, beta.reshape(nb, bs, -1), 0.0)
        with jax.named_scope("delta_rule_prefill"):
            o, final = gated_delta_prefill(q, k, v, g, beta, states.ssm, rows.starts,
                                           scale=self.scale)
        return o.reshape(nb * bs, cfg.num_v_heads, cfg.v_head_dim), LayerStates(final, conv)


def delta_net_params_from_hf(cfg: DeltaNetConfig, get, prefix: str) -> dict[tuple[str, ...], jax.Array]:
    """HF `Qwen3NextGatedDeltaNet` tensors under `prefix` (e.g. "model.layers.0.linear_attn.") -> ours.

    Qwen3-Next's in_proj_qkvz and in_proj_ba already group their rows per key head, as ours do; Qwen3.5's
    separate in_proj_qkv (q, k, v each for all heads), in_proj_z, in_proj_b and in_proj_a are regrouped. The
    conv's channels (q, k, v each for all heads in both) are regrouped per key head.
    """
    hk = cfg.num_k_heads

    def qkv_parts(x):  # rows [q | k | v], each for all heads
        return np.split(x, [cfg.key_dim, 2 * cfg.key_dim])

    try:
        qkvz, ba = get(prefix + "in_proj_qkvz.weight"), get(prefix + "in_proj_ba.weight")
    except KeyError:  # Qwen3.5
        q, k, v = qkv_parts(get(prefix + "in_proj_qkv.weight"))
        qkvz = grouped_rows((q, k, v, get(prefix + "in_proj_z.weight")), hk)
        ba = grouped_rows((get(prefix + "in_proj_b.weight"), get(prefix + "in_proj_a.weight")), hk)
    return {
        ("qkvz", "kernel"): qkvz.T,
        ("ba", "kernel"): ba.T,
        ("conv_weight",): grouped_rows(qkv_parts(get(prefix + "conv1d.weight")[:, 0, :]), hk),
        ("dt_bias",): get(prefix + "dt_bias"),
        ("A_log",): get(prefix + "A_log"),
        ("norm_weight",): get(prefix + "norm.weight"),
        ("o", "kernel"): get(prefix + "out_proj.weight").T,
    }
