"""NumPy decoders for the GGML block formats that GGUF files store tensors in."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

# Numbering of `enum ggml_type` in ggml.h; names are only for error messages.
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip

QK_K = 256  # elements in one "K-quant" super-block

# Value of the low and the high nibble of every byte: a gather through these tables replaces the
# shift/mask/convert sequence and is several times faster on large tensors.
_LOW_NIBBLE = (np.arange(256) & 0x0F).astype(np.float32)  # f32[256]
_HIGH_NIBBLE = (np.arange(256) >> 4).astype(np.float32)  # f32[256]


def _f16(columns: np.ndarray) -> np.ndarray:
    """Two little-endian bytes per block -> f32[num_blocks, 1]."""
    return np.ascontiguousarray(columns).view(np.float16).astype(np.float32)


def _nibbles_halves(qs: np.ndarray) -> np.ndarray:
    """u8[..., k] -> f32[..., 2k]: the k low nibbles, then the k high nibbles (ggml's order)."""
    out = np.empty((*qs.shape[:-1], 2, qs.shape[-1]), np.float32)
    out[..., 0, :] = _LOW_NIBBLE[qs]
    out[..., 1, :] = _HIGH_NIBBLE[qs]
    return out.reshape(*qs.shape[:-1], 2 * qs.shape[-1])


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f4").astype(np.float32)


def _f16_plain(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32, so widening is a shift of the bit pattern.
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _q8_0(blocks: np.ndarray) -> np.ndarray:  # u8[n, 34]: f16 d, i8 qs[32]
    d = _f16(blocks[:, :2])
    return blocks[:, 2:].view(np.int8).astype(np.float32) * d


def _q4_0(blocks: np.ndarray) -> np.ndarray:  # u8[n, 18]: f16 d, u8 qs[16]
    d = _f16(blocks[:, :2])
    q = _nibbles_halves(blocks[:, 2:])
    q -= 8
    q *= d
    return q


def _q4_1(blocks: np.ndarray) -> np.ndarray:  # u8[n, 20]: f16 d, f16 m, u8 qs[16]
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles_halves(blocks[:, 4:])
    q *= d
    q += m
    return q


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """u8[n, 12] of packed 6-bit values -> (scale, min), each u8[n, 8] (ggml's get_scale_min_k4)."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def _q4_k(blocks: np.ndarray) -> np.ndarray:  # u8[n, 144]: f16 d, f16 dmin, u8 scales[12], u8 qs[128]
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _q4_k_scales(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32))[:, :, None]  # f32[n, 8, 1]
    offset = (dmin * mn.astype(np.float32))[:, :, None]
    # 32 bytes hold 64 values: low nibbles use sub-block 2j, high nibbles sub-block 2j + 1.
    q = _nibbles_halves(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32)
    q *= scale
    q -= offset
    return q.reshape(n, QK_K)


# Bit offset in qh of each group of 32 outputs within a 128-value half of a Q6_K block.
_Q6_K_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]


def _q6_k(blocks: np.ndarray) -> np.ndarray:  # u8[n, 210]: u8 ql[128], u8 qh[64], i8 scales[16], f16 d
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 2, 32)  # [half, l or l+32, l]
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    # Output order within a half is (nibble, ql part): l, l+32 from low nibbles, l+64, l+96 from high.
    low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    high = (qh >> _Q6_K_SHIFTS) & 0x03
    q = (low | (high << 4)).view(np.int8) - np.int8(32)
    scale = (d * scales)[:, :, None]  # f32[n, 16, 1]
    return (scale * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


class _Format(NamedTuple):
    block_elements: int
    block_bytes: int
    decode: Callable[
        [np.ndarray], np.ndarray
    ]  # u8[num_blocks, block_bytes] -> f32[num_blocks, block_elements]


_FORMATS = {
    0: _Format(1, 4, _f32),
    1: _Format(1, 2, _f16_plain),
    30: _Format(1, 2, _bf16),
    8: _Format(32, 34, _q8_0),
    2: _Format(32, 18, _q4_0),
    3: _Format(32, 20, _q4_1),
    12: _Format(QK_K, 144, _q4_k),
    14: _Format(QK_K, 210, _q6_k),
}

SUPPORTED_TYPES = tuple(GGML_TYPE_NAMES[t] for t in _FORMATS)


def type_name(ggml_type: int) -> str:
    return GGML_TYPE_NAMES.get(ggml_type, f"unknown type {ggml_type}")


def is_supported(ggml_type: int) -> bool:
    return ggml_type in _FORMATS


def tensor_nbytes(ggml_type: int, num_elements: int) -> int:
    """Bytes that `num_elements` values of `ggml_type` occupy; raises ValueError for unsupported types."""
    fmt = _format(ggml_type)
    if num_elements % fmt.block_elements:
        raise ValueError(
            f"{num_elements=} is not a multiple of the {type_name(ggml_type)} block size {fmt.block_elements}"
        )
    return num_elements // fmt.block_elements * fmt.block_bytes


def dequantize(raw: np.ndarray, ggml_type: int, num_elements: int) -> np.ndarray:
    """Decode `raw` (u8[tensor_nbytes]) into f32[num_elements], in the order ggml stores the values.

    The result never aliases `raw`. Raises ValueError for unsupported types or a wrong byte count.
    """
    fmt = _format(ggml_type)
    expected = tensor_nbytes(ggml_type, num_elements)
    if raw.dtype != np.uint8 or raw.size != expected:
        raise ValueError(
            f"{type_name(ggml_type)} data for {num_elements} values needs {expected} bytes, "
            f"got {raw.size} of dtype {raw.dtype}"
        )
    raw = raw.reshape(-1)
    if fmt.block_elements == 1:
        return fmt.decode(raw).reshape(num_elements)
    return fmt.decode(raw.reshape(-1, fmt.block_bytes)).reshape(num_elements)


def _format(ggml_type: int) -> _Format:
    if ggml_type not in _FORMATS:
        raise ValueError(f"cannot dequantize GGML type {type_name(ggml_type)}; supported: {SUPPORTED_TYPES}")
    return _FORMATS[ggml_type]
