"""Which implementation of each device op runs: the plain-jnp reference, the Pallas kernel, or a native CPU
kernel (C++ through XLA's FFI, kernels/cpu).

An op is exported from its package as `dispatched(op, reference_fn)`: a function with the reference's
signature that, when traced, calls the implementation the active `KernelBackends` picks. The runner
traces its step inside `use_kernels(backends)`, so the choice is part of the compiled program and
model code never names a backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterator

import jax

BACKENDS = ("auto", "pallas", "reference")

# op -> (Pallas implementation "module:function", platforms where the kernel runs natively). A Pallas
# function has its reference's signature plus `interpret: bool` (run in the Pallas interpreter on CPU).
# Portable kernels (grid, BlockSpec, pl.dot) also lower through Triton on GPU, but are native on TPU only:
# on an H100 (at 34609c4) the Triton SSD and GLA prefill ran 19x and 10x slower than their references, the
# lowering refuses array sizes that are not powers of two (a 7-token block), and bfloat16 shapes under 16
# came out wrong. `pallas` still runs them there, interpreted. The others use TPU-only features (DMA,
# semaphores, VMEM scratch).
PALLAS_OPS: dict[str, tuple[str, frozenset[str]]] = {
    "ssd_prefill": ("kernels.ssd.pallas:ssd_prefill", frozenset({"tpu"})),
    "ssd_decode_rows": ("kernels.ssd.pallas:ssd_decode_rows", frozenset({"tpu"})),
    "gla_prefill": ("kernels.gla.pallas:gla_prefill", frozenset({"tpu"})),
    "gated_delta_prefill": ("kernels.delta_rule.pallas:gated_delta_prefill", frozenset({"tpu"})),
    "kda_prefill": ("kernels.delta_rule.pallas:kda_prefill", frozenset({"tpu"})),
    "gated_delta_decode_rows": ("kernels.delta_rule.pallas_rows:gated_delta_decode_rows", frozenset({"tpu"})),
    "kda_decode_rows": ("kernels.delta_rule.pallas_rows:kda_decode_rows", frozenset({"tpu"})),
    "experts_ffn": ("kernels.moe.pallas:experts_ffn", frozenset({"tpu"})),
    "paged_attention": ("kernels.paged_attention.pallas:paged_attention", frozenset({"tpu"})),
    "write_kv": ("kernels.paged_attention.pallas:write_kv", frozenset({"tpu"})),
}

# op -> native CPU kernel "module:function" (kernels/cpu), with its reference's signature plus `interpret`
# (ignored). `auto` and `pallas` run it on the CPU backend, `reference` never; other platforms never.
CPU_OPS: dict[str, str] = {
    "matmul": "kernels.cpu:matmul_native",
    "decode_attention": "kernels.cpu:decode_attention_native",
    "prefill_attention": "kernels.cpu:prefill_attention_native",
    "ssd_decode_update": "kernels.cpu:ssd_decode_update_native",
    "conv1d_decode_update": "kernels.cpu:conv1d_decode_update_native",
    "gated_delta_decode_update": "kernels.cpu:gated_delta_decode_update_native",
    "kda_decode_update": "kernels.cpu:kda_decode_update_native",
    "argmax": "kernels.cpu:argmax_first_native",
    "logsumexp": "kernels.cpu:logsumexp_native",
    "silu_mul": "kernels.cpu:silu_mul_native",
    "qmatmul": "kernels.cpu:qmatmul_native",
    "write_rows": "kernels.cpu:write_rows_native",
}


@dataclasses.dataclass(frozen=True)
class KernelBackends:
    """`default` for every op, `overrides` per op; each one of BACKENDS.

    `auto`: the Pallas kernel where it runs natively, the reference elsewhere. `pallas`: the kernel
    everywhere, interpreted where it is not native (CPU; slow, for tests). `reference`: plain jnp.
    """

    default: str = "auto"
    overrides: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for op, choice in (("default", self.default), *self.overrides):
            if choice not in BACKENDS:
                raise ValueError(f"kernel backend {choice!r} for {op} must be one of {', '.join(BACKENDS)}")
            if op != "default" and op not in PALLAS_OPS and op not in CPU_OPS:
                raise ValueError(f"unknown kernel op {op!r}; "
                                 f"ops with a kernel: {', '.join([*PALLAS_OPS, *CPU_OPS])}")

    @classmethod
    def parse(cls, spec: str) -> KernelBackends:
        """`"pallas"`, `"auto,experts_ffn=reference"`: a default, then `op=backend` overrides."""
        default, overrides = "auto", []
        for item in filter(None, (part.strip() for part in spec.split(","))):
            if "=" in item:
                op, choice = (s.strip() for s in item.split("=", 1))
                overrides.append((op, choice))
            else:
                default = item
        return cls(default, tuple(overrides))

    def choice(self, op: str, platform: str | None = None) -> tuple[str, bool]:
        """("pallas" | "native" | "reference", interpret) for `op` on `platform` (default: JAX's default
        backend)."""
        choice = dict(self.overrides).get(op, self.default)
        if op in CPU_OPS:
            on_cpu = (platform or jax.default_backend()) == "cpu"
            return ("native", False) if on_cpu and choice != "reference" else ("reference", False)
        if op not in PALLAS_OPS or choice == "reference":
            return "reference", False
        native = (platform or jax.default_backend()) in PALLAS_OPS[op][1]
        if choice == "auto":
            return ("pallas", False) if native else ("reference", False)
        return "pallas", not native

    def stored_panels(self, platform: str | None = None) -> bool:
        """Whether grouped weights multiplied on int8 activations should be laid out in stored panels
        (kernels/quant/reference.py `to_panels`): `qmatmul` native here and the library has the kernel that
        reads them (kernels/cpu `panel_width()`; built with AVX512-VNNI or AVX2)."""
        if self.choice("qmatmul", platform)[0] != "native":
            return False
        from kernels.cpu import panel_width
        from kernels.quant.reference import PANEL

        return panel_width() == PANEL

    def describe(self, platform: str | None = None) -> str:
        picks = {op: self.choice(op, platform) for op in [*PALLAS_OPS, *CPU_OPS]}
        return ", ".join(f"{op}={kind}{' (interpret)' if interp else ''}"
                         for op, (kind, interp) in picks.items())


_ACTIVE: contextvars.ContextVar[KernelBackends] = contextvars.ContextVar("kernel_backends",
                                                                         default=KernelBackends())


def active() -> KernelBackends:
    """The backends ops traced now use."""
    return _ACTIVE.get()


@contextlib.contextmanager
def use_kernels(backends: KernelBackends) -> Iterator[None]:
    """Ops traced inside this block use `backends`' choices."""
    token = _ACTIVE.set(backends)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@functools.cache
def _load(path: str) -> Callable:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def dispatched(op: str, reference: Callable) -> Callable:
    """`reference` when the active backends pick it for `op`, else the kernel (same arguments)."""

    @functools.wraps(reference)
    def call(*args, **kwargs):
        kind, interpret = _ACTIVE.get().choice(op)
        if kind == "reference":
            return reference(*args, **kwargs)
        path = CPU_OPS[op] if kind == "native" else PALLAS_OPS[op][0]
        return _load(path)(*args, interpret=interpret, **kwargs)

    return call
