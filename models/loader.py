"""Load a model from a Hugging Face directory (config.json + safetensors) or a GGUF file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers.stack import resolve_layer_weights, stack_layers
from models.quantization import (
    EXPERT_KINDS,
    linear_bits,
    linear_signatures,
    quantize_arrays,
    quantize_experts,
    quantize_linear_arrays,
    quantize_linears,
    to_stored_panels,
)
from models.registry import model_class, model_module
from models.weights.lazy import STATS, LazyArray, lazy
from models.weights.safetensors import read_safetensors_dir

# Where a parameter goes: (param path, shape) -> its sharding, or None for the default device.
ShardingFn = Callable[[tuple[str, ...], tuple[int, ...]], jax.sharding.Sharding | None]


def _read_hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _getter(tensors: dict, path: str) -> Callable[[str], LazyArray]:
    def get(name: str) -> LazyArray:
        if name not in tensors:
            raise KeyError(f"tensor {name!r} not found in {path}")
        return lazy(tensors[name], name)

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


def load_model(
    path: str, dtype=jnp.float32, quantization: str | None = None, sharding: ShardingFn | None = None,
    layer_weights: str = "auto", activation_quantization: str = "none", stored_panels: bool = False,
):
    """Builds the model for `path` with weights cast to `dtype`; returns (ModelConfig, nnx model).

    `quantization` (models/quantization.py): "int4" / "int8" / "fp8" store every Linear layer (input size
    a multiple of 32), the embedding and the LM head in the grouped layout of kernels/quant (fp8: the 8-bit
    one with e4m3 values); "auto" does so where a GGUF file's own blocks are that layout (Q4_1: 4 bits,
    Q8_0: 8 bits), with the same numbers; "int8" / "fp8" also store MoE expert weights per output channel
    in their format, "int4" in int8 (models/quantization.py `EXPERT_KINDS`). Everything else stays in
    `dtype`. `activation_quantization`: those grouped weights' products round their inputs, "int8": to int8
    per group of 32 (kernels/quant/reference.py `quantize_activations`); "bf16": to bf16, the weights too, as
    a bfloat16 model's products (the rest of the model stays in `dtype`).
    `sharding`: each parameter is placed with the sharding it gives, every device's shard read from the
    checkpoint on its own (models/weights/lazy.py): no host materialises a whole sharded tensor, and with
    several processes each reads only the shards of its own devices.
    `layer_weights` ("auto" | "stacked" | "per_layer"): how decoders built with `layer_stack` keep their
    layers' weights (models/layers/stack.py:`resolve_layer_weights`).
    `stored_panels` (kernels/backend.py `KernelBackends.stored_panels`): the Linear layers' grouped weights
    under int8 activations laid out for the native CPU kernel (models/quantization.py `to_stored_panels`);
    only without `sharding`.
    """
    if path.endswith(".gguf"):
        from models.weights.gguf import read_gguf

        ckpt = read_gguf(path, lazy=True)
        hf, tensors = ckpt.config, ckpt.tensors
    else:
        hf, tensors = _read_hf_config(path), read_safetensors_dir(path)
    STATS.checkpoint_bytes = sum(lazy(t).nbytes for t in tensors.values())
    get = _getter(tensors, path)
    cls = model_class(_architecture(hf))  # unknown architectures fail here, naming the supported ones
    module = model_module(_architecture(hf))
    cfg = module.config_from_hf(hf)
    arrays = module.params_from_hf(cfg, get)  # lazy expressions: nothing is read yet

    stacked = resolve_layer_weights(layer_weights) == "stacked"

    fp8 = quantization == "fp8"  # the grouped 8-bit layout with e4m3 values

    def build(bits=None):
        model = cls(cfg, dtype=dtype)
        if stacked:
            model = stack_layers(model)
        if bits:
            model = quantize_linears(model, bits, fp8, activations=activation_quantization)
        experts = quantization in EXPERT_KINDS and _has_experts(model)
        return quantize_experts(model, EXPERT_KINDS[quantization]) if experts else model

    bits = {}
    if quantization not in (None, "none"):
        bits = linear_bits(quantization, arrays, linear_signatures(nnx.eval_shape(build)))
    abstract = nnx.eval_shape(lambda: build(bits))
    if bits:
        arrays = quantize_linear_arrays(arrays, bits, fp8)
    if quantization in EXPERT_KINDS and _has_experts(abstract):
        arrays = quantize_arrays(arrays, EXPERT_KINDS[quantization])
    graphdef, state = nnx.split(abstract)
    flat = []
    expected = set()
    arrays = _stack_layers(arrays, [p for p, _ in nnx.to_flat_state(state)])
    for p, var in nnx.to_flat_state(state):
        expected.add(p)
        if p not in arrays:
            raise KeyError(f"checkpoint {path} gave no value for parameter {'.'.join(p)}")
        value = lazy(arrays[p])
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(
                f"parameter {'.'.join(p)}: checkpoint shape {value.shape} != model shape {var.shape}"
            )
        where = sharding(tuple(str(k) for k in p), tuple(var.shape)) if sharding else None
        flat.append((p, var.replace(_place(value, var.dtype, where, ".".join(map(str, p))))))
    extra = set(arrays) - expected
    if extra:
        raise ValueError(f"unexpected parameters from the name map: {sorted(extra)}")
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if stored_panels and sharding is None and activation_quantization == "int8" and bits:
        model = to_stored_panels(model)
    return cfg, model


def _has_experts(model) -> bool:
    from models.layers.moe import Experts

    return any(isinstance(m, Experts) for _, m in nnx.iter_modules(model))


def _stack_layers(arrays: dict[tuple, LazyArray], expected: list[tuple]) -> dict[tuple, LazyArray]:
    """Name maps give layer i's parameters under (..., i, ...) (models/layers/stack.py); a model
    whose layers are stacked on a leading axis gets them stacked here (lazily: nothing is read)."""
    out = dict(arrays)
    for p in expected:
        if p in out:
            continue
        for k in range(len(p)):
            if p[:k] + (0,) + p[k:] in out:
                count = 0
                while p[:k] + (count,) + p[k:] in out:
                    count += 1
                out[p] = np.stack([out.pop(p[:k] + (i,) + p[k:]) for i in range(count)])
                break
    return out


def _place(value: LazyArray, dtype, sharding: jax.sharding.Sharding | None, name: str) -> jax.Array:
    """`value` cast to `dtype` on the default device, or laid out per `sharding` with each of this
    process's shards read separately (devices holding the same shard share one read; `STATS.shards`
    records what each read cost)."""
    if sharding is None:
        return jax.device_put(np.asarray(value).astype(dtype, copy=False))
    shards: dict[tuple, np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in shards:
            first = len(STATS.reads)
            read = np.asarray(value[index])
            STATS.shards.append((name, key, read.nbytes, sum(n for _, n, _ in STATS.reads[first:])))
            shards[key] = read.astype(dtype, copy=False)
        return shards[key]

    return jax.make_array_from_callback(tuple(value.shape), sharding, shard)
