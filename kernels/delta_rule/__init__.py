"""Chunked gated delta rule (Gated DeltaNet) with per-slot state: prefill blocks and decode steps."""

from kernels.delta_rule.reference import gated_delta_decode, gated_delta_prefill

__all__ = ["gated_delta_decode", "gated_delta_prefill"]
