"""Depthwise causal conv1d with per-slot conv state (the short conv in front of Mamba and GLA mixers)."""

from kernels.conv1d.reference import causal_conv1d_decode, causal_conv1d_prefill

__all__ = ["causal_conv1d_decode", "causal_conv1d_prefill"]
