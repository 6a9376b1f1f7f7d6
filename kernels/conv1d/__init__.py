"""Depthwise causal conv1d with per-slot conv state (the short conv in front of Mamba and GLA mixers)."""

from kernels import backend
from kernels.conv1d import reference
from kernels.conv1d.reference import causal_conv1d_decode, causal_conv1d_prefill

conv1d_decode_update = backend.dispatched("conv1d_decode_update", reference.conv1d_decode_update)

__all__ = ["causal_conv1d_decode", "causal_conv1d_prefill", "conv1d_decode_update"]
