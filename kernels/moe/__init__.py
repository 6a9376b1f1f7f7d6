"""Dropless top-k mixture-of-experts feed-forward (router scores, grouped expert matmuls, combine)."""

from kernels.moe.reference import experts_ffn, moe_ffn, route

__all__ = ["experts_ffn", "moe_ffn", "route"]
