"""Gated DeltaNet (Qwen3-Next's linear-attention layers): a delta-rule recurrence with a per-head decay over a
step's tokens, from and to the rows' states (models/recurrent.py), after a short causal conv."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.conv1d import causal_conv1d_decode, causal_conv1d_prefill, conv1d_decode_update
from kernels.delta_rule import gated_delta_decode, gated_delta_decode_update, gated_delta_prefill
from models.batch import ForwardBatch, by_section
from models.layers.linear import Linear
from models.recurrent import InPlace, LayerStates, decode_rows, split_rows, state_rows


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


class GatedDeltaNet(nnx.Module):
    """in_proj -> (q, k, v, z) and (b, a); causal conv + SiLU on q, k, v; L2-normed q, k (repeated to the
    value heads); g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); the gated delta rule
    (kernels/delta_rule); per-head RMSNorm gated by silu(z); out_proj.

    Parameters are laid out contiguously (q of all key heads, k, v of all value heads, z; b then a), not
    interleaved per key head as HF's fused projections are (the loader reorders them).
    """

    def __init__(self, cfg: DeltaNetConfig, *, dtype):
        self.cfg = cfg
        d = cfg.hidden_size
        self.in_proj = Linear(d, cfg.conv_dim + cfg.value_dim, bias=False, dtype=dtype)  # q, k, v, z
        self.in_proj_ba = Linear(d, 2 * cfg.num_v_heads, bias=False, dtype=dtype)
        self.conv_weight = nnx.Param(jnp.zeros((cfg.conv_dim, cfg.conv_kernel), dtype))
        self.dt_bias = nnx.Param(jnp.zeros((cfg.num_v_heads,), jnp.float32))
        self.A_log = nnx.Param(jnp.zeros((cfg.num_v_heads,), jnp.float32))
        self.norm_weight = nnx.Param(jnp.ones((cfg.v_head_dim,), dtype))
        self.out_proj = Linear(cfg.value_dim, d, bias=False, dtype=dtype)

    def __call__(self, x: jax.Array, batch: ForwardBatch,
                 states: LayerStates) -> tuple[jax.Array, LayerStates]:
        """Mixes x f[T, hidden] (normed) from the rows' initial states; returns (f32[T, hidden], finals)."""
        cfg = self.cfg
        dtype = self.out_proj.dtype
        t = x.shape[0]
        proj = self.in_proj(x).astype(dtype)
        qkv, z = proj[:, : cfg.conv_dim], proj[:, cfg.conv_dim :]
        ba = self.in_proj_ba(x).astype(jnp.float32)
        beta = jax.nn.sigmoid(ba[:, : cfg.num_v_heads])
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(ba[:, cfg.num_v_heads :] + self.dt_bias[...])
        prefill_states, decode_states = split_rows(states, batch.prefill_pages.shape[0])

        def decode(*args):
            if isinstance(decode_states.ssm, InPlace):  # the pools, updated in place (models/recurrent.py)
                return self._decode_in_place(decode_states, *args)
            return decode_rows(lambda st: self._decode(st, *args), decode_states, batch)

        o, finals = by_section(batch, lambda *a: self._prefill(batch, prefill_states, *a), decode,
                               qkv, g, beta)  # o f32[T, Hv, Dv]
        with jax.named_scope("gated_norm"):  # per head: norm, then the weight, then silu(z)
            var = jnp.mean(o * o, axis=-1, keepdims=True)
            normed = (o * jax.lax.rsqrt(var + cfg.norm_eps)).astype(dtype)
            gate = jax.nn.silu(z.astype(jnp.float32)).reshape(t, cfg.num_v_heads, cfg.v_head_dim)
            o = (self.norm_weight[...] * normed).astype(jnp.float32) * gate
        return self.out_proj(o.reshape(t, cfg.value_dim).astype(dtype)), finals

    def _qkv(self, u: jax.Array):
        """(q, k) f32[..., Hv, Dk] L2-normed and repeated to the value heads, v f[..., Hv, Dv], from the
        conv's activated output u f[..., conv_dim]."""
        cfg = self.cfg
        lead = u.shape[:-1]
        q = u[..., : cfg.key_dim].reshape(*lead, cfg.num_k_heads, cfg.k_head_dim)
        k = u[..., cfg.key_dim : 2 * cfg.key_dim].reshape(*lead, cfg.num_k_heads, cfg.k_head_dim)
        v = u[..., 2 * cfg.key_dim :].reshape(*lead, cfg.num_v_heads, cfg.v_head_dim)
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
            q, k, v = self._qkv(jax.nn.silu(u).astype(self.out_proj.dtype))
        # Padding tokens get no decay and no write, so they leave the state as the last real token left it.
        real = (jnp.arange(bs)[None, :] < rows.lens[:, None])[..., None]  # bool[nb, bs, 1]
        g = jnp.where(real, g.reshape(nb, bs, -1), 0.0)
        beta = jnp.where(real, beta.reshape(nb, bs, -1), 0.0)
        with jax.named_scope("delta_rule_prefill"):
            o, final = gated_delta_prefill(q, k, v, g, beta, states.ssm, rows.starts,
                                           scale=cfg.k_head_dim**-0.5)
        return o.reshape(nb * bs, cfg.num_v_heads, cfg.v_head_dim), LayerStates(final, conv)

    def _decode_in_place(self, states: LayerStates, qkv, g, beta):
        """`_decode` by the native kernels, on the pools where the states live (draft rows chained by the
        read and write slots, kernels/chains.py)."""
        c, s = states.conv, states.ssm
        with jax.named_scope("conv1d"):
            u, conv_pool = conv1d_decode_update(qkv, self.conv_weight[...], None, c.pool, c.layer, c.slots,
                                                c.write_slots)
            q, k, v = self._qkv(jax.nn.silu(u).astype(self.out_proj.dtype))
        with jax.named_scope("delta_rule_decode"):
            o, ssm_pool = gated_delta_decode_update(q, k, v, g, beta, s.pool, s.layer, s.slots, s.write_slots,
                                                    scale=self.cfg.k_head_dim**-0.5)
        return o, LayerStates(s._replace(pool=ssm_pool), c._replace(pool=conv_pool))

    def _decode(self, states: LayerStates, qkv, g, beta):
        with jax.named_scope("conv1d"):
            u, conv = causal_conv1d_decode(qkv, self.conv_weight[...], None, states.conv)
            q, k, v = self._qkv(jax.nn.silu(u).astype(self.out_proj.dtype))
        with jax.named_scope("delta_rule_decode"):
            o, final = gated_delta_decode(q, k, v, g, beta, states.ssm, scale=self.cfg.k_head_dim**-0.5)
        return o, LayerStates(final, conv)


def delta_net_params_from_hf(cfg: DeltaNetConfig, get, prefix: str) -> dict[tuple[str, ...], jax.Array]:
    """HF `Qwen3NextGatedDeltaNet` tensors under `prefix` (e.g. "model.layers.0.linear_attn.") -> ours.

    HF's in_proj_qkvz rows are grouped per key head [q (Dk), k (Dk), v (r Dv), z (r Dv)] and in_proj_ba's
    [b (r), a (r)] (r value heads per key head); ours are q, k, v, z (and b, a) each for all heads at once,
    which is how Qwen3.5's separate in_proj_qkv, in_proj_z, in_proj_b and in_proj_a already are.
    """
    import numpy as np

    hk, r, dk, dv = cfg.num_k_heads, cfg.num_v_heads // cfg.num_k_heads, cfg.k_head_dim, cfg.v_head_dim
    try:
        qkvz = get(prefix + "in_proj_qkvz.weight").reshape(hk, 2 * dk + 2 * r * dv, -1)
    except KeyError:  # Qwen3.5
        in_proj = np.concatenate([get(prefix + "in_proj_qkv.weight"), get(prefix + "in_proj_z.weight")])
        in_proj_ba = np.concatenate([get(prefix + "in_proj_b.weight"), get(prefix + "in_proj_a.weight")])
    else:
        parts = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=1)  # q, k, v, z per key head
        in_proj = np.concatenate([p.reshape(-1, p.shape[-1]) for p in parts])
        ba = get(prefix + "in_proj_ba.weight").reshape(hk, 2 * r, -1)
        in_proj_ba = np.concatenate([ba[:, :r].reshape(-1, ba.shape[-1]),
                                     ba[:, r:].reshape(-1, ba.shape[-1])])
    return {
        ("in_proj", "kernel"): in_proj.T,
        ("in_proj_ba", "kernel"): in_proj_ba.T,
        ("conv_weight",): get(prefix + "conv1d.weight")[:, 0, :],
        ("dt_bias",): get(prefix + "dt_bias"),
        ("A_log",): get(prefix + "A_log"),
        ("norm_weight",): get(prefix + "norm.weight"),
        ("out_proj", "kernel"): get(prefix + "out_proj.weight").T,
    }
