"""Native CPU kernels: C++ XLA FFI custom calls, compiled for the host on first use.

`matmul(x, w)` is the decode-sized matmul of every Linear layer and LM head. Its reference is `jnp.dot`;
the native kernel (matmul.cc) splits the work over XLA's intra-op thread pool so a matrix-vector product
reads its weights with every core (XLA:CPU runs one on a single core). It is picked like a Pallas kernel
(kernels/backend.py: `auto` on CPU, op name `matmul`) for f32 operands of at most `MAX_NATIVE_ROWS` rows.

The library is built with the host's C++ compiler (`$CXX`, else `c++`) into the cache directory, keyed
by the source, jaxlib's version and the CPU, and loaded from there afterwards. Without a compiler, or
with `XLASERVE_CPU_KERNELS=0`, the reference runs instead (one warning says why).
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

SOURCE = os.path.join(os.path.dirname(__file__), "matmul.cc")
TARGET = "xlaserve_cpu_matmul"
MAX_NATIVE_ROWS = 4  # more rows: XLA's own dot (measured faster from a 32-row decode up, in bench.one_batch)


def _cache_dir() -> str:
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
           f"-I{jax.ffi.include_dir()}", SOURCE, "-o", out_path]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")


@functools.cache
def library_path() -> str | None:
    """The compiled kernel library (building it if needed), or None when native kernels are unavailable."""
    if os.environ.get("XLASERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + _cpu_signature().encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"matmul-{key}.so")
    if os.path.exists(path):
        return path
    if compiler is None:
        logger.warning("no C++ compiler found ($CXX, c++, g++, clang++): CPU matmuls use XLA's dot")
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    logger.info("compiling the CPU matmul kernel with %s", compiler)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        _compile(compiler, tmp)
        os.replace(tmp, path)  # atomic: concurrent builders each write their own file
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        logger.warning("building the CPU matmul kernel failed, CPU matmuls use XLA's dot: %s", e)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def available() -> bool:
    """Whether the native kernel is built and registered with XLA (builds and registers it once)."""
    path = library_path()
    if path is None:
        return False
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.XlaserveCpuMatmul), platform="cpu")
    return True


def matmul_reference(x: jax.Array, w: jax.Array, *, transpose_w: bool = False) -> jax.Array:
    """f32[..., n] = x[..., k] @ w, w stored [k, n] (or [n, k] with `transpose_w`), accumulated in f32."""
    x = x.astype(w.dtype)
    if transpose_w:
        return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32)
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


def matmul_native(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, interpret: bool = False) -> jax.Array:
    """`matmul_reference` by the native kernel where it applies (f32, at most MAX_NATIVE_ROWS rows, built);
    the reference otherwise. `interpret` is accepted for the dispatcher and means the reference."""
    rows = int(np.prod(x.shape[:-1]))
    if (interpret or w.dtype != jnp.float32 or w.ndim != 2 or rows > MAX_NATIVE_ROWS or rows == 0
            or not available()):
        return matmul_reference(x, w, transpose_w=transpose_w)
    n = w.shape[0] if transpose_w else w.shape[1]
    x2 = x.astype(jnp.float32).reshape(rows, x.shape[-1])
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32), vmap_method="sequential")
    return call(x2, w, w_layout=np.int32(1 if transpose_w else 0)).reshape(*x.shape[:-1], n)


def _dispatched_matmul():
    from kernels.backend import dispatched

    return dispatched("matmul", matmul_reference)


matmul = _dispatched_matmul()
