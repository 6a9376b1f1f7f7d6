"""Chunked SSD (Mamba-2's state-space duality) scan with per-slot state: prefill blocks and decode steps."""

from kernels import backend
from kernels.ssd import reference
from kernels.ssd.reference import ssd_decode

ssd_prefill = backend.dispatched("ssd_prefill", reference.ssd_prefill)
ssd_decode_update = backend.dispatched("ssd_decode_update", reference.ssd_decode_update)
ssd_decode_rows = backend.dispatched("ssd_decode_rows", reference.ssd_decode_rows)

__all__ = ["ssd_decode", "ssd_decode_rows", "ssd_decode_update", "ssd_prefill"]
