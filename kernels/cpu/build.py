"""Compiling, caching and registering the native CPU kernels' library, and saying why it is off when it is."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import NamedTuple

import jax

logger = logging.getLogger(__name__)

HERE = os.path.dirname(__file__)
SOURCES = [
    os.path.join(HERE, name)
    for name in ("matmul.cc", "attention.cc", "prefill_attention.cc", "ssd.cc", "sampling.cc",
                 "activation.cc", "qmatmul.cc", "qmatmul_i8.cc", "qgemm.cc", "qgemm_i8.cc", "write_rows.cc",
                 "delta_rule.cc")
]
HEADERS = [os.path.join(HERE, name) for name in ("amx.h", "common.h", "quant.h")]
MATMUL_TARGET = "xlaserve_cpu_matmul"
ATTENTION_TARGET = "xlaserve_cpu_decode_attention"
PREFILL_ATTENTION_TARGET = "xlaserve_cpu_prefill_attention"
SSD_TARGET = "xlaserve_cpu_ssd_decode"
CONV_TARGET = "xlaserve_cpu_conv_decode"
DELTA_TARGET = "xlaserve_cpu_delta_decode"
ARGMAX_TARGET = "xlaserve_cpu_argmax"
LOGSUMEXP_TARGET = "xlaserve_cpu_logsumexp"
SILU_MUL_TARGET = "xlaserve_cpu_silu_mul"
QMATMUL_TARGET = "xlaserve_cpu_qmatmul"
QGEMM_TARGET = "xlaserve_cpu_qgemm"
QMATMUL_I8_TARGET = "xlaserve_cpu_qmatmul_i8"
QGEMM_I8_TARGET = "xlaserve_cpu_qgemm_i8"
QMATMUL_PANELS_TARGET = "xlaserve_cpu_qmatmul_panels"
WRITE_ROWS_TARGET = "xlaserve_cpu_write_rows"
# XLA custom-call target -> the library's FFI handler symbol.
TARGETS = {
    MATMUL_TARGET: "XlaserveCpuMatmul",
    ATTENTION_TARGET: "XlaserveCpuDecodeAttention",
    PREFILL_ATTENTION_TARGET: "XlaserveCpuPrefillAttention",
    SSD_TARGET: "XlaserveCpuSsdDecode",
    CONV_TARGET: "XlaserveCpuConvDecode",
    DELTA_TARGET: "XlaserveCpuDeltaDecode",
    ARGMAX_TARGET: "XlaserveCpuArgmax",
    LOGSUMEXP_TARGET: "XlaserveCpuLogsumexp",
    SILU_MUL_TARGET: "XlaserveCpuSiluMul",
    QMATMUL_TARGET: "XlaserveCpuQmatmul",
    QGEMM_TARGET: "XlaserveCpuQgemm",
    QMATMUL_I8_TARGET: "XlaserveCpuQmatmulI8",
    QGEMM_I8_TARGET: "XlaserveCpuQgemmI8",
    QMATMUL_PANELS_TARGET: "XlaserveCpuQmatmulPanels",
    WRITE_ROWS_TARGET: "XlaserveCpuWriteRows",
}
COMPILE_TIMEOUT_S = 300
# What running without the library costs, for the warnings. The gain grows with the batch and the cores:
# SmolLM2-135M on 2 busy cores, a batch-32 decode step 95 ms native against 213 ms on the references; the
# prefill attention of 16 x 128 tokens after a 1,024-token cached prefix, 63 ms a layer against 629 ms.
FALLBACK_COST = ("their jnp references run instead, decode up to 2-4x and long-context prefill up to 3x "
                 "slower (with a bf16 KV cache, seconds a step: XLA:CPU converts the whole pool for each "
                 "write)")


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """How the native kernels are built and run. The defaults need nobody to configure them; xlaserve's
    server fills these in from its environment variables (serve/native_kernels.py)."""

    compiler: str | None = None  # the C++ compiler; None: the first of c++, g++, clang++ on PATH
    cache_dir: str | None = None  # the library's directory; None: the user cache's xlaserve/cpu_kernels
    disabled: str | None = None  # set: the kernels are off, and this is why (what `build()` reports)
    num_threads: int | None = None  # threads sharing one kernel call, the caller's included; None: every core

    def __post_init__(self):
        for name in ("compiler", "cache_dir", "disabled"):
            if getattr(self, name) == "":
                raise ValueError(f"{name}='' must be None or non-empty")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads} must be >= 1 (or None: every core)")


_config = BuildConfig()
_built_with: BuildConfig | None = None  # what the process's one build read (later `configure` calls: ignored)
# One build per process: the runner precompiles its buckets on several threads, each of which may be first.
_LOCK = threading.RLock()
_reported = False


class Build(NamedTuple):
    path: str | None  # the compiled library; None when the native kernels are off
    reason: str | None  # why they are off, in one line; None when `path` is set


def configure(config: BuildConfig) -> None:
    """Sets how this process builds and runs the native kernels. Only the first build of the process reads
    it (`build`, `available`, `unavailable_reason`, ...): the library is then loaded and its threads started,
    so a later call changes nothing."""
    global _config
    with _LOCK:
        _config = config


def _cache_dir(config: BuildConfig) -> str:
    if config.cache_dir:
        return config.cache_dir
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


def _find_compiler(config: BuildConfig) -> str | None:
    return config.compiler or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _compile(compiler: str, out_path: str) -> str | None:
    """Compiles SOURCES into `out_path`; None on success, else why not (the compiler's output is logged)."""
    cmd = [
        compiler,
        "-O3",
        "-march=native",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fno-math-errno",
        f"-I{jax.ffi.include_dir()}",
        *SOURCES,
        "-o",
        out_path,
    ]
    try:
        result = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except OSError as e:
        return f"cannot run the C++ compiler {compiler!r} ({e.strerror or e})"
    except subprocess.TimeoutExpired:
        return f"{compiler} took over {COMPILE_TIMEOUT_S} s to compile them"
    if result.returncode != 0:
        # The one-line reason cannot carry the compiler's errors: they go to the log once, here.
        logger.warning("%s failed (exit %d):\n%s", " ".join(cmd), result.returncode, result.stderr[-4000:])
        return f"{compiler} failed to compile them (exit {result.returncode}; its errors are logged above)"
    return None


@functools.cache
def _build_once() -> Build:
    global _built_with
    config = _built_with = _config
    if config.disabled:
        return Build(None, config.disabled)
    digest = hashlib.sha256(_cpu_signature().encode())
    for source in SOURCES + HEADERS:
        try:
            with open(source, "rb") as f:
                digest.update(f.read())
        except OSError as e:
            # A wheel built without the sources (only package data ships them): the install is broken.
            return Build(None, f"their source {source} cannot be read ({e.strerror}); reinstall xlaserve")
    path = os.path.join(_cache_dir(config), f"kernels-{digest.hexdigest()[:16]}.so")
    if os.path.exists(path):
        return Build(path, None)
    compiler = _find_compiler(config)
    if compiler is None:
        return Build(None, "no C++ compiler configured or found on PATH (c++, g++, clang++); install g++ or "
                           "clang++")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    except OSError as e:
        return Build(None, f"cannot write to the kernel cache {os.path.dirname(path)} ({e.strerror or e})")
    os.close(fd)
    logger.info("compiling the native CPU kernels with %s into %s", compiler, path)
    try:
        why = _compile(compiler, tmp)
        if why is None:
            os.replace(tmp, path)  # atomic: concurrent builders (processes) each write their own file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return Build(None, why) if why else Build(path, None)


def build() -> Build:
    """The compiled library, compiling it into the configured cache directory on the process's first call
    (later calls return the same result). Never raises for a missing compiler or a failed compile: `reason`
    says why."""
    with _LOCK:
        return _build_once()


def library_path() -> str | None:
    """The compiled kernel library (building it if needed), or None when native kernels are unavailable."""
    return build().path


def unavailable_reason() -> str | None:
    """None when the native kernels can run (building them if needed); else why not, in one line. The caller
    takes over reporting it: `available()` then logs no warning of its own."""
    global _reported
    with _LOCK:
        reason = build().reason
        _reported = _reported or reason is not None
        return reason


_library: ctypes.CDLL | None = None  # the loaded kernel library (`_register`)


@functools.cache
def _register() -> bool:
    path = build().path
    if path is None:
        if not _reported:
            logger.warning("native CPU kernels off: %s; %s", build().reason, FALLBACK_COST)
        return False
    global _library
    lib = _library = ctypes.cdll.LoadLibrary(path)
    lib.XlaserveCpuSharedAttentionTokens.restype = ctypes.c_int64
    if _built_with.num_threads is not None:  # before any kernel runs: its helper threads start on first use
        lib.XlaserveCpuSetThreads(ctypes.c_int(_built_with.num_threads))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    status = lib.XlaserveCpuAmxStatus()
    if status == 0:
        logger.info("native CPU kernels: AMX tiles on (bf16 products of 16 rows and more)")
    else:
        logger.info("native CPU kernels: AMX off (%s); AVX-512 runs its products",
                    AMX_OFF.get(status, f"status {status}"))
    return True


# XlaserveCpuAmxStatus (kernels/cpu/amx.h AmxStatus) -> why AMX is off.
AMX_OFF = {
    1: "the compiler did not target it: this CPU has no amx_tile / amx_bf16, or the host is not Linux",
    2: "the kernel refused the tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16+ grants it)",
    3: "turned off (use_amx(False))",
}


def amx_reason() -> str | None:
    """None when the kernels multiply on AMX tiles; else why not (also when the library is off)."""
    if not available():
        return "the native kernels are off"
    status = _library.XlaserveCpuAmxStatus()
    return None if status == 0 else AMX_OFF.get(status, f"status {status}")


def vector_registers() -> int:
    """How many 16-lane vectors the library's register tiles count on (32 with AVX-512, 8 with AVX2 as two
    halves; 0 when the library is off)."""
    return int(_library.XlaserveCpuVectorRegisters()) if available() else 0


def has_int8_activations() -> bool:
    """Whether the library has the int8-activation kernels (qmatmul_i8.cc for few rows, qgemm_i8.cc for many;
    built for CPUs with AVX512-VNNI, or in their vpmaddubsw forms with AVX2)."""
    return available() and _library.XlaserveCpuHasI8() == 1


def panel_width() -> int:
    """Outputs per stored panel of the library's kernel on weights in stored panels (qgemm_i8.cc, int8
    activations; kernels/quant/reference.py `to_panels`): 16 when built with the int8 GEMM (AVX512-VNNI or
    AVX2), else 0 (none: the weights stay in rows)."""
    return int(_library.XlaserveCpuPanelWidth()) if available() else 0


def shared_attention_tokens() -> int:
    """Key tokens the decode attention kernel read once for several rows sharing their pages (a cached prefix,
    one request's draft rows) instead of once a row, summed over its calls (every layer's) since loading."""
    if not available():
        return 0
    return int(_library.XlaserveCpuSharedAttentionTokens())


def use_shared_attention(on: bool) -> None:
    """Lets the decode attention kernel attend pages shared by several rows once for them all (the default),
    or each row alone (benchmarks compare the two)."""
    if available():
        _library.XlaserveCpuSetSharedAttention(ctypes.c_int(1 if on else 0))


def use_amx(on: bool) -> None:
    """Lets the kernels use AMX where the CPU and kernel allow it (the default), or never (tests compare the
    AVX-512 path with it). Programs already compiled pick it up at their next call."""
    if available():
        _library.XlaserveCpuSetAmx(ctypes.c_int(1 if on else 0))


def available() -> bool:
    """Whether the native kernels are built and registered with XLA (builds and registers them once; logs
    one warning when they are off, unless `unavailable_reason` was asked first)."""
    with _LOCK:
        return _register()
