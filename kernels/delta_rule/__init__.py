"""Chunked gated delta rule (Gated DeltaNet) with per-slot state: prefill blocks and decode steps; and its
per-key-channel-decay form, Kimi Delta Attention (KDA)."""

from kernels import backend
from kernels.delta_rule import reference
from kernels.delta_rule.reference import gated_delta_decode, kda_decode

gated_delta_prefill = backend.dispatched("gated_delta_prefill", reference.gated_delta_prefill)
kda_prefill = backend.dispatched("kda_prefill", reference.kda_prefill)
gated_delta_decode_update = backend.dispatched("gated_delta_decode_update",
                                               reference.gated_delta_decode_update)
kda_decode_update = backend.dispatched("kda_decode_update", reference.kda_decode_update)
gated_delta_decode_rows = backend.dispatched("gated_delta_decode_rows", reference.gated_delta_decode_rows)
kda_decode_rows = backend.dispatched("kda_decode_rows", reference.kda_decode_rows)

__all__ = ["gated_delta_decode", "gated_delta_decode_rows", "gated_delta_decode_update",
           "gated_delta_prefill", "kda_decode", "kda_decode_rows", "kda_decode_update", "kda_prefill"]
