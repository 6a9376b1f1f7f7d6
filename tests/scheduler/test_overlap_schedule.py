"""The overlap schedule (scheduler/stepping.py): a decode step built and dispatched while the previous one
runs, its inputs placeholders for tokens still in flight, must give exactly the results of stepping one
step at a time, whatever finishes, stops, samples, penalises or aborts while a step is in flight, and leave
nothing behind."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.sampling_params import SamplingParams
from scheduler import Req
from serve import Engine
from tests.helpers import assert_idle_and_consistent, random_prompts
from tests.tiny_models import save_tiny_llama, save_tiny_mamba2

pytestmark = pytest.mark.slow

BASE = dict(in_process=True, dtype="float32", max_running_requests=8, chunked_prefill_size=64,
            context_length=128, max_total_tokens=2048, skip_tokenizer_init=True)
PROMPTS = random_prompts(3, 512, (5, 17, 33, 40, 9, 26))
# Requests finishing at different steps (lengths 1 .. 30, some stopping on a token), sampling and penalties.
PARAMS = [
    dict(temperature=0, max_new_tokens=30, ignore_eos=True),
    dict(temperature=0, max_new_tokens=1, ignore_eos=True),
    dict(temperature=0, max_new_tokens=2, ignore_eos=True),
    dict(temperature=0.9, top_p=0.9, max_new_tokens=21, ignore_eos=True, frequency_penalty=0.5,
         presence_penalty=0.3, repetition_penalty=1.2, seed=11),
    dict(temperature=1.0, top_k=20, max_new_tokens=17, min_new_tokens=9, seed=12),
    dict(temperature=0, max_new_tokens=25, ignore_eos=True, repetition_penalty=1.3),
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


def generate(engine: Engine, params: list[dict]) -> list[dict]:
    return engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True, top_logprobs_num=3)


def assert_same(got: list[dict], want: list[dict], atol: float = 1e-6) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            np.testing.assert_allclose(np.asarray(g["meta_info"][key], dtype=float),
                                       np.asarray(w["meta_info"][key], dtype=float), atol=atol, rtol=0)


def with_stops(sync: list[dict], params: list[dict]) -> list[dict]:
    """`params` where two greedy requests stop on a token their synchronous run produced mid-way."""
    out = [dict(p) for p in params]
    for i in (0, 5):
        out[i]["stop_token_ids"] = [sync[i]["output_ids"][7]]
    return out


def test_overlapped_steps_give_the_outputs_of_synchronous_ones(llama_dir):
    with Engine(model=llama_dir, disable_overlap_schedule=True, **BASE) as engine:
        sync = generate(engine, PARAMS)
        sync_stops = generate(engine, with_stops(sync, PARAMS))
        assert engine.scheduler.num_overlapped_steps == 0
        assert_idle_and_consistent(engine)
    assert len(set(map(tuple, (o["output_ids"] for o in sync)))) == len(PROMPTS)
    assert [len(o["output_ids"]) for o in sync] == [30, 1, 2, 21, 17, 25]
    assert len(sync_stops[0]["output_ids"]) <= 8
    assert sync_stops[0]["meta_info"]["finish_reason"]["type"] == "stop"
    with Engine(model=llama_dir, **BASE) as engine:
        assert_same(generate(engine, PARAMS), sync)
        assert_same(generate(engine, with_stops(sync, PARAMS)), sync_stops)
        # most decode steps went ahead of their predecessor's tokens
        assert engine.scheduler.num_overlapped_steps >= 30
        assert engine.server_info()["num_overlapped_steps"] == engine.scheduler.num_overlapped_steps
        assert_idle_and_consistent(engine)


def test_an_abort_while_a_step_is_in_flight_loses_nothing_else(llama_dir):
    greedy = dict(temperature=0, max_new_tokens=20, ignore_eos=True)
    params = [SamplingParams(**greedy) for _ in PROMPTS]
    with Engine(model=llama_dir, disable_overlap_schedule=True, **BASE) as engine:
        want = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=greedy)]
    with Engine(model=llama_dir, **BASE) as engine:
        sched = engine.scheduler
        reqs = [Req(rid=f"r{i}", prompt_ids=list(p), params=sp, seed=i)
                for i, (p, sp) in enumerate(zip(PROMPTS, params))]
        for r in reqs:
            sched.add_request(r)
        got = {r.rid: [] for r in reqs}
        steps = 0
        while sched.has_work():
            for out in sched.step():
                got[out.rid] += out.new_ids
            steps += 1
            if steps == 6:
                assert sched._inflight is not None and reqs[2].inflight == 1  # a step is in flight
                sched.abort("r2")
        assert reqs[2].finish_reason.type == "abort"
        assert sched.num_overlapped_steps > 0
        for i, r in enumerate(reqs):
            if i != 2:
                assert got[r.rid] == r.output_ids == want[i]
        assert got["r2"] == want[2][: len(got["r2"])] and len(got["r2"]) < 20
        assert_idle_and_consistent(engine)


def test_a_recurrent_model_with_snapshots_gives_the_same_outputs(tmp_path):
    model = save_tiny_mamba2(str(tmp_path / "mamba2"))
    params = dict(temperature=0, max_new_tokens=40, ignore_eos=True)
    kwargs = {**BASE, "max_running_requests": 4}
    prompts = PROMPTS[:4]
    with Engine(model=model, disable_overlap_schedule=True, **kwargs) as engine:
        want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    with Engine(model=model, **kwargs) as engine:
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        # and again: the prompts and answers now come from the cache's snapshots
        again = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert engine.scheduler.num_overlapped_steps > 0
        assert_idle_and_consistent(engine)
    assert got == want and again == want


@pytest.mark.parametrize("model,verify_pays", [("llama", False), ("llama", True), ("mamba2", False)])
def test_speculation_overlaps_the_steps_whose_drafts_it_declines(llama_dir, tmp_path, model, verify_pays,
                                                                  monkeypatch):
    """With speculation, a step whose drafts the measured step times decline (here: every request drafts
    every step, and a verify step is made to look a thousand times dearer than a plain one) is left in
    flight, and up to UNDRAFTED_CHAIN steps chained after it without drafting, then one is scheduled
    synchronously to weigh drafts again; where drafts pay, every step stays synchronous. The greedy requests'
    outputs (a penalised one included) are those of plain synchronous decoding either way. (The sampled
    requests keep their distribution, not their samples, through a verify step: mixed steps verify their
    drafts whatever they cost.)"""
    from scheduler import stepping

    chain = 4
    monkeypatch.setattr(stepping, "UNDRAFTED_CHAIN", chain)
    path = llama_dir if model == "llama" else save_tiny_mamba2(str(tmp_path / "mamba2"))
    params = [dict(p, max_new_tokens=60) if p["max_new_tokens"] >= 20 else p for p in PARAMS]
    with Engine(model=path, disable_overlap_schedule=True, **BASE) as engine:
        want = generate(engine, params)
    with Engine(model=path, speculative_algorithm="ngram", **BASE) as engine:
        sched, spec = engine.scheduler, engine.scheduler.speculator
        spec.drafter = lambda req, k: np.arange(3, 3 + k, dtype=np.int32)  # (mostly rejected)
        spec.step_times.estimate = lambda shape: (1e-3 if verify_pays else 1.0) if shape[2] else 1e-3
        got = generate(engine, params)
        assert_idle_and_consistent(engine)
        if verify_pays:
            assert spec.verify_steps > 0 and spec.declined_steps == 0 and sched.num_overlapped_steps == 0
        else:
            assert spec.declined_steps > 0
            # at least one synchronous step (weighing drafts) in every UNDRAFTED_CHAIN + 1
            assert 30 <= sched.num_overlapped_steps <= sched.num_steps * chain // (chain + 1)
    greedy = [i for i, p in enumerate(params) if p["temperature"] == 0]
    assert greedy == [0, 1, 2, 5]
    # (a verify step's logits come from a batch of another shape: rounding differs by ~4e-6)
    assert_same([got[i] for i in greedy], [want[i] for i in greedy], atol=1e-5)


def test_a_draft_model_catches_up_after_an_undrafted_chain(llama_dir):
    """A standalone drafter (the model itself) whose drafts are declined for the first steps, while steps are
    chained without drafting, then verified: it catches up on the tokens it missed (a prefill chunk) and its
    drafts are accepted; the greedy outputs are plain decoding's."""
    greedy = [dict(temperature=0, max_new_tokens=50, ignore_eos=True)] * len(PROMPTS)
    with Engine(model=llama_dir, disable_overlap_schedule=True, **BASE) as engine:
        want = generate(engine, greedy)
    with Engine(model=llama_dir, speculative_algorithm="standalone", speculative_draft_model_path=llama_dir,
                **BASE) as engine:
        sched, spec = engine.scheduler, engine.scheduler.speculator
        spec.step_times.estimate = lambda shape: (1.0 if sched.num_steps < 25 else 1e-3) if shape[2] else 1e-3
        got = generate(engine, greedy)
        assert_idle_and_consistent(engine)
        assert sched.num_overlapped_steps > 10 and spec.declined_steps > 0
        assert spec.verify_steps > 0 and spec.accepted_tokens > 0
    assert_same(got, want, atol=1e-5)


def test_speculation_overlaps_full_steps(llama_dir):
    """A step whose decode rows fill the largest decode bucket has no room for a draft row: it verifies
    nothing, so it is left in flight like a step whose drafts were declined (synchronous before: on an H200,
    with 32 requests at 32 slots, such steps took 0.7-1.0 ms more than the plain engine's). Once requests
    finish, drafts are verified in the rows they leave (a drafter that is always right here). Greedy outputs
    are plain synchronous decoding's."""
    params = [dict(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (30, 30, 30, 30, 12, 12)]
    base = dict(BASE, max_running_requests=len(PROMPTS))
    with Engine(model=llama_dir, disable_overlap_schedule=True, **base) as engine:
        want = generate(engine, params)
    with Engine(model=llama_dir, speculative_algorithm="ngram", **base) as engine:
        sched, spec = engine.scheduler, engine.scheduler.speculator
        assert spec.buckets.max_decode == len(PROMPTS)
        outputs = {len(p): w["output_ids"] for p, w in zip(PROMPTS, want)}  # (the prompts' lengths differ)
        spec.drafter = lambda req, k: np.asarray(
            outputs[len(req.prompt_ids)][len(req.output_ids):][:k], np.int32)
        spec.step_times.estimate = lambda shape: 1e-3  # verify rows cost nothing: drafts always pay
        got = generate(engine, params)
        assert_idle_and_consistent(engine)
        assert sched.num_overlapped_steps >= 8  # most of the 11 decode steps that run all 6 (10 here)
        assert spec.verify_steps > 0 and spec.accepted_tokens > 0 and spec.declined_steps == 0
    assert_same(got, want, atol=1e-5)
