"""Mamba-1 and Falcon-Mamba through our Engine against transformers on tiny random checkpoints (fp32)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from memory import MemoryPools, PenaltyPool, RecurrentStatePool
from models.batch import ForwardBatch
from models.mamba import MambaConfig, MambaForCausalLM
from tests.helpers import LOGPROB_ATOL, random_prompts
from tests.hf_reference import (
    check_no_near_ties_and_lengths,
    hf_greedy_recurrent,
    hf_logprobs,
    parity_tests,
    serve_case,
)
from tests.tiny_models import read_checkpoint, save_with_word_tokenizer

VOCAB = 300
NUM_NEW_TOKENS = 32
# Blocks (= scan chunks) of 16 and prefill chunks of 32: 37 and 70 cross several blocks, end in a partial
# one, and continue from their slot's state in later steps (70 = 32 + 32 + 6); 5 fits in one partial block.
PROMPT_LENS = (5, 37, 70)
ENGINE_ARGS = {
    "in_process": True, "dtype": "float32", "max_running_requests": 4, "chunked_prefill_size": 32,
    "prefill_block_size": 16, "context_length": 256, "page_size": 16,
}


@dataclasses.dataclass(frozen=True)
class Case:
    model_type: str
    architecture: str
    overrides: dict[str, Any]
    # Picked so that every greedy step's top-2 logprob gap is >= 1e-3 (see test_hf_parity).
    seed: int


CASES = {
    # Biased in/out projections and an untied head.
    "mamba_bias_untied": Case(
        "mamba", "MambaForCausalLM", {"use_bias": True, "tie_word_embeddings": False}, seed=0
    ),
    # Weightless RMSNorm on dt, B and C; no conv bias; tied head.
    "falcon_mamba": Case(
        "falcon_mamba", "FalconMambaForCausalLM", {"use_conv_bias": False, "tie_word_embeddings": True},
        seed=0,
    ),
}


def _config(case: Case, model_type: str | None = None):
    return transformers.AutoConfig.for_model(
        model_type or case.model_type, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=16,
        expand=2, conv_kernel=4, time_step_rank=8, layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **case.overrides,
    )


def _randomize(model) -> None:
    """HF initializes norms to one, D to one and biases to zero, which would let a model skipping them pass.

    out_proj is scaled up so that the mixers, not the current token's own embedding, pick the next token:
    at HF's init scale a tied head just repeats the input token, which makes a weak greedy comparison.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".D"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            # keep HF's init (log 1..N, softplus^-1 dt), jittered
            elif name.endswith(("A_log", "dt_proj.bias")):
                param.add_(0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.3 * torch.randn_like(param))
            elif "embeddings" in name or name == "lm_head.weight":
                param.normal_(0.0, 0.3)
            elif name.endswith("out_proj.weight"):
                param.mul_(10.0)


# An engine and a Hugging Face model per case (2-5 s): the tests that use `run` are marked slow.
@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def run(request, tmp_path_factory) -> dict[str, Any]:
    """One Engine per case, one batched generate over all prompts, and HF's answers for the same prompts."""
    name = request.param
    case = CASES[name]

    def save(path: str):
        torch.manual_seed(case.seed)
        hf_model = transformers.AutoModelForCausalLM.from_config(_config(case)).float().eval()
        _randomize(hf_model)
        return save_with_word_tokenizer(hf_model, path, VOCAB)

    res = serve_case(tmp_path_factory, name, save, random_prompts(0, VOCAB, PROMPT_LENS), ENGINE_ARGS,
                     NUM_NEW_TOKENS, hf_greedy_fn=hf_greedy_recurrent)
    return {"case": case, **res}


@pytest.mark.slow
def test_checkpoint_is_the_intended_architecture(run) -> None:
    # Guards the cases themselves: a dropped override or a Falcon config loaded as plain Mamba tests nothing.
    name, case = run["name"], run["case"]
    cfg, names = read_checkpoint(run["path"])
    assert cfg["architectures"] == [case.architecture]
    assert ("mixer_rms_eps" in cfg) == (name == "falcon_mamba")
    assert (("backbone.layers.0.mixer.in_proj.bias" in names) == cfg["use_bias"]
            == (name == "mamba_bias_untied"))
    assert (("backbone.layers.0.mixer.conv1d.bias" in names) == cfg["use_conv_bias"]
            == (name != "falcon_mamba"))
    assert ("lm_head.weight" not in names) == cfg["tie_word_embeddings"] == (name == "falcon_mamba")
    check_no_near_ties_and_lengths(run, NUM_NEW_TOKENS)
    if name == "falcon_mamba":
        # The dt/B/C norms must matter at this tolerance, or this case would pass a model that skips them:
        # the same weights run as plain Mamba must give clearly different logprobs.
        plain = transformers.AutoModelForCausalLM.from_config(_config(case, "mamba")).float().eval()
        plain.load_state_dict(run["hf_model"].state_dict())
        prompt = run["prompts"][1]
        assert np.abs(hf_logprobs(plain, prompt) - run["hf_lps"][1][: len(prompt)]).max() > 100 * LOGPROB_ATOL


test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf = map(
    pytest.mark.slow, parity_tests(LOGPROB_ATOL, NUM_NEW_TOKENS)  # they use `run`
)


@pytest.mark.parametrize("num_decode", [1, 3])
def test_decode_step_does_not_copy_the_state_pool(num_decode) -> None:
    # The pool rides in the layer scan's carry, gathered from and scattered into. With a single state row
    # XLA turns the gather/scatter into dynamic-slice/update-slice and then copied the whole pool twice per
    # layer (a Mamba-2-130m decode step at batch 1: 2.4 s instead of 50 ms); models/recurrent.py pads a
    # single row with a dummy one. No instruction may produce a copy of the pool.
    cfg = MambaConfig(architecture="MambaForCausalLM", vocab_size=VOCAB, hidden_size=64,
                      intermediate_size=128, state_size=16, num_layers=4, conv_kernel=4)
    graphdef, params = nnx.split(MambaForCausalLM(cfg))
    num_slots = 5
    pools = MemoryPools(kv=None, penalty=PenaltyPool.create(num_slots, VOCAB),
                        recurrent=RecurrentStatePool.create(cfg.cache_spec.recurrent, num_slots, jnp.float32))
    ids = jnp.zeros(num_decode, jnp.int32)
    batch = ForwardBatch(ids, ids, ids, jnp.zeros((0, 1), jnp.int32), jnp.zeros((num_decode, 1), jnp.int32),
                         jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32),
                         jnp.arange(1, num_decode + 1, dtype=jnp.int32))

    def step(params, batch, pools):
        return nnx.merge(graphdef, params)(batch, pools)

    hlo = jax.jit(step, donate_argnums=2).lower(params, batch, pools).compile().as_text()
    for pool in jax.tree.leaves(pools.recurrent):
        shape = re.escape(f"f32[{','.join(map(str, pool.shape))}]")
        copies = [line for line in hlo.splitlines() if re.search(rf"= {shape}(\{{[^}}]*\}})? copy\(", line)]
        assert not copies, copies
