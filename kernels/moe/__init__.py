"""Dropless top-k mixture-of-experts feed-forward (router scores, grouped expert matmuls, combine)."""

from kernels.moe.reference import moe_ffn, route

__all__ = ["moe_ffn", "route"]
