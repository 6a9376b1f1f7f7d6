"""Chunked Lightning / simple-GLA linear attention with per-slot state: prefill blocks and decode steps."""

from kernels import backend
from kernels.gla import reference
from kernels.gla.reference import gla_decode

gla_prefill = backend.dispatched("gla_prefill", reference.gla_prefill)

__all__ = ["gla_decode", "gla_prefill"]
