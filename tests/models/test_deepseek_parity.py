"""Our Engine against transformers on tiny random DeepSeek-V3 checkpoints: MLA over a latent pool, grouped
sigmoid routing with a correction bias, shared experts, dense first layers, YaRN."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest
import torch

from models.deepseek_v3 import config_from_hf
from tests.helpers import LOGPROB_ATOL, random_prompts
from tests.hf_reference import check_no_near_ties_and_lengths, parity_tests, serve_case
from tests.models.test_moe_parity import ENGINE_ARGS, NUM_NEW_TOKENS, PROMPT_LENS, VOCAB
from tests.tiny_models import (
    random_hf_model,
    read_checkpoint,
    save_with_word_tokenizer,
    spread_norms_and_biases,
)

# Each case's `run` fixture starts an engine and a Hugging Face model (2-5 s a case).
pytestmark = pytest.mark.slow

# The MoE parity settings: prompts of 5, 37 and 70 tokens (one shorter than a page, two prefilled in 32-token
# chunks across pages), 32 greedy tokens, two running requests.


@dataclasses.dataclass(frozen=True)
class Case:
    overrides: dict[str, Any]
    seed: int  # picked so that no greedy step is a near-tie


CASES = {
    # q LoRA, interleaved rope, YaRN with mscale != mscale_all_dim (scales cos/sin and the softmax),
    # top-2 of 8 experts within the best 2 of 4 groups, a shared expert, one dense layer first.
    "lora_yarn_grouped": Case(
        dict(
            q_lora_rank=32,
            rope_interleave=True,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_scaling=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=128,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=0.8,
            ),
        ),
        seed=1,
    ),
    # Plain q projection, rotate-half rope, attention biases, ungrouped routing without renormalisation,
    # two shared experts, every layer sparse.
    "plain_q_bias": Case(
        dict(
            q_lora_rank=None,
            rope_interleave=False,
            attention_bias=True,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
        ),
        seed=0,
    ),
}


def save_checkpoint(path: str, case: Case):
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = random_hf_model("deepseek_v3", case.seed, **(shape | case.overrides))

    def sharpen_router(name, param):  # sharper router scores, so tokens disagree on their experts
        if name.endswith("mlp.gate.weight"):
            param.mul_(3.0)

    spread_norms_and_biases(model, sharpen_router)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))  # changes the choice for some tokens
    return save_with_word_tokenizer(model, path, VOCAB)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def run(request, tmp_path_factory) -> dict[str, Any]:
    """One Engine per case, one batched generate over all prompts, and HF's answers for the same prompts."""
    name = request.param
    res = serve_case(tmp_path_factory, name, lambda path: save_checkpoint(path, CASES[name]),
                     random_prompts(0, VOCAB, PROMPT_LENS), ENGINE_ARGS, NUM_NEW_TOKENS,
                     inspect=lambda engine: (engine.runner.pools.kv.k.shape, engine.runner.pools.kv.v))
    return {**res, "kv_shapes": res["inspected"],
            "hf_num_params": sum(p.numel() for p in res["hf_model"].parameters())}


def test_checkpoint_is_the_intended_architecture(run) -> None:
    from safetensors import safe_open

    name = run["name"]
    hf, names = read_checkpoint(run["path"])
    cfg = config_from_hf(hf)
    with safe_open(os.path.join(run["path"], "model.safetensors"), framework="np") as f:
        bias = f.get_tensor("model.layers.2.mlp.gate.e_score_correction_bias")
    assert cfg.num_params == run["hf_num_params"]
    assert np.abs(bias).max() > 0.05  # the correction bias was saved and is not zero
    assert ("model.layers.0.self_attn.q_a_proj.weight" in names) == (name == "lora_yarn_grouped")
    assert ("model.layers.0.mlp.gate_proj.weight" in names) == (name == "lora_yarn_grouped")  # dense layer 0
    assert ("model.layers.0.self_attn.o_proj.bias" in names) == (name == "plain_q_bias")
    if name == "lora_yarn_grouped":
        assert cfg.mla.rope.rope_type == "yarn" and cfg.mla.rope.attention_scaling != 1.0
        assert cfg.mla.softmax_scale != cfg.mla.qk_head_dim**-0.5
        assert (cfg.n_group, cfg.topk_group, cfg.num_dense_layers) == (4, 2, 1)
    # The pool holds one latent per token and layer (kv_lora_rank + rope dims), no V.
    k_shape, v = run["kv_shapes"]
    assert k_shape[0] == 3 and k_shape[2:] == (1, 16 + 8) and v is None
    check_no_near_ties_and_lengths(run, NUM_NEW_TOKENS)


# Prompt logprobs come from prefill (expanded MLA), output logprobs from decode steps (absorbed MLA).
test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = parity_tests(
    LOGPROB_ATOL, NUM_NEW_TOKENS
)
