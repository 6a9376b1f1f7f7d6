"""Native CPU kernels: C++ XLA FFI custom calls, compiled for the host on first use.

- `matmul(x, w)`: the decode-sized matmul of every Linear layer and LM head. Its reference is `jnp.dot`;
  the native kernel (matmul.cc) splits the work over helper threads so a matrix-vector product reads its
  weights with every core (XLA:CPU runs one on a single core), and a register-tiled product for a
  batch's rows. For f32 operands of at most `MAX_NATIVE_ROWS` rows; with [n, k] weights (the tied LM
  head) at most `MAX_GEMV_ROWS` or from `MIN_NK_GEMM_ROWS` to `max_nk_gemm_rows()` rows.
- `qmatmul_native`: the same product on grouped 4- and 8-bit weights; the reference and the layout are
  `kernels/quant/reference.qmatmul_reference`. Few rows: read in place and dequantized in registers
  (qmatmul.cc); many rows (prefill) or bf16 activations: dequantized once per call into panels and multiplied
  by a register-tiled GEMM, in f32 or, for bf16 activations, by AVX512-BF16 pair products (qgemm.cc); int8
  activations by integer products (qmatmul_i8.cc, qgemm_i8.cc), on AVX2 from weights laid out at load in
  stored panels (`layout="panels"`, `panel_width()`).
- `decode_attention_native`: one query per sequence against its pages of the KV pool, read in place
  (attention.cc); the reference is `kernels/paged_attention/reference.decode_attention_reference`. For f32
  or bf16 queries and pools, computed in f32.
- `prefill_attention_native`: blocks of a sequence's consecutive queries against its pages, read in place,
  only the keys each block sees, with an online softmax (prefill_attention.cc); the reference is
  `prefill_attention_reference` there. For f32 or bf16 queries and pools, and head dimensions that are
  multiples of 16.
- `write_rows_native`: a step's new K/V rows (or MLA latents) into their slots of one layer of a pool, in
  place (write_rows.cc): the reference is `kernels/paged_attention/reference.write_rows`, a scatter, which
  XLA:CPU runs on a bf16 pool by converting the whole pool to f32 and back. For f32 or bf16 pools.
- `argmax_first_native`, `logsumexp_native`: a row's first maximum and its log-normaliser over a step's
  logits for sampling (sampling.cc); the references are in `kernels/sampling/reference`.
- `silu_mul_native`: silu(gate) * up of a gated MLP's fused projection in one pass (activation.cc); the
  reference is `kernels/gated_act/reference.silu_mul`.
- `ssd_decode_update_native`, `conv1d_decode_update_native`: a Mamba-2 decode step on each row's SSM and
  conv states where they live in the pools (ssd.cc, the pool aliased in and out); the references are
  `kernels/ssd/reference.ssd_decode_update` and `kernels/conv1d/reference.conv1d_decode_update`.
- `gated_delta_decode_update_native`, `kda_decode_update_native`: a gated delta rule (Gated DeltaNet) or Kimi
  Delta Attention decode step on each row's state where it lives in the pool (delta_rule.cc, one kernel for
  both, the pool aliased in and out); the references are `gated_delta_decode_update` and `kda_decode_update`
  in `kernels/delta_rule/reference`.

All are picked like Pallas kernels (kernels/backend.py `CPU_OPS`: `auto` on CPU) and fall back to their
reference where they do not apply.

kernels/cpu/build.py compiles the library with a C++ compiler into a cache directory, keyed by the source,
jaxlib's version and the CPU, and loads it from there afterwards. It reads no environment: `configure` with
a `BuildConfig` sets the compiler, the directory, how many threads share a kernel, or switches the kernels
off with a reason; unconfigured, it takes the first of `c++`, `g++`, `clang++` on PATH, the user cache's
`xlaserve/cpu_kernels` and every core. xlaserve configures it from its environment variables
(serve/native_kernels.py; `xlaserve build-kernels` builds ahead of time). Switched off, without a compiler
or when the compile fails, the references run instead and `unavailable_reason()` says why (the server logs
it as a WARNING).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

# The build's API (available, BuildConfig, configure, library_path, unavailable_reason) is re-exported here.
from kernels.cpu.build import (
    ARGMAX_TARGET,
    ATTENTION_TARGET,
    CONV_TARGET,
    DELTA_TARGET,
    LOGSUMEXP_TARGET,
    MATMUL_TARGET,
    PREFILL_ATTENTION_TARGET,
    QGEMM_I8_TARGET,
    QGEMM_TARGET,
    QMATMUL_I8_TARGET,
    QMATMUL_PANELS_TARGET,
    QMATMUL_TARGET,
    SILU_MUL_TARGET,
    SSD_TARGET,
    WRITE_ROWS_TARGET,
    BuildConfig,  # noqa: F401
    amx_reason,  # noqa: F401
    available,
    configure,  # noqa: F401
    has_int8_activations,
    library_path,  # noqa: F401
    panel_width,
    shared_attention_tokens,  # noqa: F401
    unavailable_reason,  # noqa: F401
    use_amx,  # noqa: F401
    use_shared_attention,  # noqa: F401
    vector_registers,
)

MAX_NATIVE_ROWS = 64  # more rows (prefill): XLA's own dot, which reaches the peak on large products
# [n, k] weights: the native matrix-vector product up to MAX_GEMV_ROWS rows, XLA's dot between, the native
# GEMM from MIN_NK_GEMM_ROWS (measured on the SmolLM2 LM head: XLA's 4.6-6.2 ms at 5-16 rows beat it,
# at 17-32 rows it takes 6.2-6.7 ms against XLA's 6.5-9.1).
MAX_GEMV_ROWS = 4
MIN_NK_GEMM_ROWS = 17
# Without AVX-512 the [n, k] GEMM stops at MAX_NK_GEMM_ROWS_NARROW rows (the same LM head on AMD Zen 3, AVX2:
# 32 rows 18-20 ms against XLA's 21-24, 48 rows 34-39 against 24-26, 64 rows 37-51 against 29-34).
MAX_NK_GEMM_ROWS_NARROW = 32
# Grouped 4-/8-bit weights: qmatmul.cc (dequantizing a group once per tile of 4 rows) up to MAX_QMATMUL_ROWS
# rows of f32, qgemm.cc (dequantizing once per call into panels) above, and for bf16 from QGEMM_MIN_BF16_ROWS.
MAX_QMATMUL_ROWS = 16
# Without AVX-512 (AVX2: qmatmul.cc's tiles 2 x 2) qgemm.cc is the faster from about 10 rows (SmolLM2's
# W[1536, 576] on AMD Zen 3: 8 rows 0.30 ms against 0.38-0.44, 12 rows 0.43-0.59 against 0.37-0.48).
MAX_QMATMUL_ROWS_NARROW = 8
QGEMM_MIN_BF16_ROWS = 8
# int8 activations: qmatmul_i8.cc up to MAX_QMATMUL_I8_ROWS rows, qgemm_i8.cc above (SmolLM2's 4-bit
# products, 30 layers, AMD Zen 4: 8 rows 12.9 ms against 13.7, 16 rows 20.3 against 16.2).
MAX_QMATMUL_I8_ROWS = 8
# With AVX2 (vpmaddubsw forms) qgemm_i8.cc is the faster from 5 rows (the same 30 layers, AMD Zen 3: 4 rows
# 21.5 ms against 24.9, 5 rows 24.1 against 21.3, 8 rows 28.1 against 21.5; 8-bit weights alike).
MAX_QMATMUL_I8_ROWS_NARROW = 4

# A step's token rows and which of them are real: (rows, i32[4] live ranges), set by `live_rows`.
_LIVE: contextvars.ContextVar[tuple[int, jax.Array] | None] = contextvars.ContextVar("live_rows",
                                                                                   default=None)


@contextlib.contextmanager
def live_rows(rows: int, live: jax.Array) -> Iterator[None]:
    """Products traced inside this block whose x has `rows` leading rows (a step's tokens) compute only rows
    [live[0], live[1]) and [live[2], live[3]) (the step's prefill and decode tokens) and give zeros for the
    rest (a bucket's padding), where the kernel takes it: the many-row GEMMs on grouped weights, qgemm.cc
    (f32 or bf16 activations) and qgemm_i8.cc (int8). On a 2-core CPU a mixed step's products cost about
    their rows: ~130 new tokens after a cached prefix ran in a 12-block (192-row) program."""
    token = _LIVE.set((rows, live))
    try:
        yield
    finally:
        _LIVE.reset(token)


def _live(x: jax.Array) -> jax.Array:
    """The live ranges for a product on x: the step's where x is its token rows ([T, k]), else every row."""
    rows = int(np.prod(x.shape[:-1]))  # the product's rows, as qmatmul_native counts them
    step = _LIVE.get()
    if step is not None and x.ndim >= 2 and x.shape[0] == rows == step[0]:
        return step[1].astype(jnp.int32)
    return jnp.asarray([0, rows, rows, rows], jnp.int32)


def max_qmatmul_rows() -> int:
    """Rows of f32 x up to which qmatmul.cc multiplies grouped weights (qgemm.cc above)."""
    return MAX_QMATMUL_ROWS if vector_registers() >= 32 else MAX_QMATMUL_ROWS_NARROW


def max_nk_gemm_rows() -> int:
    """Rows up to which the native GEMM multiplies [n, k] weights (the tied LM head; XLA's dot above)."""
    return MAX_NATIVE_ROWS if vector_registers() >= 32 else MAX_NK_GEMM_ROWS_NARROW


def max_qmatmul_i8_rows() -> int:
    """Rows up to which qmatmul_i8.cc multiplies under int8 activations (qgemm_i8.cc above)."""
    return MAX_QMATMUL_I8_ROWS if vector_registers() >= 32 else MAX_QMATMUL_I8_ROWS_NARROW


def matmul_reference(x: jax.Array, w: jax.Array, *, transpose_w: bool = False) -> jax.Array:
    """f32[..., n] = x[..., k] @ w, w stored [k, n] (or [n, k] with `transpose_w`), accumulated in f32."""
    x = x.astype(w.dtype)
    if transpose_w:
        return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def matmul_native(x: jax.Array, w: jax.Array, *, transpose_w: bool = False,
                  interpret: bool = False) -> jax.Array:
    """`matmul_reference` by the native kernel where it applies (f32 weights: at most MAX_NATIVE_ROWS rows,
    and with `transpose_w` at most MAX_GEMV_ROWS or from MIN_NK_GEMM_ROWS to `max_nk_gemm_rows()`; bf16
    weights: at most MAX_GEMV_ROWS rows; built); the reference otherwise. bf16 weights (a bfloat16 model's)
    are widened as they are read and multiplied with x rounded to bf16, as the reference multiplies them:
    exact products, f32 sums. XLA:CPU's own bf16 dot is slow for 1-3 rows (the SmolLM2 LM head, one row:
    29.9 ms against 1.1 native; a batch-1 decode step 66 ms, 3x the f32 model's) and fast from 4 (it took
    40 rows in 0.25 ms to the native 0.35). `interpret` is accepted for the dispatcher and means the
    reference."""
    rows = int(np.prod(x.shape[:-1]))
    xla_rows = (transpose_w and (MAX_GEMV_ROWS < rows < MIN_NK_GEMM_ROWS or rows > max_nk_gemm_rows())
                or w.dtype == jnp.bfloat16 and rows > MAX_GEMV_ROWS)
    if (interpret or w.dtype not in (jnp.float32, jnp.bfloat16) or w.ndim != 2 or rows > MAX_NATIVE_ROWS
            or rows == 0 or xla_rows or not available()):
        return matmul_reference(x, w, transpose_w=transpose_w)
    n = w.shape[0] if transpose_w else w.shape[1]
    x2 = x.astype(w.dtype).astype(jnp.float32).reshape(rows, x.shape[-1])
    call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32),
                            vmap_method="sequential")
    return call(x2, w, w_layout=np.int32(1 if transpose_w else 0)).reshape(*x.shape[:-1], n)


def qmatmul_native(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None, *,
                   activations: str = "none", layout: str = "rows", interpret: bool = False) -> jax.Array:
    """`qmatmul_reference` (same arguments: 4 bits when `zero` is given, else 8) by a native kernel where one
    applies (u8 or i8 `q`, f16 scales and zeros; built): up to `max_qmatmul_rows()` rows of f32 `x`
    qmatmul.cc, more rows (or bf16 `x`, `QGEMM_MIN_BF16_ROWS` rows and more) qgemm.cc; the reference
    otherwise (fp8 `q` always: the kernels read integers). Few rows of bf16 `x` are multiplied as f32 by
    qmatmul.cc, with the weights not rounded to bf16: closer to f32 than the reference.

    `activations` (the reference's): "int8": integer products of the rounded activations, up to
    `max_qmatmul_i8_rows()` rows by qmatmul_i8.cc, more by qgemm_i8.cc (built for AVX512-VNNI, or in their
    vpmaddubsw forms for AVX2; else the rounding in jnp, then qmatmul.cc or, above
    `max_qmatmul_rows()`, qgemm.cc in f32). "bf16": from `QGEMM_MIN_BF16_ROWS` rows x rounded to bf16 in
    jnp, then as a bf16 `x` (a prefill's products on
    AVX512-BF16 pairs or AMX-BF16 tiles, the rest of the model in f32); fewer rows, bound by reading the
    weights, are multiplied in f32 unrounded (closer to f32 than the reference, and no slower: rounding them
    bought nothing and cost a conversion per product).

    `layout` "panels" (W in stored panels, kernels/quant/reference.py `to_panels`; models/quantization.py
    `to_stored_panels` lays out a model so where `panel_width()` says the library has the kernel): any number
    of rows of int8 activations by qgemm_i8.cc's stored-panel kernel; anything else by the reference."""
    from kernels.quant.reference import GROUP, PANEL, qmatmul_reference, quantize_activations

    rows, k, bits = int(np.prod(x.shape[:-1])), x.shape[-1], 8 if zero is None else 4
    q_dtype = jnp.int8 if bits == 8 else jnp.uint8
    n = scale.shape[0]
    if (interpret or rows == 0 or k % GROUP or q.dtype != q_dtype
            or x.dtype not in (jnp.float32, jnp.bfloat16) or scale.dtype != jnp.float16
            or (zero is not None and zero.dtype != jnp.float16)
            or not available()
            or layout == "panels" and (activations != "int8" or panel_width() != PANEL or n % PANEL)):
        return qmatmul_reference(x, q, scale, zero, activations=activations, layout=layout)
    zero = jnp.zeros((0,), jnp.float16) if bits == 8 else zero  # the kernels' 8 bits: an empty zero
    if layout == "panels":
        call = jax.ffi.ffi_call(QMATMUL_PANELS_TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32),
                                vmap_method="sequential")
        return call(x.astype(jnp.float32).reshape(rows, k), q, scale, zero, _live(x),
                    bits=np.int32(bits)).reshape(*x.shape[:-1], n)
    if activations == "bf16" and rows >= QGEMM_MIN_BF16_ROWS:
        x = x.astype(jnp.bfloat16)
    gemm = rows > max_qmatmul_rows() or (x.dtype == jnp.bfloat16 and rows >= QGEMM_MIN_BF16_ROWS)
    target = QGEMM_TARGET if gemm else QMATMUL_TARGET
    if activations == "int8":
        gemm = rows > max_qmatmul_rows()
        if has_int8_activations():  # both round f32 x themselves
            gemm = rows > max_qmatmul_i8_rows()
            x, target = x.astype(jnp.float32), QGEMM_I8_TARGET if gemm else QMATMUL_I8_TARGET
        else:
            x, target = quantize_activations(x), QGEMM_TARGET if gemm else QMATMUL_TARGET
    x2 = x.reshape(rows, k) if gemm else x.astype(jnp.float32).reshape(rows, k)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows, n), jnp.float32), vmap_method="sequential")
    live = (_live(x),) if target in (QGEMM_I8_TARGET, QGEMM_TARGET) else ()
    return call(x2, q, scale, zero, *live, bits=np.int32(bits)).reshape(*x.shape[:-1], n)


def _native_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array) -> bool:
    """Whether the attention kernels take these operands: f32 or bf16 queries (a bf16 model's: widened to f32,
    the output rounded back), pools both f32 or both bf16."""
    return (q.dtype in (jnp.float32, jnp.bfloat16) and k_pool.dtype == v_pool.dtype
            and k_pool.dtype in (jnp.float32, jnp.bfloat16))


def decode_attention_native(q, k_pool, v_pool, layer, pages, positions, *, page_size: int, scale: float,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            interpret: bool = False) -> jax.Array:
    """`decode_attention_reference` (same arguments) by the native kernel: f32 or bf16 queries and pools. It
    computes in f32 throughout (a bf16 model's reference rounds the softmax weights to bf16)."""
    from kernels.paged_attention.reference import decode_attention_reference

    if interpret or not _native_attention(q, k_pool, v_pool) or not available():
        return decode_attention_reference(q, k_pool, v_pool, layer, pages, positions, page_size=page_size,
                                          scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    out = call(q.astype(jnp.float32), k_pool, v_pool, jnp.asarray(layer, jnp.int32), pages.astype(jnp.int32),
               positions.astype(jnp.int32), page_size=np.int32(page_size),
               window=np.int32(sliding_window or 0), scale=np.float32(scale),
               soft_cap=np.float32(soft_cap or 0.0), bf16_query=np.int32(q.dtype == jnp.bfloat16))
    return out.astype(q.dtype)


def prefill_attention_native(q, k_pool, v_pool, layer, block_pages, positions, *, page_size: int,
                             block_size: int, scale: float, sliding_window: int | None = None,
                             soft_cap: float | None = None, interpret: bool = False) -> jax.Array:
    """`prefill_attention_reference` (same arguments) by the native kernel: f32 or bf16 queries and pools (as
    `decode_attention_native`), a head dimension that is a multiple of 16."""
    from kernels.paged_attention.reference import prefill_attention_reference

    kw = dict(page_size=page_size, block_size=block_size, scale=scale, sliding_window=sliding_window,
              soft_cap=soft_cap)
    if (interpret or not _native_attention(q, k_pool, v_pool) or q.shape[-1] % 16 or q.shape[0] == 0
            or not available()):
        return prefill_attention_reference(q, k_pool, v_pool, layer, block_pages, positions, **kw)
    call = jax.ffi.ffi_call(PREFILL_ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    out = call(q.astype(jnp.float32), k_pool, v_pool, jnp.asarray(layer, jnp.int32),
               block_pages.astype(jnp.int32), positions.astype(jnp.int32), page_size=np.int32(page_size),
               block_size=np.int32(block_size), window=np.int32(sliding_window or 0), scale=np.float32(scale),
               soft_cap=np.float32(soft_cap or 0.0), bf16_query=np.int32(q.dtype == jnp.bfloat16))
    return out.astype(q.dtype)


def write_rows_native(pool: jax.Array, layer, rows: jax.Array, slots: jax.Array, *,
                      interpret: bool = False) -> jax.Array:
    """`kernels/paged_attention/reference.write_rows` (same arguments) by the native kernel, in place in the
    pool: f32 or bf16 pools and rows (XLA:CPU converts a whole bf16 pool to f32 and back for a scatter)."""
    from kernels.paged_attention.reference import write_rows

    f32_or_bf16 = (jnp.float32, jnp.bfloat16)
    if interpret or pool.dtype not in f32_or_bf16 or rows.dtype not in f32_or_bf16 or not available():
        return write_rows(pool, layer, rows, slots)
    call = jax.ffi.ffi_call(WRITE_ROWS_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0}, vmap_method="sequential")
    return call(pool, jnp.asarray(layer, jnp.int32), rows, slots.astype(jnp.int32))


def _update_in_place(target: str, y_shape, operands: tuple, pool_index: int, *scalars, **attrs):
    """Calls a native state-update kernel: returns (y f32[y_shape], the pool operand updated in place).
    `scalars` go in as i32 operands, `attrs` as the custom call's attributes."""
    f32 = jnp.float32
    pool = operands[pool_index]
    call = jax.ffi.ffi_call(target,
                            (jax.ShapeDtypeStruct(y_shape, f32), jax.ShapeDtypeStruct(pool.shape, f32)),
                            input_output_aliases={pool_index: 1}, vmap_method="sequential")
    inputs = [x if i == pool_index else x.astype(f32) for i, x in enumerate(operands)]
    return call(*inputs, *(jnp.asarray(v, jnp.int32) for v in scalars), **attrs)


def ssd_decode_update_native(x, dt, A, B, C, pool, layer, slots, write_slots=None, *,
                             interpret: bool = False):
    """`ssd_decode_update` (same arguments) by the native kernel, updating the f32 pool in place."""
    from kernels.ssd.reference import ssd_decode_update

    if interpret or pool.dtype != jnp.float32 or not available():
        return ssd_decode_update(x, dt, A, B, C, pool, layer, slots, write_slots)
    return _update_in_place(SSD_TARGET, x.shape, (x, dt, A, B, C, pool), 5, layer, slots,
                            slots if write_slots is None else write_slots)


def conv1d_decode_update_native(x, weight, bias, pool, layer, slots, write_slots=None, *,
                                interpret: bool = False):
    """`conv1d_decode_update` (same arguments) by the native kernel, updating the f32 pool in place."""
    from kernels.conv1d.reference import conv1d_decode_update

    if interpret or pool.dtype != jnp.float32 or not available():
        return conv1d_decode_update(x, weight, bias, pool, layer, slots, write_slots)
    bias = jnp.zeros((0,), jnp.float32) if bias is None else bias
    return _update_in_place(CONV_TARGET, x.shape, (x, weight, bias, pool), 3, layer, slots,
                            slots if write_slots is None else write_slots)


def gated_delta_decode_update_native(q, k, v, g, beta, pool, layer, slots, write_slots=None, *, scale: float,
                                     interpret: bool = False):
    """`gated_delta_decode_update` (same arguments) by the native kernel, updating the f32 pool in place."""
    from kernels.delta_rule.reference import gated_delta_decode_update

    if interpret or pool.dtype != jnp.float32 or not available():
        return gated_delta_decode_update(q, k, v, g, beta, pool, layer, slots, write_slots, scale=scale)
    return _update_in_place(DELTA_TARGET, v.shape, (q, k, v, g, beta, pool), 5, layer, slots,
                            slots if write_slots is None else write_slots, scale=np.float32(scale))


def kda_decode_update_native(q, k, v, g, beta, pool, layer, slots, write_slots=None, *, scale: float,
                             interpret: bool = False):
    """`kda_decode_update` (same arguments; g f32[D, H, Dk]) by the native kernel, updating the f32 pool in
    place: the gated kernel with a decay per key channel."""
    from kernels.delta_rule.reference import kda_decode_update

    if interpret or pool.dtype != jnp.float32 or not available():
        return kda_decode_update(q, k, v, g, beta, pool, layer, slots, write_slots, scale=scale)
    return _update_in_place(DELTA_TARGET, v.shape, (q, k, v, g, beta, pool), 5, layer, slots,
                            slots if write_slots is None else write_slots, scale=np.float32(scale))


def _row_reduction(target: str, dtype, reference, x: jax.Array, interpret: bool) -> jax.Array:
    """`reference(x)` over the rows of f32[B, V] by the native kernel `target` (result [B] of `dtype`)."""
    if interpret or x.dtype != jnp.float32 or x.ndim != 2 or x.shape[-1] == 0 or not available():
        return reference(x)
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape[:1], dtype), vmap_method="sequential")(x)


def argmax_first_native(x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """`kernels.sampling.reference.argmax_first` (f32[B, V] -> i32[B]) by the native kernel."""
    from kernels.sampling.reference import argmax_first

    return _row_reduction(ARGMAX_TARGET, jnp.int32, argmax_first, x, interpret)


def logsumexp_native(x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """`kernels.sampling.reference.logsumexp` (f32[B, V] -> f32[B]) by the native kernel."""
    from kernels.sampling.reference import logsumexp

    return _row_reduction(LOGSUMEXP_TARGET, jnp.float32, logsumexp, x, interpret)


def silu_mul_native(y: jax.Array, *, interpret: bool = False) -> jax.Array:
    """`kernels.gated_act.reference.silu_mul` (y f32[..., 2I] -> [..., I]) by the native kernel."""
    from kernels.gated_act.reference import silu_mul

    if interpret or y.dtype != jnp.float32 or y.shape[-1] % 2 or y.size == 0 or not available():
        return silu_mul(y)
    rows, inner = int(np.prod(y.shape[:-1])), y.shape[-1] // 2
    call = jax.ffi.ffi_call(SILU_MUL_TARGET, jax.ShapeDtypeStruct((rows, inner), jnp.float32),
                            vmap_method="sequential")
    return call(y.reshape(rows, 2 * inner)).reshape(*y.shape[:-1], inner)


def native_in_use(op: str) -> bool:
    """Whether `op` traced now runs its native CPU kernel (for callers that lay out data differently)."""
    from kernels.backend import active

    return active().choice(op)[0] == "native" and available()


def _dispatched_matmul():
    from kernels.backend import dispatched

    return dispatched("matmul", matmul_reference)


matmul = _dispatched_matmul()
