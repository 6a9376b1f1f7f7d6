"""HF `architectures` name -> our model class, imported lazily."""

from __future__ import annotations

import importlib

# name -> (module, class). Each class provides `__init__(cfg, *, dtype)`, `__call__(batch, kv)`,
# `logits(hidden)`, and its module a `params_from_hf(cfg, get)` name map.
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("models.llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_module(architecture: str):
    """The module implementing `architecture`; ValueError naming the supported ones if unknown."""
    if architecture not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    return importlib.import_module(_ARCHITECTURES[architecture][0])


def model_class(architecture: str):
    module = model_module(architecture)
    return getattr(module, _ARCHITECTURES[architecture][1])
