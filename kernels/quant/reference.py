"""Grouped weight-only quantization: the layout, its NumPy quantizer, and the plain-jnp matmul (the oracle for
the native CPU kernel, and what runs on every other backend and for fp8 everywhere).

Layout (GGML's Q4_1 and Q8_0 blocks as arrays, so a GGUF file's blocks are these numbers): a weight W[n, k]
(n outputs, k inputs; a Linear kernel is stored transposed for it) in groups of GROUP = 32 consecutive
inputs of one output row, each group with its own float16 scale:

- 4 bits: `q` u8[n, k // 2], per group 16 bytes, byte j holding element j in its low nibble and element
  j + 16 in its high one (GGML's order); `zero` f16[n, k // 32], the group's minimum:
  w = q * scale + zero, q in 0..15. About 5 bits a weight.
- 8 bits: `q` i8[n, k], symmetric: w = q * scale, q in -127..127; `zero` None. About 8.5 bits a weight.
- fp8: the 8-bit layout with `q` float8_e4m3fn[n, k] (scale = the group's largest magnitude / 448, the
  format's largest value; q rounded to nearest e4m3): the same arrays, dequantized by the same code.

Stored panels (`to_panels`; a Linear's `layout` "panels"): the same arrays with their contents reordered so
the native CPU kernel on int8 activations (kernels/cpu/qgemm_i8.cc, AVX2) reads them as they lie instead
of repacking them every call (llama.cpp repacks its Q4_0 weights so for AVX2 and ARM): the outputs in panels
of PANEL = 16 (n a multiple of it), each panel in its 16 rows' storage, its groups one after the other, and
within a group of a panel
- 4 bits: the row layout's bytes 4u..4u+3 (u = 0..3) of each of the 16 outputs, [u][output][4] (the low
  nibbles are inputs 4u..4u+3, the high ones 16 + 4u..);
- 8 bits: inputs 4j..4j+3 (j = 0..7) of each output, [j][output][4];
- scale and zero: [group][output] within the panel.
The shapes and dtypes are the row layout's: only the order differs (`from_panels` undoes it).

Quantizing rounds as llama.cpp does (`quantize_row_q4_1_ref`, `quantize_row_q8_0_ref`), so quantizing the
values a GGUF file's Q4_1 / Q8_0 blocks dequantize to gives those blocks back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

GROUP = 32
BITS = (4, 8)
PANEL = 16  # outputs per stored panel (kernels/cpu/qgemm_i8.cc kStoredPanel: a vector of 16 with AVX-512)
LAYOUTS = ("rows", "panels")


FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value


def _check(k: int, bits: int, fp8: bool = False) -> None:
    if bits not in BITS:
        raise ValueError(f"bits={bits} must be one of {BITS}")
    if fp8 and bits != 8:
        raise ValueError(f"fp8 values are the 8-bit layout; bits={bits}")
    if k % GROUP:
        raise ValueError(f"the input dimension {k} must be a multiple of {GROUP} to quantize in groups")


def quantize(w: np.ndarray, bits: int, fp8: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """f[n, k] -> (q, scale f16[n, k // 32], zero f16[n, k // 32] or None) in the layout above (`fp8`: the
    8-bit layout with e4m3 values)."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    _check(k, bits, fp8)
    g = w.reshape(n, k // GROUP, GROUP)
    if fp8:
        # Divided by the stored (float16) scale, so q * scale is w to within half an e4m3 step of q. A
        # scale rounded down puts the largest magnitude up to 2^-11 above 448: clipped, an error far under
        # that half step (16 there); unclipped, e4m3fn (no infinity) would round it to NaN past 464.
        d = (np.abs(g).max(axis=-1) / FP8_MAX).astype(np.float16)
        d32 = d.astype(np.float32)[..., None]
        q = np.clip(g / np.where(d32 > 0, d32, 1.0), -FP8_MAX, FP8_MAX).astype(FP8)
        return q.reshape(n, k), d, None
    if bits == 8:
        d = np.abs(g).max(axis=-1) / 127.0
        inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
        q = np.rint(g * inv[..., None]).astype(np.int8)  # |q| <= 127 by construction
        return q.reshape(n, k), d.astype(np.float16), None
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    d = (hi - lo) / 15.0
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    q = np.minimum(15, ((g - lo[..., None]) * inv[..., None] + 0.5).astype(np.int32)).astype(np.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(n, k // 2), d.astype(np.float16), lo.astype(np.float16)


def dequantize(q: jax.Array, scale: jax.Array, zero: jax.Array | None) -> jax.Array:
    """The f32[n, k] weight of a quantized one (4 bits when `zero` is given, else 8: int8 or fp8 `q`)."""
    n, groups = scale.shape
    if zero is None:
        w = q.reshape(n, groups, GROUP).astype(jnp.float32) * scale.astype(jnp.float32)[..., None]
    else:
        b = q.reshape(n, groups, GROUP // 2)
        nibbles = jnp.concatenate([b & 15, b >> 4], axis=-1).astype(jnp.float32)
        w = nibbles * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]
    return w.reshape(n, groups * GROUP)


def _panel_axes(lead: int) -> list[int]:
    """The transpose taking [..., panel, output, group, unit, byte] to [..., panel, group, unit, output,
    byte]."""
    return [*range(lead), lead, lead + 2, lead + 3, lead + 1, lead + 4]


def to_panels(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A grouped weight [..., n, k] (n a multiple of PANEL; int8 or 4-bit `q`) in the stored panels above."""
    q, scale = np.asarray(q), np.asarray(scale)
    *lead, n, groups = scale.shape
    if n % PANEL or q.dtype not in (np.uint8, np.int8):
        raise ValueError(f"stored panels take n a multiple of {PANEL} and integer values (n={n}, {q.dtype})")
    units = 4 if zero is not None else 8
    shape = (*lead, n // PANEL, PANEL, groups, units, 4)
    q = np.ascontiguousarray(q.reshape(shape).transpose(_panel_axes(len(lead)))).reshape(*lead, n, -1)

    def factors(f):
        if f is None:
            return None
        by_group = np.asarray(f).reshape(*lead, n // PANEL, PANEL, groups).swapaxes(-1, -2)
        return np.ascontiguousarray(by_group).reshape(*lead, n, groups)

    return q, factors(scale), factors(zero)


def from_panels(q: jax.Array, scale: jax.Array, zero: jax.Array | None
                ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`to_panels` undone (jnp): the row layout's arrays."""
    *lead, n, groups = scale.shape
    units = 4 if zero is not None else 8
    back = np.argsort(_panel_axes(len(lead)))
    q = q.reshape(*lead, n // PANEL, groups, units, PANEL, 4).transpose(back).reshape(*lead, n, -1)

    def factors(f):
        return None if f is None else f.reshape(*lead, n // PANEL, groups, PANEL).swapaxes(-1, -2).reshape(
            *lead, n, groups)

    return q, factors(scale), factors(zero)


def quantize_activations(x: jax.Array) -> jax.Array:
    """f32 x[..., k] rounded to int8 per group of GROUP inputs (`--activation-quantization int8`, llama.cpp's
    Q8 activation blocks): d = max|x| / 127 and x' = d * round(x * (127 / max|x|)), rounded to nearest even
    (a group of zeros stays zeros). The native kernel (kernels/cpu/qmatmul_i8.cc) takes the same integers
    and scales, and multiplies the integers."""
    x = x.astype(jnp.float32)
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    inv = jnp.where(amax > 0, jnp.float32(127) / jnp.where(amax > 0, amax, 1), 0)
    return (jnp.round(g * inv) * (amax / jnp.float32(127))).reshape(x.shape)


def qmatmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None, *,
                      activations: str = "none", layout: str = "rows") -> jax.Array:
    """f32[..., n] = x[..., k] @ W.T for the quantized W[n, k], accumulated in f32. A bf16 `x` (a model
    computing in bfloat16) multiplies the weights dequantized to bf16; any other `x` is taken as f32.
    `activations` (`--activation-quantization`): "int8": x rounded to int8 per group first
    (`quantize_activations`), then as f32; "bf16": x rounded to bf16 first, then as a bf16 x. `layout`:
    "panels": W in the stored panels (`to_panels`)."""
    if layout == "panels":
        q, scale, zero = from_panels(q, scale, zero)
    if activations == "int8":
        x = quantize_activations(x)
    elif activations == "bf16":
        x = x.astype(jnp.bfloat16)
    w = dequantize(q, scale, zero)
    if x.dtype == jnp.bfloat16:
        w = w.astype(jnp.bfloat16)
    else:
        x = x.astype(jnp.float32)
    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)


def embed_rows(q: jax.Array, scale: jax.Array, zero: jax.Array | None, ids: jax.Array,
               layout: str = "rows") -> jax.Array:
    """f32[..., k]: rows `ids` of the quantized table W[n, k] (an embedding; `layout` as
    `qmatmul_reference`'s), only those rows dequantized."""
    flat = ids.reshape(-1)
    if layout == "panels":  # row i: output i % PANEL of panel i // PANEL, its units in the row's order
        n, groups = scale.shape
        panel, i = flat // PANEL, flat % PANEL
        units = 4 if zero is not None else 8
        q = q.reshape(n // PANEL, groups, units, PANEL, 4)[panel, :, :, i, :].reshape(flat.shape[0], -1)

        def factors(f):
            return None if f is None else f.reshape(n // PANEL, groups, PANEL)[panel, :, i]

        rows = dequantize(q, factors(scale), factors(zero))
    else:
        rows = dequantize(q[flat], scale[flat], None if zero is None else zero[flat])
    return rows.reshape(*ids.shape, rows.shape[-1])
