"""Per-channel int8 / fp8 weight quantization of MoE expert weights (`--quantization`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

# kind -> (storage dtype, largest representable magnitude)
KINDS = {"int8": (np.dtype(np.int8), 127.0), "fp8": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0)}
QUANTIZED_LEAVES = ("gate_up", "down")  # the `Experts` parameters that get quantized


def _check(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown quantization {kind!r}; known: {', '.join(KINDS)}")


def quantize_weight(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """w f[..., in, out] -> (q [..., in, out] in the kind's dtype, scale f32[..., out]), w ~= q * scale.

    One scale per output channel (per expert, and per layer when stacked): the channel's largest magnitude
    maps to the format's largest value. int8 rounds to nearest; fp8 is e4m3fn, rounded to nearest.
    """
    _check(kind)
    dtype, qmax = KINDS[kind]
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=-2)
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    scaled = w / scale[..., None, :]
    q = np.clip(np.rint(scaled), -qmax, qmax).astype(dtype) if kind == "int8" else scaled.astype(dtype)
    return q, scale


def quantize_experts(model: nnx.Module, kind: str) -> nnx.Module:
    """Gives every `Experts` module of `model` quantized weights and scale parameters (zeros; the loader
    fills them). Meant for the abstract model under `nnx.eval_shape`. Raises if there is no expert."""
    from models.layers.moe import Experts

    _check(kind)
    found = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Experts):
            for name in QUANTIZED_LEAVES:
                w = getattr(module, name)
                setattr(module, name, nnx.Param(jnp.zeros(w.shape, KINDS[kind][0])))
                scale = nnx.Param(jnp.zeros(w.shape[:-2] + w.shape[-1:], jnp.float32))
                setattr(module, name + "_scale", nnx.data(scale))  # was a static None
            found += 1
    if not found:
        raise ValueError(f"--quantization {kind} quantizes MoE expert weights, and this model has no experts")
    return model


def quantize_arrays(
    arrays: dict[tuple[str, ...], np.ndarray], kind: str
) -> dict[tuple[str, ...], np.ndarray]:
    """The checkpoint's arrays with every `(..., "experts", gate_up|down)` quantized and its scale added.

    Lazily (models/weights/lazy.py): a shard reads its output channels whole along the input axis (the
    scale's reduction) and nothing else."""
    from models.weights.lazy import along_axis

    out = dict(arrays)
    for path, w in arrays.items():
        if len(path) >= 2 and path[-2] == "experts" and path[-1] in QUANTIZED_LEAVES:
            out[path] = along_axis(
                lambda b: quantize_weight(b, kind)[0], w, -2, keep=True, dtype=KINDS[kind][0]
            )
            out[path[:-1] + (path[-1] + "_scale",)] = along_axis(
                lambda b: quantize_weight(b, kind)[1], w, -2, keep=False, dtype=np.float32
            )
    return out


class QuantizationReport(NamedTuple):
    kind: str
    quantized_bytes: int  # expert weights and their scales as stored
    unquantized_bytes: int  # the same weights in the model dtype

    def describe(self) -> str:
        saved = self.unquantized_bytes - self.quantized_bytes
        return (
            f"quantization {self.kind}: expert weights {self.unquantized_bytes / 2**20:.1f} MiB -> "
            f"{self.quantized_bytes / 2**20:.1f} MiB (saves {saved / 2**20:.1f} MiB)"
        )


def quantization_report(model: nnx.Module, kind: str, dtype) -> QuantizationReport:
    """What quantizing the experts of `model` (already quantized) saved against storing them in `dtype`."""
    from models.layers.moe import Experts

    stored = unquantized = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Experts):
            for name in QUANTIZED_LEAVES:
                w, s = getattr(module, name)[...], getattr(module, name + "_scale")[...]
                stored += w.nbytes + s.nbytes
                unquantized += w.size * jax.numpy.dtype(dtype).itemsize
    return QuantizationReport(kind, stored, unquantized)
