"""HF `architectures` name -> our model class, imported lazily."""

from __future__ import annotations

import importlib

# name -> (module, class). Each class provides `__init__(cfg, *, dtype)`,
# `__call__(batch: ForwardBatch, pools: MemoryPools) -> (hidden, pools)` and `logits(hidden)`; its module
# provides `config_from_hf(hf) -> cfg` and `params_from_hf(cfg, get)`, the HF name map. A cfg has at least
# `architecture`, `vocab_size`, `max_position_embeddings`, `eos_token_ids`, `tie_word_embeddings`,
# `num_params` and `cache_spec` (a memory.CacheSpec: which pools the model needs).
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "Mamba2ForCausalLM": ("models.mamba2", "Mamba2ForCausalLM"),
    "MambaForCausalLM": ("models.mamba", "MambaForCausalLM"),
    "FalconMambaForCausalLM": ("models.mamba", "MambaForCausalLM"),
    "NemotronHForCausalLM": ("models.nemotron_h", "NemotronHForCausalLM"),
    "BambaForCausalLM": ("models.bamba", "BambaForCausalLM"),
    "FalconH1ForCausalLM": ("models.falcon_h1", "FalconH1ForCausalLM"),
    "MixtralForCausalLM": ("models.moe", "MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("models.moe", "MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("models.moe", "MoeForCausalLM"),
    "MiniMaxForCausalLM": ("models.minimax", "MiniMaxForCausalLM"),
    "JambaForCausalLM": ("models.jamba", "JambaForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("models.granite_moe_hybrid", "GraniteMoeHybridForCausalLM"),
    "BailingMoeV2_5ForCausalLM": ("models.bailing_moe_v2_5", "BailingMoeV2_5ForCausalLM"),
    "Qwen3NextForCausalLM": ("models.qwen3_next", "Qwen3NextForCausalLM"),
    "KimiLinearForCausalLM": ("models.kimi_linear", "KimiLinearForCausalLM"),
    "BailingHybridForCausalLM": ("models.kimi_linear", "KimiLinearForCausalLM"),
    "Qwen3_5ForCausalLM": ("models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("models.qwen3_next", "Qwen3NextForCausalLM"),
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
