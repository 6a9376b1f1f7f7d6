"""Load a model from a Hugging Face directory (config.json + safetensors) or a GGUF file."""

from __future__ import annotations

import glob
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.quantization import quantize_arrays, quantize_experts
from models.registry import model_class, model_module


def _read_hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _safetensors_getter(path: str) -> Callable[[str], np.ndarray]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    where: dict[str, str] = {}
    for file in files:
        # "flax" reads bfloat16 too (numpy has no native bf16); arrays are converted right away.
        with safe_open(file, framework="flax") as f:
            for name in f.keys():
                where[name] = file
    handles = {file: safe_open(file, framework="flax") for file in files}

    def get(name: str) -> np.ndarray:
        if name not in where:
            raise KeyError(f"tensor {name!r} not found in {path}")
        return np.asarray(handles[where[name]].get_tensor(name), dtype=np.float32)

    return get


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
    return archs[0]


def load_config(path: str):
    """(ModelConfig, raw HF config dict) for an HF directory or a .gguf file."""
    if path.endswith(".gguf"):
        from models.weights.gguf import read_gguf_config

        hf = read_gguf_config(path)
    else:
        hf = _read_hf_config(path)
    return model_module(_architecture(hf)).config_from_hf(hf), hf


def load_model(path: str, dtype=jnp.float32, quantization: str | None = None):
    """Builds the model for `path` with weights cast to `dtype`; returns (ModelConfig, nnx model).

    `quantization` ("int8" | "fp8"): MoE expert weights are stored quantized per output channel
    (models/quantization.py); everything else stays in `dtype`.
    """
    if path.endswith(".gguf"):
        from models.weights.gguf import read_gguf

        ckpt = read_gguf(path)
        hf, tensors = ckpt.config, ckpt.tensors

        def get(name: str) -> np.ndarray:
            if name not in tensors:
                raise KeyError(f"tensor {name!r} not found in {path}")
            return tensors[name]
    else:
        hf = _read_hf_config(path)
        get = _safetensors_getter(path)
    cls = model_class(_architecture(hf))  # unknown architectures fail here, naming the supported ones
    module = model_module(_architecture(hf))
    cfg = module.config_from_hf(hf)
    arrays = module.params_from_hf(cfg, get)

    def build():
        model = cls(cfg, dtype=dtype)
        return model if quantization is None else quantize_experts(model, quantization)

    abstract = nnx.eval_shape(build)
    if quantization is not None:
        arrays = quantize_arrays(arrays, quantization)
    graphdef, state = nnx.split(abstract)
    flat = []
    expected = set()
    for p, var in nnx.to_flat_state(state):
        expected.add(p)
        if p not in arrays:
            raise KeyError(f"checkpoint {path} gave no value for parameter {'.'.join(p)}")
        value = arrays[p]
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"parameter {'.'.join(p)}: checkpoint shape {value.shape} != model shape {var.shape}")
        flat.append((p, var.replace(jax.device_put(jnp.asarray(value, dtype=var.dtype)))))
    extra = set(arrays) - expected
    if extra:
        raise ValueError(f"unexpected parameters from the name map: {sorted(extra)}")
    return cfg, nnx.merge(graphdef, nnx.from_flat_state(flat))
