"""Measures the achievable memory bandwidth and matmul FLOP/s of this machine with JAX, for utilisation."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MiB = 1 << 20
DTypeLike = Any  # jnp.float32, "bfloat16", np.dtype(...): anything jnp.dtype accepts.

# (m, k, n) of the matmuls reported by `python -m bench.roofline`. The decode and prefill shapes are an
# MLP up-projection of a 576-wide model (SmolLM-135M); the square one is large enough to reach peak.
LLM_MATMUL_SHAPES: dict[str, tuple[int, int, int]] = {
    "peak_square": (2048, 2048, 2048),
    "decode_b32": (32, 576, 1536),
    "prefill_512": (512, 576, 1536),
}


class Roofline(NamedTuple):
    bandwidth_bytes_per_s: float  # XLA streaming read of a buffer much larger than the caches
    matmul_flops_per_s: float  # best sustained jnp.dot of a large square matmul
    device: str  # "<platform>:<device_kind>", e.g. "cpu:cpu" or "gpu:NVIDIA H100 80GB HBM3"
    dtype: str  # e.g. "bfloat16"


def call_seconds(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Sorted wall times of `repeats` calls of `fn()` (each waited for), after one untimed call that compiles
    and warms up. For programs of a millisecond and more, where one call's dispatch is noise."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)


def best_seconds(
    fn: Callable[..., Any], args: tuple[Any, ...], repeats: int, min_batch_s: float = 0.02
) -> float:
    """Best wall time of one call of `fn(*args)`, excluding compilation; `fn` must return fresh arrays."""
    if repeats < 1:
        raise ValueError(f"{repeats=} must be >= 1")
    jax.block_until_ready(fn(*args))  # compiles and warms up; never timed
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    single_s = time.perf_counter() - start
    # Dispatch is asynchronous, so a batch of back-to-back calls hides the per-call host overhead that
    # would otherwise dominate a 100 us kernel on an accelerator; one block_until_ready ends each batch.
    calls = max(1, math.ceil(min_batch_s / max(single_s, 1e-9)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _elements(nbytes: int, dtype: DTypeLike) -> int:
    itemsize = jnp.dtype(dtype).itemsize
    if nbytes <= 0 or nbytes % itemsize:
        raise ValueError(f"{nbytes=} must be a positive multiple of the {itemsize}-byte {jnp.dtype(dtype)}")
    return nbytes // itemsize


def measure_memory_bandwidth(
    nbytes: int = 256 * MiB, dtype: DTypeLike = jnp.float32, repeats: int = 7
) -> float:
    """Best bytes/s of a jitted full reduction that reads an `nbytes` device buffer once.

    A decode step is mostly this: streaming every weight once. The buffer is a jit argument, not a
    constant, and the scalar result depends on every element, so XLA can neither fold nor skip the read.
    Choose `nbytes` well above the last-level cache (and L2 on a GPU) or this measures the cache.
    """
    x = jnp.ones((_elements(nbytes, dtype),), dtype)  # f32-accumulated below, so no overflow to inf
    seconds = best_seconds(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), (x,), repeats)
    del x
    return nbytes / seconds


def measure_numpy_bandwidth(nbytes: int = 256 * MiB, repeats: int = 5) -> tuple[float, float]:
    """Best host bytes/s of numpy `a.sum()` and `np.copyto(b, a)` over float32 buffers of `nbytes`.

    Returns (sum, copy). Float32 whatever dtype the XLA figure used: numpy's bfloat16 (ml_dtypes) is
    emulated and would measure the emulation, not memory. Copy counts read plus write (2 * nbytes);
    write-allocate caches may move a third nbytes unseen, so it understates the hardware's traffic.
    """
    a = np.ones(_elements(nbytes, np.float32), np.float32)
    b = np.empty_like(a)
    best_sum = best_copy = math.inf
    for attempt in range(repeats + 1):  # the first pass faults `b`'s pages in; it is not counted
        start = time.perf_counter()
        a.sum()
        mid = time.perf_counter()
        np.copyto(b, a)
        end = time.perf_counter()
        if attempt > 0:
            best_sum, best_copy = min(best_sum, mid - start), min(best_copy, end - mid)
    return nbytes / best_sum, 2 * nbytes / best_copy


def measure_matmul_flops(
    m: int = 2048, k: int = 2048, n: int = 2048, dtype: DTypeLike = jnp.float32, repeats: int = 5
) -> float:
    """Best sustained FLOP/s (2*m*k*n per call) of a jitted `jnp.dot` of [m, k] by [k, n] in `dtype`.

    The defaults give the peak; pass an LLM shape (see LLM_MATMUL_SHAPES) to see how far below it a
    small-batch decode matmul sits.
    """
    if min(m, k, n) <= 0:
        raise ValueError(f"{(m, k, n)=} must all be positive")
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (m, k), dtype)  # f[m, k]
    b = jax.random.normal(key_b, (k, n), dtype)  # f[k, n]
    seconds = best_seconds(jax.jit(jnp.dot), (a, b), repeats)
    return 2 * m * k * n / seconds


def device_name() -> str:
    device = jax.devices()[0]
    return f"{device.platform}:{device.device_kind}"


def measure_roofline(
    dtype: DTypeLike = jnp.float32,
    nbytes: int = 256 * MiB,
    matmul_shape: tuple[int, int, int] = LLM_MATMUL_SHAPES["peak_square"],
) -> Roofline:
    """Bandwidth and peak matmul throughput of the default backend in `dtype`; about 1 s on a 2-core CPU."""
    return Roofline(
        bandwidth_bytes_per_s=measure_memory_bandwidth(nbytes, dtype),
        matmul_flops_per_s=measure_matmul_flops(*matmul_shape, dtype=dtype),
        device=device_name(),
        dtype=jnp.dtype(dtype).name,
    )


def cost_of(fn: Callable[..., Any], *args: Any) -> dict[str, float | None]:
    """XLA's own estimate for `fn(*args)`: {"flops": ..., "bytes_accessed": ...}, None where unreported.

    `fn` may be jitted or not; it is lowered and compiled for `args` (arrays or jax.ShapeDtypeStruct)
    but never run.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    try:
        analysis = jitted.lower(*args).compile().cost_analysis()
    except Exception:  # some backends and versions do not implement it
        analysis = None
    # jax < 0.4.30 returned a list with one dict per program; newer versions return the dict itself.
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    analysis = analysis if isinstance(analysis, dict) else {}
    flops, nbytes = analysis.get("flops"), analysis.get("bytes accessed")
    return {
        "flops": None if flops is None else float(flops),
        "bytes_accessed": None if nbytes is None else float(nbytes),
    }


def main() -> None:
    start = time.perf_counter()
    print(f"device {device_name()}, jax {jax.__version__}")
    numpy_sum, numpy_copy = measure_numpy_bandwidth()
    print(f"numpy float32 sum {numpy_sum / 1e9:.1f} GB/s, copy (read + write) {numpy_copy / 1e9:.1f} GB/s")
    for dtype in (jnp.float32, jnp.bfloat16):
        roofline = measure_roofline(dtype)
        print(f"{roofline.dtype}: XLA read {roofline.bandwidth_bytes_per_s / 1e9:.1f} GB/s")
        for name, (m, k, n) in LLM_MATMUL_SHAPES.items():
            peak = name == "peak_square"
            flops = roofline.matmul_flops_per_s if peak else measure_matmul_flops(m, k, n, dtype)
            print(f"  matmul {name:12s} {m}x{k}x{n}: {flops / 1e9:.1f} GFLOP/s")
        m, k, n = LLM_MATMUL_SHAPES["decode_b32"]
        shapes = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, n), dtype))
        print(f"  XLA cost_analysis of decode_b32 dot: {cost_of(jnp.dot, *shapes)}")
    print(f"took {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
