"""Weight quantization (`--quantization`): per-channel int8 / fp8 MoE expert weights, and grouped 4- or 8-bit
weights for every other Linear layer, the embedding and the LM head (`int4` / `int8` / `fp8`, the layout of
kernels/quant/reference.py: GGML's Q4_1 / Q8_0 blocks as arrays, fp8 the 8-bit one with e4m3 values)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models.weights.lazy import LazyArray, lazy, sources

# kind -> (storage dtype, largest representable magnitude) of MoE expert weights
KINDS = {"int8": (np.dtype(np.int8), 127.0), "fp8": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0)}
# --quantization choice -> how it stores MoE expert weights (per output channel, the scale applied after the
# dot, which the fused MoE kernels take). `int4` stores them in 8 bits: a grouped 4-bit expert needs its
# scales and minimums applied inside the kernels' K loop (docs/architecture.md, "Pallas 4-bit MoE").
EXPERT_KINDS = {"int8": "int8", "fp8": "fp8", "int4": "int8"}
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
    quantized_bytes: int  # MoE expert weights and their scales as stored
    unquantized_bytes: int  # the same weights in the model dtype
    grouped_bytes: int = 0  # grouped Linear / embedding / LM head weights, scales and minimums as stored
    ungrouped_bytes: int = 0  # the same weights in the model dtype

    def describe(self) -> str:
        parts = [f"{what} {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB"
                 for what, before, after in (("expert weights", self.unquantized_bytes, self.quantized_bytes),
                                             ("grouped weights", self.ungrouped_bytes, self.grouped_bytes))
                 if before]
        if not parts:
            return f"quantization {self.kind}: nothing in this checkpoint is stored quantized"
        saved = self.unquantized_bytes + self.ungrouped_bytes - self.quantized_bytes - self.grouped_bytes
        return f"quantization {self.kind}: {', '.join(parts)} (saves {saved / 2**20:.1f} MiB)"


def quantization_report(model: nnx.Module, kind: str, dtype) -> QuantizationReport:
    """What quantizing `model` (already quantized: MoE experts; Linear layers, embedding and LM head in
    groups) saved against storing those weights in `dtype`."""
    from models.layers.linear import Linear
    from models.layers.moe import Experts

    itemsize = jax.numpy.dtype(dtype).itemsize
    experts = [0, 0]
    grouped = [0, 0]

    def add_grouped(q, scale, zero):
        grouped[0] += q.nbytes + scale.nbytes + (0 if zero is None else zero.nbytes)
        grouped[1] += q.size * (2 if zero is not None else 1) * itemsize

    for _, module in nnx.iter_modules(model):
        if isinstance(module, Experts) and getattr(module, "gate_up_scale", None) is not None:
            for name in QUANTIZED_LEAVES:
                w, s = getattr(module, name)[...], getattr(module, name + "_scale")[...]
                experts[0] += w.nbytes + s.nbytes
                experts[1] += w.size * itemsize
        elif isinstance(module, Linear) and module.qkernel is not None:
            zero = None if module.qzero is None else module.qzero[...]
            add_grouped(module.qkernel[...], module.qscale[...], zero)
    for name in ("embed", "lm_head"):
        if getattr(model, name + "_scale", None) is not None:
            zero = getattr(model, name + "_zero")
            add_grouped(getattr(model, name)[...], getattr(model, name + "_scale")[...],
                        None if zero is None else zero[...])
    return QuantizationReport(kind, experts[0], experts[1], grouped[0], grouped[1])


# --quantization choices for the Linear layers, embedding and LM head -> bits of the grouped layout (fp8: the
# 8-bit layout with e4m3 values, `fp8=True` below).
LINEAR_BITS = {"int4": 4, "int8": 8, "fp8": 8}
# GGML block types that `auto` keeps quantized -> bits of the grouped layout they load into. Q4_1 and Q8_0
# blocks are exactly the 4- and 8-bit layouts; Q4_0's (w = d * (q - 8)) are the 4-bit layout with minimum
# -8d, exactly; a Q4_K sub-block of 32 (w = d * sc * q - dmin * m) is a 4-bit group up to the float16 rounding
# of its scale and minimum (`_on_grid`); Q6_K (6-bit values, a scale per 16) is re-rounded onto the 8-bit
# grid, an error under 1/8 of its own step.
GGML_BITS = {2: 4, 3: 4, 12: 4, 8: 8, 14: 8}
GRID_TYPES = (2, 12)  # Q4_0, Q4_K
QUANTIZATION_CHOICES = (None, "none", "int4", "int8", "fp8", "auto")
ACTIVATION_QUANTIZATION_CHOICES = ("none", "int8", "bf16")  # how grouped weights' products round their inputs


def _signature(path) -> tuple[str, ...]:
    """A parameter path without its layer indices (one array per layer, or stacked: the same parameter)."""
    return tuple(str(k) for k in path if not isinstance(k, int) and not str(k).isdigit())


def _grouped_ok(in_features: int) -> bool:
    from kernels.quant import GROUP

    return in_features % GROUP == 0


def linear_signatures(model: nnx.Module) -> set[tuple[str, ...]]:
    """The checkpoint arrays (by `_signature`) grouped quantization can take: every `Linear` kernel whose
    input size is a multiple of the group size, the embedding and an untied LM head."""
    from models.layers.linear import Linear

    out = set()
    for path, module in nnx.iter_modules(model):
        if isinstance(module, Linear) and module.kernel is not None and _grouped_ok(module.kernel.shape[-2]):
            out.add(_signature((*path, "kernel")))
    if _grouped_ok(model.embed.shape[-1]):
        out.add(("embed",))
        if getattr(model, "lm_head", None) is not None:
            out.add(("lm_head",))
    return out


def linear_bits(kind: str, arrays: dict[tuple, np.ndarray], signatures: set[tuple[str, ...]]
                ) -> dict[tuple[str, ...], int]:
    """Bits per quantized array signature: `kind`'s for all of them (int4, int8, fp8), or with `auto` the
    checkpoint's own where every array of a signature was read from GGUF blocks of `GGML_BITS` types (the
    larger of their bits where layers mix types, as Q4_K_M files mix Q4_K and Q6_K); the rest stay
    unquantized."""
    if kind in LINEAR_BITS:
        return dict.fromkeys(signatures, LINEAR_BITS[kind])
    if kind != "auto":
        return {}
    types: dict[tuple[str, ...], set[int]] = {}
    for path, w in arrays.items():
        if _signature(path) in signatures:
            # The GGML type of each GGUF tensor it reads (-1: a source that is no GGUF tensor).
            types.setdefault(_signature(path), set()).update(
                getattr(getattr(s, "info", None), "ggml_type", -1) for s in sources(w))
    return {sig: max(GGML_BITS[t] for t in ts) for sig, ts in types.items() if ts <= GGML_BITS.keys()}


def quantize_linears(model: nnx.Module, bits: dict[tuple[str, ...], int], fp8: bool = False,
                     activations: str = "none") -> nnx.Module:
    """Gives the `Linear` layers, embedding and LM head of `model` named in `bits` (`linear_signatures`)
    grouped weights of those bits (zeros; the loader fills them; `fp8`: the 8-bit ones with float8_e4m3fn
    values); meant for the abstract model under `nnx.eval_shape`. A Linear's `kernel` [in, out] becomes
    `qkernel` / `qscale` / `qzero` of W[out, in]; `embed` [vocab, hidden] and `lm_head` [hidden, vocab] hold
    their quantized [vocab, hidden] forms, with `*_scale` / `*_zero`. `activations`: how their products
    round their inputs ("int8" per group, "bf16"; `--activation-quantization`)."""
    from kernels.quant import GROUP
    from models.layers.linear import Linear

    def parts(lead: tuple[int, ...], n: int, k: int, b: int):
        q = jnp.zeros((*lead, n, k // 2 if b == 4 else k), _q_dtype(b, fp8))
        scale = jnp.zeros((*lead, n, k // GROUP), jnp.float16)
        return (nnx.data(nnx.Param(q)), nnx.data(nnx.Param(scale)),
                nnx.data(nnx.Param(scale)) if b == 4 else None)

    for path, module in nnx.iter_modules(model):
        b = bits.get(_signature((*path, "kernel")))
        if b and isinstance(module, Linear) and module.kernel is not None:
            *lead, k, n = module.kernel.shape
            module.kernel = None
            module.qkernel, module.qscale, module.qzero = parts(tuple(lead), n, k, b)
            module.activations = activations
    for name in ("embed", "lm_head"):
        b = bits.get((name,))
        if b:
            *lead, x, y = getattr(model, name).shape
            vocab, hidden = (x, y) if name == "embed" else (y, x)
            q, scale, zero = parts(tuple(lead), vocab, hidden, b)
            setattr(model, name, q)
            setattr(model, name + "_scale", scale)
            setattr(model, name + "_zero", zero)
    if any(bits.get((name,)) for name in ("embed", "lm_head")):
        model.activations = activations  # the quantized LM head's (causal_lm.py)
    return model


def to_stored_panels(model: nnx.Module) -> nnx.Module:
    """Lays out the grouped weights of `model`'s Linear layers whose products round their inputs to int8
    (`--activation-quantization int8`) in stored panels (kernels/quant/reference.py `to_panels`), where their
    output size is a multiple of PANEL: the native kernel then reads them in place instead of repacking them
    every call (kernels/cpu/qgemm_i8.cc; `KernelBackends.stored_panels` says when). The quantized embedding
    and LM head too (the tied LM head is the embedding; its token rows are then gathered out of their
    panels, kernels/quant/reference.py `embed_rows`). For an unsharded model (a panel must not straddle two
    devices' shards)."""
    from models.layers.causal_lm import CausalLM
    from models.layers.linear import Linear

    for _, module in nnx.iter_modules(model):
        if isinstance(module, Linear) and module.qkernel is not None and module.activations == "int8":
            if _to_panels(module.qkernel, module.qscale, module.qzero):
                module.layout = "panels"
        if isinstance(module, CausalLM) and module.activations == "int8":
            for name in ("embed", "lm_head"):
                parts = [getattr(module, name + suffix) for suffix in ("", "_scale", "_zero")]
                if parts[1] is not None and _to_panels(*parts):
                    setattr(module, name + "_layout", "panels")
    return model


def _to_panels(q, scale, zero) -> bool:
    """The grouped weight in these parameters laid out in stored panels, if it can be (integer values, output
    size a multiple of PANEL); whether it was."""
    from kernels.quant.reference import PANEL, to_panels

    values = [None if v is None else np.asarray(v.get_value()) for v in (q, scale, zero)]
    if values[0].dtype not in (np.uint8, np.int8) or values[1].shape[-2] % PANEL:
        return False
    for var, value in zip((q, scale, zero), to_panels(*values)):
        if var is not None:
            var.set_value(jnp.asarray(value))
    return True


def stored_panel_counts(model: nnx.Module) -> tuple[int, int]:
    """(grouped weights in stored panels, grouped weights) of `model`: its Linear layers', embedding's and
    untied LM head's."""
    from models.layers.causal_lm import CausalLM
    from models.layers.linear import Linear

    layouts = []
    for _, m in nnx.iter_modules(model):
        if isinstance(m, Linear) and m.qkernel is not None:
            layouts.append(m.layout)
        if isinstance(m, CausalLM):
            layouts += [getattr(m, name + "_layout") for name in ("embed", "lm_head")
                        if getattr(m, name + "_scale", None) is not None]
    return layouts.count("panels"), len(layouts)


def _q_dtype(bits: int, fp8: bool) -> np.dtype:
    """The dtype of a grouped weight's values: 4 bits packed two to a byte, 8 bits int8 or e4m3."""
    return np.dtype(np.uint8 if bits == 4 else ml_dtypes.float8_e4m3fn if fp8 else np.int8)


class _GroupedSource:
    """A lazy W[..., n, k] to quantize in groups, its rows read whole along k (as the groups need). The loader
    places a weight's parts one after the other, so the last rows quantized are kept for the next part."""

    def __init__(self, w: LazyArray, bits: int, grid: bool = False, fp8: bool = False):
        self.w, self.bits, self.grid, self.fp8, self.last = w, bits, grid, fp8, (None, None)

    def rows(self, sel) -> tuple[np.ndarray, ...]:
        """The quantized parts of the rows `sel` (index arrays of every axis but k)."""
        from kernels.quant import quantize

        key = b"/".join(s.tobytes() for s in sel)
        if self.last[0] != key:
            k = self.w.shape[-1]
            rows = np.asarray(self.w._read((*sel, np.arange(k))))
            parts = quantize(rows.reshape(-1, k), self.bits, self.fp8)
            if self.grid:
                parts = _on_grid(rows.reshape(-1, k), *parts)
            self.last = key, [None if p is None else p.reshape(*rows.shape[:-1], -1) for p in parts]
        return self.last[1]


def _on_grid(w: np.ndarray, q: np.ndarray, scale: np.ndarray, zero: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The 4-bit groups of f32 `w` [n, k] (`quantize`'s q, scale, zero), with each group whose values lie
    on a grid of at most 16 evenly spaced levels that `quantize` did not reproduce taken onto that grid.

    `quantize` (llama.cpp's Q4_1 rounding) spans a group's minimum to its maximum in 15 steps: exact for
    Q4_1 blocks, whose values use the levels 0 and 15, but a block of another format that leaves its end
    levels unused (Q4_0's w = d * (q - 8), Q4_K's w = d * sc * q - dmin * m) would be re-rounded onto a
    finer grid. Here the grid's step is recovered from the smallest gap between the group's distinct
    values, and level 0 put where it is a float16: at the minimum or whole steps below it, or with a
    negative scale at the maximum or above it (Q4_0's -8d, whatever the sign of d). Q4_0 blocks so load
    exactly, Q4_K's up to the float16 rounding of d * sc and dmin * m. A group is taken onto its grid only
    where that reproduces it more closely."""
    from kernels.quant import GROUP

    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    scale32, zero32 = scale.astype(np.float32), zero.astype(np.float32)
    nib = q.reshape(n, k // GROUP, GROUP // 2)
    levels = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.float32)
    err = np.abs(levels * scale32[..., None] + zero32[..., None] - g).max(axis=-1)
    redo = err > 0
    if not redo.any():
        return q, scale, zero
    v = g[redo]  # [m, GROUP]
    lo, hi = v.min(axis=-1), v.max(axis=-1)
    gaps = np.diff(np.sort(v, axis=-1), axis=-1)
    gaps = np.where(gaps > (hi - lo)[:, None] * 1e-3, gaps, np.inf)
    steps = np.rint((hi - lo) / np.where(np.isfinite(gaps.min(axis=-1)), gaps.min(axis=-1), 1.0))
    step = np.where(steps >= 1, (hi - lo) / np.maximum(steps, 1), 0.0).astype(np.float32)
    ok = (steps >= 1) & (steps <= 15)
    # Level 0 at the minimum moved down by j steps, or (a negative scale) at the maximum moved up by j steps,
    # j in 0 .. 15 - steps: the first such origin that is a float16, else the minimum itself.
    shifts = np.arange(16, dtype=np.float32)
    below, above = lo[:, None] - shifts * step[:, None], hi[:, None] + shifts * step[:, None]
    cand = np.concatenate([below, above], axis=1)
    fits = np.tile(shifts, 2)[None, :] <= 15 - steps[:, None]
    exact = (cand.astype(np.float16).astype(np.float32) == cand) & fits
    j = np.where(exact.any(axis=-1), exact.argmax(axis=-1), 0)
    z16 = cand[np.arange(len(v)), j].astype(np.float16)
    s16 = np.where(j < 16, step, -step).astype(np.float16)
    s32, z32 = s16.astype(np.float32), z16.astype(np.float32)
    lv = np.clip(np.rint((v - z32[:, None]) / np.where(s32 != 0, s32, 1.0)[:, None]), 0, 15)
    better = ok & (np.abs(lv * s32[:, None] + z32[:, None] - v).max(axis=-1) < err[redo])
    if not better.any():
        return q, scale, zero
    levels[redo] = np.where(better[:, None], lv, levels[redo])
    scale, zero = scale.copy(), zero.copy()
    scale[redo] = np.where(better, s16, scale[redo])
    zero[redo] = np.where(better, z16, zero[redo])
    lv8 = levels.astype(np.uint8)
    packed = lv8[..., : GROUP // 2] | (lv8[..., GROUP // 2:] << 4)
    return packed.reshape(q.shape), scale, zero


class _Grouped(LazyArray):
    """Part `part` (0: values, 1: scales, 2: minimums) of a `_GroupedSource`."""

    def __init__(self, source: _GroupedSource, part: int):
        from kernels.quant import GROUP

        self.source, self.part = source, part
        *lead, k = source.w.shape
        bits = source.bits
        self.shape = (*lead, (k // 2 if bits == 4 else k) if part == 0 else k // GROUP)
        self.dtype = np.dtype(np.float16) if part else _q_dtype(bits, source.fp8)

    def _read(self, sel) -> np.ndarray:
        return self.source.rows(sel[:-1])[self.part][..., sel[-1]]


def quantize_linear_arrays(arrays: dict[tuple, np.ndarray], bits: dict[tuple[str, ...], int],
                           fp8: bool = False) -> dict[tuple, np.ndarray]:
    """The checkpoint's arrays with those `bits` names (by `_signature`) in their quantized form
    (`quantize_linears`, `fp8` as there), lazily: each row group is read and quantized when placed. A GGUF
    file's Q4_0 / Q4_1 / Q8_0 tensors, dequantized by the reader, quantize back to exactly their numbers
    (`_on_grid`)."""
    out = dict(arrays)
    for path, w in arrays.items():
        sig = _signature(path)
        b = bits.get(sig)
        if not b:
            continue
        w = lazy(w)
        if sig[-1] == "kernel":
            names = (path[:-1] + ("qkernel",), path[:-1] + ("qscale",), path[:-1] + ("qzero",))
        else:
            names = (path, path[:-1] + (path[-1] + "_scale",), path[:-1] + (path[-1] + "_zero",))
        if sig[-1] in ("kernel", "lm_head"):
            w = w.swapaxes(-1, -2)  # [..., in, out] -> W[..., out, in]
        del out[path]
        # GGUF blocks whose levels `quantize` may not span (Q4_0, Q4_K) are taken back onto their grid
        types = {getattr(getattr(s, "info", None), "ggml_type", -1) for s in sources(w)}
        grid = b == 4 and bool(types & set(GRID_TYPES))
        source = _GroupedSource(w, b, grid, fp8)
        for part, name in enumerate(names[: 3 if b == 4 else 2]):
            out[name] = _Grouped(source, part)
    return out
