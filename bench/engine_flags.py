"""The model, weight and KV-cache flags a benchmark's in-process engines take, spelled as the server's."""

from __future__ import annotations

import argparse
from typing import Any

from models.quantization import ACTIVATION_QUANTIZATION_CHOICES


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="path or alias (default: the server's default model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--quantization", default=None)
    p.add_argument("--activation-quantization", default="none", choices=ACTIVATION_QUANTIZATION_CHOICES)
    p.add_argument("--kv-cache-dtype", default="auto")


def engine_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """`Engine` keyword arguments for the flags `add_engine_flags` added (the model only when given)."""
    out = dict(dtype=a.dtype, quantization=a.quantization, activation_quantization=a.activation_quantization,
               kv_cache_dtype=a.kv_cache_dtype)
    return {**out, "model": a.model} if a.model else out
