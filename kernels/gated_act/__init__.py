"""The gated activation between a gated MLP's fused gate|up projection and its down projection."""

from kernels import backend
from kernels.gated_act import reference

silu_mul = backend.dispatched("silu_mul", reference.silu_mul)

__all__ = ["silu_mul"]
