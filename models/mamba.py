"""Mamba-1 and Falcon-Mamba: selective-SSM mixer layers over a per-slot recurrent state, layers scanned."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.conv1d import causal_conv1d_decode, causal_conv1d_prefill
from kernels.selective_scan import selective_scan_decode, selective_scan_prefill
from memory import CacheSpec, MemoryPools, RecurrentSpec
from models.batch import ForwardBatch, prefill_segments
from models.layers import ACTIVATIONS, Linear, RMSNorm, lm_logits
from models.recurrent import (
    LayerStates,
    concat_rows,
    scan_recurrent_layers,
    split_rows,
)

_FALCON_ARCHITECTURES = ("FalconMambaForCausalLM",)
_BCDT_NORMS = (None, "weightless", "weighted")


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """Shape and numerics of a Mamba-1 language model (HF `MambaConfig` / `FalconMambaConfig`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # expand * hidden_size: the mixer's channel count Dn
    state_size: int  # N
    num_layers: int
    conv_kernel: int = 4
    time_step_rank: int = 8
    layer_norm_eps: float = 1e-5
    use_bias: bool = False  # bias on in_proj and out_proj
    use_conv_bias: bool = True
    hidden_act: str = "silu"  # after the conv; the z gate is always silu (as HF and mamba_ssm do)
    residual_in_fp32: bool = True
    # Falcon-Mamba normalizes dt (low rank), B and C with a weightless RMSNorm of this eps; None: plain Mamba.
    bcdt_rms_eps: float | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 1 << 20  # a recurrent model has no context limit
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "state_size", "num_layers",
                     "time_step_rank"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel={self.conv_kernel} must be >= 2")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act={self.hidden_act!r}; known: {', '.join(ACTIVATIONS)}")

    @property
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(
            num_kv_layers=0,
            recurrent=RecurrentSpec(
                self.num_layers, (self.intermediate_size, self.state_size),
                (self.intermediate_size, self.conv_kernel - 1),
            ),
        )

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, i, n, r, k = (self.hidden_size, self.intermediate_size, self.state_size, self.time_step_rank,
                         self.conv_kernel)
        mixer = (
            d * 2 * i + i * k + i * (r + 2 * n) + r * i + i + i * n + i + i * d
            + (2 * i + d if self.use_bias else 0) + (i if self.use_conv_bias else 0)
        )
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (mixer + d) + embed + d

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> MambaConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        hidden = int(hf["hidden_size"])
        rank = hf.get("time_step_rank", "auto")
        falcon = archs[0] in _FALCON_ARCHITECTURES or hf.get("model_type") == "falcon_mamba"
        eos = hf.get("eos_token_id")
        return cls(
            architecture=archs[0],
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf.get("intermediate_size") or hf.get("expand", 2) * hidden),
            state_size=int(hf.get("state_size", 16)),
            num_layers=int(hf["num_hidden_layers"]),
            conv_kernel=int(hf.get("conv_kernel", 4)),
            time_step_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
            layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            use_bias=bool(hf.get("use_bias", False)),
            use_conv_bias=bool(hf.get("use_conv_bias", True)),
            hidden_act=hf.get("hidden_act", "silu"),
            residual_in_fp32=bool(hf.get("residual_in_fp32", True)),
            bcdt_rms_eps=float(hf.get("mixer_rms_eps", 1e-6)) if falcon else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )


config_from_hf = MambaConfig.from_hf


def _weightless_rms(x: jax.Array, eps: float) -> jax.Array:
    """Falcon-Mamba's RMSNorm without a weight: statistics in float32, result back in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


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
        if bcdt_norm not in _BCDT_NORMS:
            raise ValueError(f"bcdt_norm={bcdt_norm!r} must be one of {_BCDT_NORMS}")
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
            dt_low, B, C = (_weightless_rms(v, self.bcdt_norm_eps) for v in (dt_low, B, C))
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
        num_prefill = batch.num_prefill_tokens
        prefill_states, decode_states = split_rows(states, batch.prefill_pages.shape[0])
        xz = self.in_proj(x).astype(dtype)
        xs, z = xz[:, :i], xz[:, i:]  # [T, Dn] each
        ys, finals = [], []
        if num_prefill:
            y, final = self._prefill(xs[:num_prefill], batch, prefill_states)
            ys.append(y)
            finals.append(final)
        if batch.num_decode:
            y, final = self._decode(xs[num_prefill:], decode_states)
            ys.append(y)
            finals.append(final)
        y = ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=0)  # f32[T, Dn], D skip included
        y = y * jax.nn.silu(z.astype(jnp.float32))
        return self.out_proj(y.astype(dtype)), concat_rows(finals)

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

    def _decode(self, xs: jax.Array, states: LayerStates) -> tuple[jax.Array, LayerStates]:
        """Scan output f32[D, Dn] (D skip included) of the decode rows: one O(1) state update each."""
        with jax.named_scope("conv"):
            xc, conv = causal_conv1d_decode(xs, *self._conv_args(), states.conv)
            xc = self.act(xc).astype(self.D.dtype)  # [D, Dn]
        with jax.named_scope("selective_scan"):
            dt, B, C = self._dt_b_c(xc)
            y, ssm = selective_scan_decode(xc, dt, self._A(), B, C, states.ssm)
        return self._skip(y, xc), LayerStates(ssm, conv)

    def _A(self) -> jax.Array:
        return -jnp.exp(self.A_log[...].astype(jnp.float32))  # f32[Dn, N]


class MambaBlock(nnx.Module):
    """Pre-norm residual block around one mixer."""

    def __init__(self, cfg: MambaConfig, *, dtype):
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.mixer = MambaMixer(
            cfg.hidden_size, cfg.intermediate_size, cfg.state_size, conv_kernel=cfg.conv_kernel,
            time_step_rank=cfg.time_step_rank, use_bias=cfg.use_bias, use_conv_bias=cfg.use_conv_bias,
            hidden_act=cfg.hidden_act, bcdt_norm=None if cfg.bcdt_rms_eps is None else "weightless",
            bcdt_norm_eps=cfg.bcdt_rms_eps or 1e-6, dtype=dtype,
        )
        self.residual_in_fp32 = cfg.residual_in_fp32

    def __call__(self, x, batch: ForwardBatch, states: LayerStates) -> tuple[jax.Array, LayerStates]:
        dtype = self.norm.weight.dtype
        with jax.named_scope("mixer"):
            h, final = self.mixer(self.norm(x, dtype), batch, states)
        x = x + h
        # Without residual_in_fp32, HF keeps the residual stream in the model dtype: round it as HF does.
        return (x if self.residual_in_fp32 else x.astype(dtype).astype(jnp.float32)), final


class MambaForCausalLM(nnx.Module):
    """Mamba-1 / Falcon-Mamba LM: layers stacked and run by one `lax.scan`; states written once after it."""

    def __init__(self, cfg: MambaConfig, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.hidden_size), dtype))
        graphdef, state = nnx.split(MambaBlock(cfg, dtype=dtype))
        stacked = jax.tree.map(lambda x: jnp.zeros((cfg.num_layers, *x.shape), x.dtype), state)
        self.layers = nnx.merge(graphdef, stacked)
        self.norm_f = RMSNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nnx.Param(jnp.zeros((cfg.hidden_size, cfg.vocab_size), dtype)))

    def __call__(self, batch: ForwardBatch, pools: MemoryPools) -> tuple[jax.Array, MemoryPools]:
        """Runs all layers; returns the final-normed hidden states f[T, hidden] and the updated pools."""
        x = self.embed[...][batch.input_ids].astype(jnp.float32)
        if not self.cfg.residual_in_fp32:
            x = x.astype(self.dtype).astype(jnp.float32)
        x, rec = scan_recurrent_layers(self.layers, self.cfg.num_layers, x, batch, pools.recurrent)
        return self.norm_f(x, self.dtype), pools._replace(recurrent=rec)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """f32[N, vocab] logits for hidden rows f[N, hidden]."""
        return lm_logits(hidden, self.embed[...], None if self.lm_head is None else self.lm_head[...])


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


def params_from_hf(cfg: MambaConfig, get) -> dict[tuple[str, ...], np.ndarray]:
    """Maps HF tensors (fetched by name with `get`) to our parameter paths, per-layer tensors stacked."""
    mixers = [
        mixer_params_from_hf(get, f"backbone.layers.{i}.mixer.", use_bias=cfg.use_bias,
                             use_conv_bias=cfg.use_conv_bias)
        for i in range(cfg.num_layers)
    ]
    out = {("layers", "mixer", *path): np.stack([m[path] for m in mixers]) for path in mixers[0]}
    out[("layers", "norm", "weight")] = np.stack([get(f"backbone.layers.{i}.norm.weight")
                                                  for i in range(cfg.num_layers)])
    try:
        out[("embed",)] = get("backbone.embeddings.weight")
    except KeyError:  # early Mamba checkpoints name it `embedding` (HF renames it in a load hook)
        out[("embed",)] = get("backbone.embedding.weight")
    out[("norm_f", "weight")] = get("backbone.norm_f.weight")
    if not cfg.tie_word_embeddings:
        out[("lm_head",)] = get("lm_head.weight").T
    return out
