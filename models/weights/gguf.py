"""Read a GGUF file into a Hugging Face style config and float32 parameters named as in transformers."""

from __future__ import annotations

import mmap
import re
import struct
from typing import Any, NamedTuple

import numpy as np

from models.weights import gguf_quants
from models.weights.lazy import STATS, LazyArray

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format of one scalar (8 = string, 9 = array are handled apart).
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6

# general.architecture -> (HF model_type, HF architecture class)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

# llama.cpp tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFTensorInfo(NamedTuple):
    name: str  # llama.cpp name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # numpy order: GGUF lists dims fastest-first, so this is its list reversed
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file


class GGUFCheckpoint(NamedTuple):
    config: dict[str, Any]  # a transformers config.json dict
    tensors: dict[str, np.ndarray]  # HF parameter name -> f32 array (or LazyArray) with the HF shape


class _Cursor:
    """Sequential little-endian reads over the mapped file."""

    def __init__(self, buf: mmap.mmap, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def advance(self, size: int) -> int:
        """Position of the next `size` bytes, which are then consumed."""
        if self.pos + size > len(self.buf):
            raise ValueError(
                f"{self.path}: GGUF header is truncated or corrupt (reading past byte {self.pos})"
            )
        self.pos += size
        return self.pos - size

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.advance(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        size = self.scalar("<Q")
        start = self.advance(size)
        return self.buf[start : start + size].decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            return self.array()
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"{self.path}: unknown GGUF metadata value type {value_type} at byte {self.pos}")
        value = self.scalar(_SCALAR_FORMATS[value_type])
        # Shortest repr of the f32, so an epsilon stored as f32 reads back as 1e-05, not 9.99999974e-06.
        return float(str(np.float32(value))) if value_type == _FLOAT32 else value

    def array(self) -> list[Any]:
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        if item_type in _SCALAR_FORMATS:
            dtype = np.dtype(_SCALAR_FORMATS[item_type])
            items = np.frombuffer(
                self.buf, dtype=dtype, count=count, offset=self.advance(count * dtype.itemsize)
            )
            if item_type == _FLOAT32:
                return [float(str(v)) for v in items]
            return items.tolist()
        return [self.value(item_type) for _ in range(count)]


def _parse(path: str) -> tuple[dict[str, Any], list[GGUFTensorInfo], mmap.mmap]:
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {buf[:4]!r}, expected {_MAGIC!r})")
    cur = _Cursor(buf, path)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF {version=} is not supported (2 and 3 are; big-endian files are not)")
    num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    raw_infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        raw_infos.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    data_start = -(-cur.pos // alignment) * alignment
    infos = [GGUFTensorInfo(name, shape, t, data_start + off) for name, shape, t, off in raw_infos]
    return metadata, infos, buf


def gguf_metadata(path: str) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as plain Python values (arrays become lists).

    Reads the header only. Raises ValueError if `path` is not a GGUF v2/v3 file.
    """
    metadata, _, _ = _parse(path)
    return metadata


def read_tensor(buf: mmap.mmap | bytes, info: GGUFTensorInfo) -> np.ndarray:
    """Dequantize one tensor to f32 with its numpy shape; raises ValueError naming unsupported types."""
    return np.asarray(GGUFTensor(buf, info))


class GGUFTensor(LazyArray):
    """One tensor of the file, dequantized to f32 row by row when a region is read (quantization blocks
    run along the last axis, so a row is self-contained)."""

    def __init__(self, buf: mmap.mmap | bytes, info: GGUFTensorInfo):
        self.buf, self.info, self.name = buf, info, info.name
        self.shape, self.dtype = tuple(info.shape), np.dtype(np.float32)
        if not gguf_quants.is_supported(info.ggml_type):
            raise ValueError(
                f"tensor {info.name!r} has GGML type {gguf_quants.type_name(info.ggml_type)}, "
                f"which cannot be dequantized; supported: {gguf_quants.SUPPORTED_TYPES}"
            )
        num_elements = int(np.prod(info.shape))
        nbytes = gguf_quants.tensor_nbytes(info.ggml_type, num_elements)
        if info.offset + nbytes > len(buf):
            raise ValueError(f"tensor {info.name!r} runs past the end of the file (truncated download?)")
        self.row = self.shape[-1] if self.shape else 1
        self.row_bytes = gguf_quants.tensor_nbytes(info.ggml_type, self.row)

    def _read(self, sel) -> np.ndarray:
        lead = self.shape[:-1]
        rows = np.ravel_multi_index(np.ix_(*sel[:-1]), lead) if lead else np.zeros((), np.int64)
        if rows.size == 0 or (self.shape and len(sel[-1]) == 0):
            return np.zeros(tuple(len(s) for s in sel), np.float32)
        lo, hi = int(rows.min()), int(rows.max()) + 1  # dequantize the covering run of rows
        raw = np.frombuffer(
            self.buf, dtype=np.uint8, count=(hi - lo) * self.row_bytes,
            offset=self.info.offset + lo * self.row_bytes,
        )
        block = gguf_quants.dequantize(raw, self.info.ggml_type, (hi - lo) * self.row)
        block = block.reshape(hi - lo, self.row)
        out = block[rows - lo]
        out = np.take(out, sel[-1], axis=-1) if self.shape else out.reshape(())
        STATS.reads.append((self.name, out.nbytes, self.nbytes))
        return np.ascontiguousarray(out)


def read_gguf(path: str, lazy: bool = False) -> GGUFCheckpoint:
    """Config and all parameters of a llama / qwen2 / qwen3 GGUF file, as transformers would hold them.

    Linear weights are [out_features, in_features]. For llama files the Q/K row permutation that
    llama.cpp's converter applies is undone. Raises ValueError for other architectures, unknown tensor
    names and unsupported tensor types. `lazy`: the tensors are `LazyArray`s (models/weights/lazy.py),
    dequantized region by region when read, instead of f32 arrays.
    """
    metadata, infos, buf = _parse(path)
    config = _hf_config(path, metadata, infos)
    arch = metadata["general.architecture"]
    tensors = {}
    for info in infos:
        if info.name == "rope_freqs.weight":
            # Llama 3.1 style rope scaling is stored only as these per-frequency factors; all ones is a no-op.
            if not np.all(read_tensor(buf, info) == 1.0):
                raise ValueError(f"{path}: rope_freqs (Llama 3.1 rope scaling) is not supported yet")
            continue
        hf_name = _hf_name(info.name)
        if hf_name is None:
            raise ValueError(f"{path}: no Hugging Face name known for GGUF tensor {info.name!r}")
        weight = GGUFTensor(buf, info)
        if arch == "llama" and (".attn_q." in info.name or ".attn_k." in info.name):
            num_heads = config["num_attention_heads" if ".attn_q." in info.name else "num_key_value_heads"]
            weight = _unpermute_rope_rows(weight, num_heads)
        tensors[hf_name] = weight if lazy else np.asarray(weight)
    return GGUFCheckpoint(config=config, tensors=tensors)


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute`, which reorders each head's rows from HF's rotate-half
    layout [x0..x(d/2-1), y0..y(d/2-1)] into ggml's interleaved-pair layout [x0, y0, x1, y1, ...]."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot unpermute {rows} rows into {num_heads} heads of even size")
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str | None:
    if match := _LAYER_TENSOR.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}" if part in _LAYER_NAMES else None
    base, _, kind = gguf_name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{kind}" if base in _GLOBAL_NAMES else None


def read_gguf_config(path: str) -> dict[str, Any]:
    """The config `read_gguf(path)` returns, from the header alone (no tensor is read)."""
    metadata, infos, _ = _parse(path)
    return _hf_config(path, metadata, infos)


def _hf_config(path: str, metadata: dict[str, Any], infos: list[GGUFTensorInfo]) -> dict[str, Any]:
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; known: {sorted(_ARCHITECTURES)}"
        )
    shapes = {info.name: info.shape for info in infos}

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{name}, which the {arch} config needs")
        return value

    model_type, architecture = _ARCHITECTURES[arch]
    hidden, num_heads = key("embedding_length"), key("attention.head_count")
    tokens = metadata.get("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": key("attention.key_length", hidden // num_heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length"),
        "vocab_size": key("vocab_size", len(tokens) if tokens else shapes["token_embd.weight"][0]),
        # llama.cpp writes output.weight only when the head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in shapes,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "mlp_bias": False,
    }
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{gguf_key}" in metadata:
            config[hf_key] = metadata[f"tokenizer.ggml.{gguf_key}"]
    rope_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    if rope_type != "none":
        config["rope_scaling"] = {"rope_type": rope_type, "factor": key("rope.scaling.factor")}
        if f"{arch}.rope.scaling.original_context_length" in metadata:
            original = metadata[f"{arch}.rope.scaling.original_context_length"]
            config["rope_scaling"]["original_max_position_embeddings"] = original
    return config
