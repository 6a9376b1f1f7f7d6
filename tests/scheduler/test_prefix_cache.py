"""The radix prefix cache on the engine: the same requests with the cache on and off give the same greedy
tokens and logprobs (the engine without it is checked against transformers elsewhere), for dense, MoE and
MLA models and for recurrent ones (Mamba-2, Falcon-Mamba, and the Nemotron-H, MiniMax and Ling 2.5
hybrids, whose hits start from state snapshots), with prefixes that end mid-page, at page ends and
mid-chunk, alone and batched; eviction and retraction under a tiny pool; the tree's integrity after every
scenario."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

from serve import Engine
from tests.helpers import assert_idle_and_consistent
from tests.tiny_models import save_tiny_llama

pytestmark = pytest.mark.slow

PAGE = 16
SHORT = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
BASE = dict(in_process=True, dtype="float32", max_running_requests=8, chunked_prefill_size=32, page_size=PAGE,
            context_length=256, max_total_tokens=4096, skip_tokenizer_init=True)
# Shared-prefix lengths: inside the first page, page ends and their neighbours, a chunk end (32), long.
PREFIXES = (5, 15, 16, 17, 31, 32, 33, 47, 48, 64, 90)


def _dense(tmp_path_factory) -> tuple[str, int]:
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama"))), 512


def _moe(tmp_path_factory) -> tuple[str, int]:
    from tests.models.test_moe_parity import VOCAB, save_checkpoint
    from tests.runtime.test_moe_engine import CASES

    path = str(tmp_path_factory.mktemp("qwen2_moe"))
    save_checkpoint(path, CASES["qwen2_moe"])
    return path, VOCAB


def _mla(tmp_path_factory) -> tuple[str, int]:
    from tests.models.test_deepseek_parity import CASES, VOCAB, save_checkpoint

    path = str(tmp_path_factory.mktemp("deepseek_v3"))
    save_checkpoint(path, CASES["lora_yarn_grouped"])
    return path, VOCAB


def _mamba2(tmp_path_factory) -> tuple[str, int]:
    from tests.tiny_models import save_tiny_mamba2

    return save_tiny_mamba2(str(tmp_path_factory.mktemp("mamba2"))), 512


def _falcon_mamba(tmp_path_factory) -> tuple[str, int]:
    import torch
    import transformers

    from tests.models.test_mamba_parity import CASES, VOCAB, _config, _randomize
    from tests.tiny_models import save_with_word_tokenizer

    path = str(tmp_path_factory.mktemp("falcon_mamba"))
    case = CASES["falcon_mamba"]
    torch.manual_seed(case.seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(case)).float().eval()
    _randomize(model)
    save_with_word_tokenizer(model, path, VOCAB)
    return path, VOCAB


def _nemotron_h(tmp_path_factory) -> tuple[str, int]:
    from tests.models.test_hybrid_parity import CASES, VOCAB, save_checkpoint

    path = str(tmp_path_factory.mktemp("nemotron_h"))
    save_checkpoint(path, CASES["nemotron_h"])
    return path, VOCAB


def _minimax(tmp_path_factory) -> tuple[str, int]:
    from tests.models.test_minimax_parity import VOCAB, save_checkpoint

    path = str(tmp_path_factory.mktemp("minimax"))
    save_checkpoint(path)
    return path, VOCAB


def _ling_2_5(tmp_path_factory) -> tuple[str, int]:
    """Ling 2.5's golden checkpoint: MLA latent pages and Lightning linear-attention state together."""
    import json

    from tests.models.test_bailing_golden import GOLDEN

    with open(os.path.join(GOLDEN, "config.json")) as f:
        return GOLDEN, json.load(f)["vocab_size"]


def _qwen3_next(tmp_path_factory) -> tuple[str, int]:
    """Gated DeltaNet state (delta-rule matrix + conv) beside gated attention's KV pages."""
    from tests.models.test_hybrid_parity import VOCAB
    from tests.models.test_qwen3_next_parity import save_checkpoint

    path = str(tmp_path_factory.mktemp("qwen3_next"))
    save_checkpoint(path)
    return path, VOCAB


MODELS = {"llama": _dense, "qwen2_moe": _moe, "deepseek_v3_mla": _mla}
# Models with recurrent state: a match ends at a snapshot. Enough snapshot slots that none is evicted here.
RECURRENT = {"mamba2": _mamba2, "falcon_mamba": _falcon_mamba, "nemotron_h": _nemotron_h, "minimax": _minimax,
             "ling_2_5": _ling_2_5, "qwen3_next": _qwen3_next}
SNAPSHOTS = {"max_state_snapshots": 96}


def shared_prefix_prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    """Prompts that share a common stem up to each of PREFIXES, then diverge for 1-20 tokens."""
    rng = np.random.default_rng(seed)
    stem = rng.integers(3, vocab, size=max(PREFIXES)).tolist()
    return [stem[:k] + rng.integers(3, vocab, size=int(rng.integers(1, 21))).tolist() for k in PREFIXES]


def _outputs(results: list[dict]) -> list[tuple[list[int], list[float]]]:
    return [(r["output_ids"], [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]) for r in results]


def _same(a: list[tuple[list[int], list[float]]], b: list[tuple[list[int], list[float]]]) -> None:
    for (ids_a, lps_a), (ids_b, lps_b) in zip(a, b, strict=True):
        assert ids_a == ids_b
        np.testing.assert_allclose(lps_a, lps_b, atol=1e-5, rtol=0)


def _scenario(path: str, prompts: list[list[int]], **overrides) -> dict[str, Any]:
    """Each prompt alone (in order, so later ones find earlier prefixes), then all batched, then each again
    with prompt logprobs from the middle of its shared stem; with the prompts' cached-token counts."""
    engine = Engine(model=path, **{**BASE, **overrides})
    try:
        alone = [engine.generate(input_ids=p, sampling_params=SHORT, return_logprob=True) for p in prompts]
        batched = engine.generate(input_ids=prompts, sampling_params=SHORT, return_logprob=True)
        starts = [max(1, k // 2) for k in PREFIXES]
        scored = [engine.generate(input_ids=p, sampling_params=SHORT, return_logprob=True,
                                  logprob_start_len=s) for p, s in zip(prompts, starts)]
        assert_idle_and_consistent(engine)
        return {"alone": _outputs(alone), "batched": _outputs(batched), "scored": _outputs(scored),
                "input_lps": [r["meta_info"]["input_token_logprobs"] for r in scored],
                "cached": [[r["meta_info"]["cached_tokens"] for r in rs] for rs in (alone, batched, scored)],
                "info": engine.scheduler.prefix_cache_info()}
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", params=[*MODELS, *RECURRENT])
def runs(request, tmp_path_factory) -> dict[str, Any]:
    recurrent = request.param in RECURRENT
    path, vocab = {**MODELS, **RECURRENT}[request.param](tmp_path_factory)
    prompts = shared_prefix_prompts(vocab)
    on = _scenario(path, prompts, **(SNAPSHOTS if recurrent else {}))
    return {"prompts": prompts, "recurrent": recurrent, "on": on,
            "off": _scenario(path, prompts, disable_radix_cache=True)}


def test_cache_on_gives_the_outputs_of_cache_off(runs):
    on, off = runs["on"], runs["off"]
    for part in ("alone", "batched", "scored"):
        _same(on[part], off[part])


def test_prompt_logprobs_from_inside_the_cached_part_are_recomputed(runs):
    """logprob_start_len inside a cached prefix: the prefix is matched only up to it, so every wanted prompt
    logprob is computed, and equals the cache-off value."""
    for on, off in zip(runs["on"]["input_lps"], runs["off"]["input_lps"], strict=True):
        assert [t for _, t in on] == [t for _, t in off] and len(on) > 0
        np.testing.assert_allclose([lp for lp, _ in on if lp is not None],
                                   [lp for lp, _ in off if lp is not None], atol=1e-5, rtol=0)


def test_cached_tokens_are_reported(runs):
    alone, batched, scored = runs["on"]["cached"]
    off = runs["off"]["cached"]
    assert all(c == 0 for rs in off for c in rs), "cache off reports no cached tokens"
    prompts = runs["prompts"]
    if runs["recurrent"]:
        # Alone, in order: prompt i - 1 stopped its prefill where the tree's pages for it ended (at
        # PREFIXES[i - 2] tokens of the stem, a branch point) and saved its state: prompt i starts there.
        for i in range(2, len(PREFIXES)):
            assert alone[i] >= PREFIXES[i - 2] // PAGE * PAGE, (i, alone[i])
    else:
        # Alone, in order: prompt i shares PREFIXES[j] tokens with every earlier prompt j < i (the stem), and
        # the cache holds whole pages of it, but never the prompt's last token.
        for i, (k, p) in enumerate(zip(PREFIXES, prompts)):
            shared = max((min(k, PREFIXES[j]) for j in range(i)), default=0)
            assert alone[i] >= min(shared, len(p) - 1) // PAGE * PAGE, (i, alone[i])
    # Second time round, each prompt finds its own whole pages (all but the last token): a recurrent model
    # snapshotted its state there.
    assert batched == [(len(p) - 1) // PAGE * PAGE for p in prompts]
    # With prompt logprobs from position s the match stops at s - 1 (a recurrent model's at the last snapshot
    # before it).
    limits = [min(max(0, max(1, k // 2) - 1), len(p) - 1) // PAGE * PAGE for k, p in zip(PREFIXES, prompts)]
    if runs["recurrent"]:
        assert all(c <= limit and c % PAGE == 0 for c, limit in zip(scored, limits)) and any(scored)
    else:
        assert scored == limits
    info = runs["on"]["info"]
    assert info["enabled"] and info["cached_prompt_tokens"] == sum(map(sum, runs["on"]["cached"]))


def test_eviction_and_retraction_under_a_tiny_pool(tmp_path_factory):
    """64 shared-prefix requests at once in a pool of 12 pages: the cache must evict and the scheduler
    retract, and every request still gets the output it gets with ample memory and no cache."""
    path, vocab = _dense(tmp_path_factory)
    rng = np.random.default_rng(5)
    stems = [rng.integers(3, vocab, size=40).tolist() for _ in range(4)]
    prompts = [stems[i % 4][: 20 + i % 21] + rng.integers(3, vocab, size=3).tolist() for i in range(64)]
    params = {**SHORT, "max_new_tokens": 12}
    free = Engine(model=path, **{**BASE, "disable_radix_cache": True})
    try:
        expected = [r["output_ids"] for r in free.generate(input_ids=prompts, sampling_params=params)]
    finally:
        free.shutdown()
    tiny = Engine(model=path, **{**BASE, "max_total_tokens": 12 * PAGE, "max_running_requests": 8})
    try:
        got = [r["output_ids"] for r in tiny.generate(input_ids=prompts, sampling_params=params)]
        again = [r["output_ids"] for r in tiny.generate(input_ids=prompts[:8], sampling_params=params)]
        s = tiny.scheduler
        assert_idle_and_consistent(tiny)
        assert s.num_retractions > 0, "the pool was not small enough to force retraction"
        assert s.num_cached_prompt_tokens > 0
        pages_cached = s.prefix_cache_info()["cached_tokens"] // PAGE
        assert pages_cached <= 11, "the tree holds more pages than the pool"
    finally:
        tiny.shutdown()
    assert got == expected
    assert again == expected[:8]


def test_flush_refuses_while_requests_live_then_frees_everything(tmp_path_factory):
    from runtime.sampling_params import SamplingParams
    from scheduler.request import Req

    path, vocab = _dense(tmp_path_factory)
    engine = Engine(model=path, **BASE)
    s = engine.scheduler
    try:
        engine.generate(input_ids=list(range(3, 60)), sampling_params=SHORT)
        assert s.prefix_cache_info()["cached_tokens"] > 0
        s.add_request(Req("waiting", list(range(3, 40)), SamplingParams(temperature=0, max_new_tokens=2), 0))
        with pytest.raises(RuntimeError, match="1 requests are waiting or running"):
            s.flush_cache()
        while s.has_work():
            s.step()
        freed = s.flush_cache()
        assert freed > 0 and s.prefix_cache_info()["cached_tokens"] == 0
        assert s.num_free_tokens == s.capacity_tokens
        s.check_integrity()
    finally:
        engine.shutdown()


def test_recurrent_model_without_snapshot_slots_serves_without_the_cache(tmp_path_factory):
    path, _ = _mamba2(tmp_path_factory)
    engine = Engine(model=path, **{**BASE, "max_state_snapshots": 0})
    try:
        info = engine.scheduler.prefix_cache_info()
        assert not info["enabled"] and "--max-state-snapshots 0" in info["reason"]
        assert engine.scheduler.runner.pools.snapshots is None
        r = engine.generate(input_ids=list(range(3, 40)), sampling_params=SHORT)
        assert r["meta_info"]["cached_tokens"] == 0
        with pytest.raises(RuntimeError, match="off"):
            engine.scheduler.flush_cache()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["nemotron_h", "mamba2"])
def test_recurrent_eviction_retraction_and_multi_step_decode(name, tmp_path_factory):
    """64 shared-prefix requests with few snapshot slots (snapshots evicted, saves skipped when every slot is
    pinned), multi-step decode (states saved inside the multi-step program), and for the hybrid a KV pool so
    small that pages are evicted and requests retracted: outputs equal an ample cache-off run's, and
    afterwards every page and snapshot slot is accounted for."""
    path, vocab = RECURRENT[name](tmp_path_factory)
    rng = np.random.default_rng(7)
    stems = [rng.integers(3, vocab, size=48).tolist() for _ in range(4)]
    prompts = [stems[i % 4][: 20 + i % 29] + rng.integers(3, vocab, size=3).tolist() for i in range(64)]
    params = {**SHORT, "max_new_tokens": 20}
    free = Engine(model=path, **{**BASE, "disable_radix_cache": True})
    try:
        expected = [r["output_ids"] for r in free.generate(input_ids=prompts, sampling_params=params)]
    finally:
        free.shutdown()
    pool = {"max_total_tokens": 16 * PAGE} if name == "nemotron_h" else {}
    tight = Engine(model=path, **{**BASE, **pool, "max_state_snapshots": 6, "num_continuous_decode_steps": 3})
    try:
        got = [r["output_ids"] for r in tight.generate(input_ids=prompts, sampling_params=params)]
        again = tight.generate(input_ids=prompts[:8], sampling_params=params)
        s = tight.scheduler
        assert_idle_and_consistent(tight)
        assert s.num_cached_prompt_tokens > 0
        assert s.prefix_cache_info()["state_snapshots"] <= 6
        if name == "nemotron_h":
            assert s.num_retractions > 0, "the pool was not small enough to force retraction"
    finally:
        tight.shutdown()
    assert got == expected
    assert [r["output_ids"] for r in again] == expected[:8]


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h"])
def test_recurrent_multi_turn_hits_the_previous_answer(name, tmp_path_factory):
    """Each turn resends the conversation: it starts from the state its previous turn saved at the last page
    boundary of its prompt + answer (decode saves it), and gives the outputs of the cache-off engine."""
    path, vocab = RECURRENT[name](tmp_path_factory)
    rng = np.random.default_rng(11)
    params = {**SHORT, "max_new_tokens": 21}
    results = {}
    for off in (False, True):
        engine = Engine(model=path, **{**BASE, "disable_radix_cache": off})
        try:
            history, turns = [], []
            for _ in range(4):
                history = history + rng.integers(3, vocab, size=9).tolist()
                r = engine.generate(input_ids=history, sampling_params=params)
                turns.append((len(history), r["output_ids"], r["meta_info"]["cached_tokens"]))
                history = history + r["output_ids"]
            assert_idle_and_consistent(engine)
            if not off:  # a flush gives every snapshot slot back
                engine.scheduler.flush_cache()
                cache = engine.scheduler.rank_caches[0]
                assert engine.scheduler.prefix_cache_info()["state_snapshots"] == 0
                assert cache.snapshots.num_free == cache.snapshots.num_slots - 1
        finally:
            engine.shutdown()
        results[off] = turns
        rng = np.random.default_rng(11)
    assert [t[1] for t in results[False]] == [t[1] for t in results[True]]
    for (n, out, _), (_, _, cached) in zip(results[False], results[False][1:]):
        # The previous turn computed its prompt and all but its last output token.
        assert cached == (n + len(out) - 1) // PAGE * PAGE, (n, len(out), cached)


@pytest.mark.parametrize("name", ["dense", "mamba2", "nemotron_h"])
def test_a_burst_sharing_a_prefix_computes_it_once(name, tmp_path_factory):
    """Requests that arrive together and share a 70-token stem (nothing cached yet): the first computes it,
    the others wait for it instead of computing it alongside, then start from its pages (a recurrent model:
    from the state its prefill saved where the stem ends, a save point added for them), with the outputs of
    the cache-off engine. A request that shares too little with it is not held back."""
    path, vocab = {"dense": _dense, **RECURRENT}[name](tmp_path_factory)
    rng = np.random.default_rng(5)
    stem = rng.integers(3, vocab, size=70).tolist()
    prompts = [stem + rng.integers(3, vocab, size=int(n)).tolist() for n in (9, 20, 3, 31)]
    prompts.append(stem[:20] + rng.integers(3, vocab, size=40).tolist())  # 16 tokens in common: < 32
    results = {}
    for off in (False, True):
        engine = Engine(model=path, **{**BASE, "disable_radix_cache": off, **({} if off else SNAPSHOTS)})
        try:
            results[off] = engine.generate(input_ids=prompts, sampling_params=SHORT, return_logprob=True)
            assert_idle_and_consistent(engine)
        finally:
            engine.shutdown()
    _same(_outputs(results[False]), _outputs(results[True]))
    cached = [r["meta_info"]["cached_tokens"] for r in results[False]]
    assert cached[0] == 0 and cached[4] in (0, 16), cached  # the last: whatever the tree held on admission
    assert cached[1:4] == [64, 64, 64], cached  # the stem's whole pages (70 // 16 * 16)
