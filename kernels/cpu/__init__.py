"""Native CPU kernels: C++ XLA FFI custom calls, compiled for the host on first use.

- `matmul(x, w)`: the decode-sized matmul of every Linear layer and LM head. Its reference is `jnp.dot`;
  the native kernel (matmul.cc) splits the work over helper threads so a matrix-vector product reads its
  weights with every core (XLA:CPU runs one on a single core), and a register-tiled product for a
  batch's rows. For f32 operands of at most `MAX_NATIVE_ROWS` rows; with [n, k] weights (the tied LM
  head) at most `MAX_GEMV_ROWS` or from `MIN_NK_GEMM_ROWS` rows.
- `decode_attention_native`: one query per sequence against its pages of the KV pool, read in place
  (attention.cc); the reference is `kernels/paged_attention/reference.decode_attention_reference`. For f32.
- `argmax_first_native`, `logsumexp_native`: a row's first maximum and its log-normaliser over a step's
  logits for sampling (sampling.cc); the references are in `kernels/sampling/reference`.
- `silu_mul_native`: silu(gate) * up of a gated MLP's fused projection in one pass (activation.cc); the
  reference is `kernels/gated_act/reference.silu_mul`.
- `ssd_decode_update_native`, `conv1d_decode_update_native`: a Mamba-2 decode step on each row's SSM and
  conv states where they live in the pools (ssd.cc, the pool aliased in and out); the references are
  `kernels/ssd/reference.ssd_decode_update` and `kernels/conv1d/reference.conv1d_decode_update`.

All are picked like Pallas kernels (kernels/backend.py `CPU_OPS`: `auto` on CPU) and fall back to their
reference where they do not apply.

The library is built with the host's C++ compiler (`$CXX`, else `c++`) into the cache directory
(`set_cache_dir`; else `$XLASERVE_CACHE_DIR/cpu_kernels` or the user cache), keyed
by the source, jaxlib's version and the CPU, and loaded from there afterwards. With
`XLASERVE_CPU_KERNELS=0`, or without a compiler (a warning says so), the reference runs instead.
`XLASERVE_CPU_THREADS` sets how many threads share a product (default: every core).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

HERE = os.path.dirname(__file__)
SOURCES = [os.path.join(HERE, name)
           for name in ("matmul.cc", "attention.cc", "ssd.cc", "sampling.cc", "activation.cc")]
HEADERS = [os.path.join(HERE, "common.h")]
MATMUL_TARGET = "xlaserve_cpu_matmul"
ATTENTION_TARGET = "xlaserve_cpu_decode_attention"
SSD_TARGET = "xlaserve_cpu_ssd_decode"
CONV_TARGET = "xlaserve_cpu_conv_decode"
ARGMAX_TARGET = "xlaserve_cpu_argmax"
LOGSUMEXP_TARGET = "xlaserve_cpu_logsumexp"
SILU_MUL_TARGET = "xlaserve_cpu_silu_mul"
MAX_NATIVE_ROWS = 64  # more rows (prefill): XLA's own dot, which reaches the peak on large products
# [n, k] weights: the native matrix-vector product up to MAX_GEMV_ROWS rows, XLA's dot between, the native
# GEMM from MIN_NK_GEMM_ROWS (measured on the SmolLM2 LM head: XLA's 4.6-6.2 ms at 5-16 rows beat it,
# at 17-32 rows it takes 6.2-6.7 ms against XLA's 6.5-9.1).
MAX_GEMV_ROWS = 4
MIN_NK_GEMM_ROWS = 17


_CACHE_DIR: str | None = None


def set_cache_dir(path: str) -> None:
    """Where the compiled library lives (the server passes `<--cache-dir>/cpu_kernels`)."""
    global _CACHE_DIR
    _CACHE_DIR = path


def _cache_dir() -> str:
    if _CACHE_DIR:
        return _CACHE_DIR
    if os.environ.get("XLASERVE_CACHE_DIR"):
        return os.path.join(os.environ["XLASERVE_CACHE_DIR"], "cpu_kernels")
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("xlaserve"), "cpu_kernels")


def _cpu_signature() -> str:
    """What the compiled code depends on besides its source: the CPU's features and jaxlib's FFI."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    import jaxlib

    return f"{platform.machine()} {flags} jaxlib {jaxlib.__version__}"


def _compile(compiler: str, out_path: str) -> None:
    cmd = [compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
           f"-I{jax.ffi.include_dir()}", *SOURCES, "-o", out_path]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")


@functools.cache
def library_path() -> str | None:
    """The compiled kernel library (building it if needed), or None when native kernels are unavailable."""
    if os.environ.get("XLASERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    digest = hashlib.sha256(_cpu_signature().encode())
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            digest.update(f.read())
    path = os.path.join(_cache_dir(), f"kernels-{digest.hexdigest()[:16]}.so")
    if os.path.exists(path):
        return path
    if compiler is None:
        logger.warning("no C++ compiler found ($CXX, c++, g++, clang++): the CPU kernels' jnp references run")
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    logger.info("compiling the native CPU kernels with %s", compiler)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        _compile(compiler, tmp)
        os.replace(tmp, path)  # atomic: concurrent builders each write their own file
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        logger.warning("building the native CPU kernels failed, their jnp references run: %s", e)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def available() -> bool:
    """Whether the native kernels are built and registered with XLA (builds and registers them once)."""
    path = library_path()
    if path is None:
        return False
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(lib.XlaserveCpuMatmul), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.XlaserveCpuDecodeAttention),
                                platform="cpu")
    jax.ffi.register_ffi_target(SSD_TARGET, jax.ffi.pycapsule(lib.XlaserveCpuSsdDecode), platform="cpu")
    jax.ffi.register_ffi_target(CONV_TARGET, jax.ffi.pycapsule(lib.XlaserveCpuConvDecode), platform="cpu")
    jax.ffi.register_ffi_target(ARGMAX_TARGET, jax.ffi.pycapsule(lib.XlaserveCpuArgmax), platform="cpu")
    jax.ffi.register_ffi_target(LOGSUMEXP_TARGET, jax.ffi.pycapsule(lib.XlaserveCpuLogsumexp), platform="cpu")
    jax.ffi.register_ffi_target(SILU_MUL_TARGET, jax.ffi.pycapsule(lib.XlaserveCpuSiluMul), platform="cpu")
    return True


def matmul_reference(x: jax.Array, w: jax.Array, *, transpose_w: bool = False) -> jax.Array:
    """f32[..., n] = x[..., k] @ w, w stored [k, n] (or [n, k] with `transpose_w`), accumulated in f32."""
    x = x.astype(w.dtype)
    if transpose_w:
        return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def matmul_native(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, interpret: bool = False) -> jax.Array:
    """`matmul_reference` by the native kernel where it applies (f32, at most MAX_NATIVE_ROWS rows, and with
    `transpose_w` at most MAX_GEMV_ROWS or from MIN_NK_GEMM_ROWS; built); the reference otherwise.
    `interpret` is accepted for the dispatcher and means the reference."""
    rows = int(np.prod(x.shape[:-1]))
    xla_rows = transpose_w and MAX_GEMV_ROWS < rows < MIN_NK_GEMM_ROWS
    if (interpret or w.dtype != jnp.float32 or w.ndim != 2 or rows > MAX_NATIVE_ROWS or rows == 0
            or xla_rows or not available()):
        return matmul_reference(x, w, transpose_w=transpose_w)
    n = w.shape[0] if transpose_w else w.shape[1]
    x2 = x.astype(jnp.float32).reshape(rows, x.shape[-1])
    call = jax.ffi.ffi_call(MATMUL_TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32), vmap_method="sequential")
    return call(x2, w, w_layout=np.int32(1 if transpose_w else 0)).reshape(*x.shape[:-1], n)


def decode_attention_native(q, k_pool, v_pool, layer, pages, positions, *, page_size: int, scale: float,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            interpret: bool = False) -> jax.Array:
    """`decode_attention_reference` (same arguments) by the native kernel: f32 queries and pools."""
    from kernels.paged_attention.reference import decode_attention_reference

    if interpret or q.dtype != jnp.float32 or k_pool.dtype != jnp.float32 or not available():
        return decode_attention_reference(q, k_pool, v_pool, layer, pages, positions, page_size=page_size,
                                          scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q, k_pool, v_pool, jnp.asarray(layer, jnp.int32), pages.astype(jnp.int32),
                positions.astype(jnp.int32), page_size=np.int32(page_size), window=np.int32(sliding_window or 0),
                scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0))


def _update_in_place(target: str, y_shape, operands: tuple, pool_index: int, *scalars):
    """Calls a native state-update kernel: returns (y f32[y_shape], the pool operand updated in place)."""
    f32 = jnp.float32
    pool = operands[pool_index]
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(y_shape, f32), jax.ShapeDtypeStruct(pool.shape, f32)),
                            input_output_aliases={pool_index: 1}, vmap_method="sequential")
    inputs = [x if i == pool_index else x.astype(f32) for i, x in enumerate(operands)]
    return call(*inputs, *(jnp.asarray(v, jnp.int32) for v in scalars))


def ssd_decode_update_native(x, dt, A, B, C, pool, layer, slots, *, interpret: bool = False):
    """`ssd_decode_update` (same arguments) by the native kernel, updating the f32 pool in place."""
    from kernels.ssd.reference import ssd_decode_update

    if interpret or pool.dtype != jnp.float32 or not available():
        return ssd_decode_update(x, dt, A, B, C, pool, layer, slots)
    return _update_in_place(SSD_TARGET, x.shape, (x, dt, A, B, C, pool), 5, layer, slots)


def conv1d_decode_update_native(x, weight, bias, pool, layer, slots, *, interpret: bool = False):
    """`conv1d_decode_update` (same arguments) by the native kernel, updating the f32 pool in place."""
    from kernels.conv1d.reference import conv1d_decode_update

    if interpret or pool.dtype != jnp.float32 or not available():
        return conv1d_decode_update(x, weight, bias, pool, layer, slots)
    bias = jnp.zeros((0,), jnp.float32) if bias is None else bias
    return _update_in_place(CONV_TARGET, x.shape, (x, weight, bias, pool), 3, layer, slots)


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
