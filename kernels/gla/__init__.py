"""Chunked Lightning / simple-GLA linear attention with per-slot state: prefill blocks and decode steps."""

from kernels.gla.reference import gla_decode, gla_prefill

__all__ = ["gla_decode", "gla_prefill"]
