"""Dropless top-k mixture-of-experts feed-forward (router scores, grouped expert matmuls, combine)."""

import functools

from kernels import backend
from kernels.moe import reference
from kernels.moe.reference import route

experts_ffn = backend.dispatched("experts_ffn", reference.experts_ffn)
moe_ffn = functools.partial(reference.moe_ffn, experts_impl=experts_ffn)

__all__ = ["experts_ffn", "moe_ffn", "route"]
