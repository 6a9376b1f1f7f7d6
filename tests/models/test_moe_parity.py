"""Our Engine against transformers on tiny random sparse-MoE checkpoints (Qwen3-MoE, Mixtral, Qwen2-MoE)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import transformers

from models.moe import config_from_hf
from tests.helpers import LOGPROB_ATOL, random_prompts
from tests.hf_reference import (
    check_no_near_ties_and_lengths,
    hf_router_scores,
    parity_tests,
    serve_case,
)
from tests.tiny_models import (
    random_hf_model,
    read_checkpoint,
    save_with_word_tokenizer,
    spread_norms_and_biases,
)

VOCAB = 300
NUM_NEW_TOKENS = 32
# One prompt shorter than a page and two chunked ones (32 + 5 and 32 + 32 + 6) crossing pages.
PROMPT_LENS = (5, 37, 70)
# test_hf_parity's settings but two running requests and 32-token chunks: 4 step programs to compile, not 6.
ENGINE_ARGS = dict(
    in_process=True,
    dtype="float32",
    max_running_requests=2,
    chunked_prefill_size=32,
    context_length=256,
    max_total_tokens=2048,
    page_size=16,
)


@dataclasses.dataclass(frozen=True)
class Case:
    model_type: str
    num_layers: int
    overrides: dict[str, Any]
    fused_on_disk: bool  # save transformers 5's in-memory layout (experts.gate_up_proj) instead of the hub's
    # Picked so that no greedy step is a near-tie and no token's k-th and (k+1)-th expert scores are within
    # 1e-4 (a correct fp32 run differs from HF by ~1e-6; a near-tie would test rounding order).
    seed: int


CASES = {
    # Fused experts on disk, q/k norm, biases on q/k/v/o (attention_bias), renormalised top-2 of 8.
    "qwen3_moe": Case(
        "qwen3_moe",
        2,
        dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, attention_bias=True),
        fused_on_disk=True,
        seed=9,
    ),
    # Per-expert hub layout (block_sparse_moe.experts.{j}.w1/w2/w3), top-2 of 4 always renormalised.
    "mixtral": Case(
        "mixtral", 2, dict(num_local_experts=4, intermediate_size=32), fused_on_disk=False, seed=5
    ),
    # Shared expert with its sigmoid gate, qkv bias, raw softmax weights, and a dense first layer (so the
    # layers differ in shape and run unstacked).
    "qwen2_moe_dense_layer": Case(
        "qwen2_moe",
        2,
        dict(
            num_experts=6,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        ),
        fused_on_disk=False,
        seed=0,
    ),
}


def save_checkpoint(path: str, case: Case):
    """Writes a random tiny MoE model of `case` (and a tokenizer) to `path`; returns the HF model."""
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=case.num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = random_hf_model(case.model_type, case.seed, **(shape | case.overrides))

    def sharpen_router(name, param):  # sharper router scores, so tokens disagree on their experts
        if name.endswith("mlp.gate.weight"):
            param.mul_(2.0)

    spread_norms_and_biases(model, sharpen_router)
    return save_with_word_tokenizer(model, path, VOCAB, save_original_format=not case.fused_on_disk)


# An engine and a Hugging Face model per case (2-5 s): the tests that use `run` are marked slow.
@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def run(request, tmp_path_factory) -> dict[str, Any]:
    """One Engine per case, one batched generate over all prompts, and HF's answers for the same prompts."""
    name = request.param
    res = serve_case(tmp_path_factory, name, lambda path: save_checkpoint(path, CASES[name]),
                     random_prompts(0, VOCAB, PROMPT_LENS), ENGINE_ARGS, NUM_NEW_TOKENS)
    hf_model = res["hf_model"]
    return {
        **res, "hf_num_params": sum(p.numel() for p in hf_model.parameters()),
        # HF's router scores on prompt + our output
        "routing": np.concatenate([hf_router_scores(hf_model, p + o["output_ids"])
                                   for p, o in zip(res["prompts"], res["outs"])], axis=1),
    }


@pytest.mark.slow
def test_checkpoint_is_the_intended_architecture(run) -> None:
    # Guards the cases themselves: a dropped override or a layout change would make a case test nothing new.
    name, case = run["name"], CASES[run["name"]]
    hf, names = read_checkpoint(run["path"])
    cfg = config_from_hf(hf)
    assert cfg.num_params == run["hf_num_params"]
    assert ("model.layers.0.mlp.experts.gate_up_proj" in names) == case.fused_on_disk
    assert ("model.layers.0.block_sparse_moe.experts.0.w1.weight" in names) == (name == "mixtral")
    assert ("model.layers.0.mlp.gate_proj.weight" in names) == (name == "qwen2_moe_dense_layer")  # dense MLP
    assert ("model.layers.1.mlp.experts.0.gate_proj.weight" in names) == (name == "qwen2_moe_dense_layer")
    assert ("model.layers.1.mlp.shared_expert_gate.weight" in names) == (name == "qwen2_moe_dense_layer")
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (name != "mixtral")
    assert ("model.layers.0.self_attn.o_proj.bias" in names) == (name == "qwen3_moe")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (name == "qwen3_moe")
    assert cfg.sparse_layers == ((False, True) if name == "qwen2_moe_dense_layer" else (True, True))
    assert cfg.norm_topk_prob == (name != "qwen2_moe_dense_layer")
    check_no_near_ties_and_lengths(run, NUM_NEW_TOKENS)


@pytest.mark.slow
def test_routing_is_exercised(run) -> None:
    """Every expert serves some token in every sparse layer, layers route differently, and no routing tie."""
    scores = run["routing"]  # [sparse layers, tokens, experts]
    top = np.argsort(-scores, axis=-1)
    num_layers, _, num_experts = scores.shape
    for layer in range(num_layers):
        used = np.bincount(top[layer, :, :2].ravel(), minlength=num_experts)
        assert (used > 0).all(), f"{run['name']} sparse layer {layer}: experts used {used}"
    if num_layers > 1:
        chosen = np.sort(top[:, :, :2], axis=-1)
        assert (chosen[0] != chosen[1]).any(axis=-1).any(), (
            "every token picks the same experts in both layers"
        )
    ranked = np.sort(scores, axis=-1)
    gap = (ranked[..., -2] - ranked[..., -3]).min()
    assert gap > 1e-4, (
        f"{run['name']}: a token's 2nd and 3rd experts nearly tie ({gap=:.2g}); pick another seed"
    )


test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = map(
    pytest.mark.slow, parity_tests(LOGPROB_ATOL, NUM_NEW_TOKENS)  # they use `run`
)


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("mixtral", dict(sliding_window=64)),
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=64)),
        ("qwen2_moe", dict(use_sliding_window=True, sliding_window=64)),
    ],
)
def test_sliding_window_is_refused(model_type: str, extra: dict[str, Any]) -> None:
    # Paged attention attends to the whole context; a window shorter than the context must not be ignored.
    cfg = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **extra,
    )
    hf = cfg.to_dict() | {
        "architectures": [transformers.AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
    }
    with pytest.raises(ValueError, match="sliding_window=64 < max_position_embeddings=512"):
        config_from_hf(hf)
