"""RMS norms, all with float32 statistics: plain, per channel group, gated (Mamba-2) and weightless."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_normalize(x32: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, for float32 x."""
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def weightless_rms(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a weight (Falcon-Mamba's): statistics in float32, result back in x's dtype."""
    return rms_normalize(x.astype(jnp.float32), eps).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with float32 statistics; the output is cast back to `out_dtype` before the weight, as HF
    does."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        normed = rms_normalize(x.astype(jnp.float32), self.eps)
        out_dtype = out_dtype or self.weight.dtype
        return self.weight[...].astype(out_dtype) * normed.astype(out_dtype)


class GroupRMSNorm(nnx.Module):
    """RMSNorm over each of `groups` equal channel groups (float32 statistics), then one weight over all."""

    def __init__(self, dim: int, groups: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.groups, self.eps = groups, eps

    def __call__(self, x: jax.Array, out_dtype) -> jax.Array:
        normed = rms_normalize(x.astype(jnp.float32).reshape(*x.shape[:-1], self.groups, -1), self.eps)
        return self.weight[...].astype(out_dtype) * normed.reshape(x.shape).astype(out_dtype)


class GatedRMSNorm(nnx.Module):
    """HF's MambaRMSNormGated: RMS-normalizes y * silu(z) over `groups` equal slices (float32 statistics)."""

    def __init__(self, dim: int, *, groups: int, eps: float, norm_before_gate: bool, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:
        """f32[T, dim] from y, z f[T, dim]."""
        y, gate = y.astype(jnp.float32), jax.nn.silu(z.astype(jnp.float32))
        if not self.norm_before_gate:
            y = y * gate
        sliced = rms_normalize(y.reshape(*y.shape[:-1], self.groups, -1), self.eps)
        out = self.weight[...].astype(jnp.float32) * sliced.reshape(y.shape)
        return out * gate if self.norm_before_gate else out
