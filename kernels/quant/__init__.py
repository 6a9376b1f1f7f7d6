"""Grouped 4- and 8-bit weights (kernels/quant/reference.py has the layout): `qmatmul` dispatched to the
native CPU kernel where one applies (int8 / 4-bit values; fp8 values take the reference)."""

from kernels import backend
from kernels.quant.reference import (
    GROUP,
    dequantize,
    embed_rows,
    qmatmul_reference,
    quantize,
    quantize_activations,
)

qmatmul = backend.dispatched("qmatmul", qmatmul_reference)

__all__ = ["GROUP", "dequantize", "embed_rows", "qmatmul", "quantize", "quantize_activations"]
