"""Memory-mapped safetensors: each tensor is a `Source` whose regions are read only when asked for.

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}
and the raw little-endian data; a memory map of the file makes a slice of a tensor cost only its bytes.
"""

from __future__ import annotations

import glob
import json
import os
import struct

import ml_dtypes
import numpy as np

from models.weights.lazy import Source

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors_file(file: str) -> dict[str, Source]:
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data = np.memmap(file, dtype=np.uint8, mode="r") if os.path.getsize(file) > 8 + header_len else None
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {info['dtype']}, which the loader cannot read"
            )
        begin, end = (8 + header_len + o for o in info["data_offsets"])
        dtype = np.dtype(DTYPES[info["dtype"]])
        raw = data[begin:end] if data is not None else np.zeros(0, np.uint8)
        tensors[name] = Source(raw.view(dtype).reshape(info["shape"]), name)
    return tensors


def read_safetensors_dir(path: str) -> dict[str, Source]:
    """Every tensor of every *.safetensors file in `path` (sharded checkpoints included)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors = {}
    for file in files:
        tensors.update(read_safetensors_file(file))
    return tensors
