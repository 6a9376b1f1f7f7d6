"""Ling 2.5 (BailingMoeV2_5: MLA + Lightning linear attention + sigmoid-routed experts) against the golden
fixture computed by the official modeling code (it needs fla and transformers 4.57, so it cannot run here)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

from serve import Engine
from tests.helpers import LOGPROB_ATOL, REPO, assert_idle_and_consistent, greedy, prefill_batch, prefill_pools

# A copy of ../shared/golden/bailing_moe_v2_5 (made by running the official code elsewhere; see its README),
# kept in the repository so that CI's fresh clone checks it too.
GOLDEN = os.path.join(REPO, "tests", "data", "golden", "bailing_moe_v2_5")
GREEDY = greedy(24)  # eos is token 1
# Prompts of 7, 45 and 130 tokens in 16-token blocks (the linear-attention chunk) and 32-token scheduler
# chunks: one prompt inside a block, one across blocks with a partial last one, one prefilled in five
# steps (4 x 32 + 2) that continue the recurrent state and the latent pages from the previous step.
ENGINE_ARGS = {
    "in_process": True,
    "dtype": "float32",
    "max_running_requests": 4,
    "chunked_prefill_size": 32,
    "prefill_block_size": 16,
    "context_length": 256,
    "page_size": 16,
    "max_total_tokens": 2048,
    "skip_tokenizer_init": True,
}

@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    with open(os.path.join(GOLDEN, "golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def run(golden) -> dict[str, Any]:
    """Each prompt alone (as the reference ran them), then all three batched, on one engine."""
    prompts = [p["prompt_ids"] for p in golden["prompts"]]
    engine = Engine(model=GOLDEN, **ENGINE_ARGS)
    try:
        alone = [
            engine.generate(
                input_ids=p,
                sampling_params=GREEDY,
                return_logprob=True,
                logprob_start_len=0,
                top_logprobs_num=5,
            )
            for p in prompts
        ]
        batched = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert_idle_and_consistent(engine)
    finally:
        engine.shutdown()
    return {"prompts": prompts, "alone": alone, "batched": batched}


def test_config_is_read_by_architecture_with_the_intended_features(golden) -> None:
    from safetensors import safe_open

    from models.bailing_moe_v2_5 import BailingMoeV2_5Config, BailingMoeV2_5ForCausalLM, lightning_log_decay
    from models.loader import load_config
    from models.registry import model_class

    cfg, hf = load_config(GOLDEN)
    # transformers' own `bailing_hybrid` is a different architecture: the class comes from `architectures`.
    assert hf["model_type"] == "bailing_hybrid" and isinstance(cfg, BailingMoeV2_5Config)
    assert model_class(hf["architectures"][0]) is BailingMoeV2_5ForCausalLM
    # Upstream's `(layer - 1)` in the depth factor: layer 0 of 6 decays 1.2x the base rates 4^-(h+1).
    np.testing.assert_allclose(lightning_log_decay(4, 0, 6), -1.2 * 0.25 ** np.arange(1, 5), rtol=1e-4)
    assert cfg.layer_types == tuple(golden["evidence"]["layer_attention_types"])
    assert cfg.n_group > 1 and cfg.first_k_dense_replace == 1 and cfg.n_shared_experts == 1
    assert cfg.use_qk_norm and cfg.group_norm_size > 1 and cfg.mla.q_lora_rank and cfg.mla.rope_interleave
    assert cfg.rotary_dim == cfg.head_dim // 2 and cfg.routed_scaling_factor != 1
    spec = cfg.cache_spec
    assert spec.latent_kv and spec.num_kv_layers == 2 and spec.head_dim == cfg.mla.latent_dim
    assert spec.recurrent.num_layers == 4 and spec.recurrent.ssm_shape == (4, 16, 16)
    with safe_open(os.path.join(GOLDEN, "model.safetensors"), framework="np") as f:
        # safe_open is not iterable: .keys() is needed.
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
    biases = sum(int(np.prod(s)) for name, s in sizes.items() if name.endswith("expert_bias"))
    assert any(name.endswith("expert_bias") for name in sizes)
    assert cfg.num_params == sum(int(np.prod(s)) for s in sizes.values()) - biases  # buffers are not params


@pytest.mark.slow
def test_prompt_logprobs_match_golden(run, golden) -> None:
    for prompt, out, ref in zip(run["prompts"], run["alone"], golden["prompts"]):
        got = out["meta_info"]["input_token_logprobs"]
        assert [t for _, t in got] == prompt and got[0][0] is None
        np.testing.assert_allclose(
            [lp for lp, _ in got[1:]],
            ref["prompt_logprobs"][1:],
            atol=LOGPROB_ATOL,
            rtol=0,
            err_msg=f"prompt of {len(prompt)}",
        )


@pytest.mark.slow
def test_last_position_top5_matches_golden(run, golden) -> None:
    for prompt, out, ref in zip(run["prompts"], run["alone"], golden["prompts"]):
        top = out["meta_info"]["output_top_logprobs"][0]  # the distribution after the last prompt token
        assert [t for _, t in top] == ref["last_position_top5"]["ids"], f"prompt of {len(prompt)}"
        np.testing.assert_allclose(
            [lp for lp, _ in top],
            ref["last_position_top5"]["logprobs"],
            atol=LOGPROB_ATOL,
            rtol=0,
            err_msg=f"prompt of {len(prompt)}",
        )


@pytest.mark.slow
def test_greedy_tokens_and_logprobs_match_golden(run, golden) -> None:
    for prompt, out, ref in zip(run["prompts"], run["alone"], golden["prompts"]):
        assert out["output_ids"] == ref["greedy_tokens"], f"prompt of {len(prompt)}"
        got = out["meta_info"]["output_token_logprobs"]
        assert [t for _, t in got] == ref["greedy_tokens"]
        np.testing.assert_allclose(
            [lp for lp, _ in got],
            ref["greedy_token_logprobs"],
            atol=LOGPROB_ATOL,
            rtol=0,
            err_msg=f"prompt of {len(prompt)}",
        )


@pytest.mark.slow
def test_batched_equals_each_alone(run) -> None:
    assert [o["output_ids"] for o in run["batched"]] == [o["output_ids"] for o in run["alone"]]
    assert len({tuple(o["output_ids"]) for o in run["alone"]}) == 3


def test_layer_outputs_match_golden_debug(golden) -> None:
    """Prompt 0 through the layers one by one: the embedding, each layer's output, the final norm and the
    last position's logits."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import hybrid
    from models.bailing_moe_v2_5 import LINEAR
    from models.loader import load_model
    from models.recurrent import read_layer_states, state_rows, write_layer_states

    cfg, model = load_model(GOLDEN, jnp.float32)
    pools = prefill_pools(cfg, num_pages=4, latent=True)
    graphdef, params = nnx.split(model)

    @jax.jit  # one compile is faster than running the ops eagerly
    def layer_outputs(params, batch, pools):
        m = nnx.merge(graphdef, params)
        x = m.embed[...][batch.input_ids].astype(jnp.float32)
        outs, kv, rec, rows = [x], pools.kv, pools.recurrent, state_rows(batch)
        for i, (kind, index) in enumerate(zip(cfg.layer_types, hybrid.ordinals(cfg.layer_types))):
            states = read_layer_states(rec, index, rows) if kind == LINEAR else None
            x, kv, states = m.layers[str(i)](x, batch, kv, states, index)
            if kind == LINEAR:
                rec = write_layer_states(rec, index, rows, states)
            outs.append(x)
        hidden = m.norm(x)
        return [*outs, hidden, m.logits(hidden)]

    prompt, debug = golden["prompts"][0]["prompt_ids"], golden["debug"]
    assert debug["prompt_index"] == 0
    batch = prefill_batch(prompt, block_size=16, page_size=16)
    *outs, logits = [np.asarray(o)[: len(prompt)] for o in layer_outputs(params, batch, pools)]
    expected = [debug["embedding_output"], *debug["decoder_layer_outputs"], debug["final_norm_output"]]
    names = ["embedding"] + [f"layer {i} ({k})" for i, k in enumerate(cfg.layer_types)] + ["final norm"]
    outs, expected = [*outs, logits[-1]], [*expected, golden["prompts"][0]["last_position_logits"]]
    names.append("last position logits")
    for name, ours, want in zip(names, outs, expected):
        np.testing.assert_allclose(ours, np.asarray(want), atol=LOGPROB_ATOL, rtol=0, err_msg=name)
