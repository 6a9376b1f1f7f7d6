"""One request failing inside the scheduler (while scheduling, building the batch, running the step or
finishing a token) aborts that request only: the others finish with exactly the tokens they get without it,
the loop goes on, and nothing leaks."""

from __future__ import annotations

import numpy as np
import pytest

import runtime.batch_builder as batch_builder
from runtime.sampling_params import SamplingParams
from scheduler import Req
from serve import Engine
from tests.helpers import greedy
from tests.tiny_models import save_tiny_llama

GREEDY_DICT = greedy(12)
GREEDY = SamplingParams(**GREEDY_DICT)
ENGINE = dict(in_process=True, dtype="float32", max_running_requests=4, chunked_prefill_size=32,
              context_length=128, max_total_tokens=1024, skip_tokenizer_init=True)
PROMPTS = [[5, 9, 14, 3, 77], list(range(10, 50)), [300, 2, 8], list(range(100, 120))]
VICTIM = 1  # the request that fails; it is mid-batch with the others


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine(model=save_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama"))), **ENGINE)
    yield eng
    eng.shutdown()


def make_reqs(tag: str, grammar=None) -> list[Req]:
    return [Req(rid=f"{tag}-{i}", prompt_ids=list(p), params=GREEDY, seed=i,
                grammar=grammar if i == VICTIM else None) for i, p in enumerate(PROMPTS)]


def run(engine: Engine, reqs: list[Req]) -> dict[str, list[int]]:
    """Steps until every request finished; returns the tokens each request was reported to produce."""
    sched = engine.scheduler
    for r in reqs:
        sched.add_request(r)
    streamed = {r.rid: [] for r in reqs}
    steps = 0
    while sched.has_work():
        for out in sched.step():
            streamed[out.rid] += out.new_ids
        steps += 1
        assert steps < 200, "the scheduler did not finish"
    sched.check_integrity()
    assert sched.num_available_tokens == sched.capacity_tokens, "pages leaked"
    assert not sched.live
    return streamed


@pytest.fixture(scope="module")
def reference(engine):
    reqs = make_reqs("ref")
    streamed = run(engine, reqs)
    assert all(r.finish_reason.type == "length" for r in reqs)
    assert len({tuple(v) for v in streamed.values()}) == len(PROMPTS), "random model is degenerate"
    return [streamed[r.rid] for r in reqs]


class FlakyGrammar:
    """Allows every token, but raises on the `fail_at`-th call of `method` (a grammar engine's bug)."""

    def __init__(self, method: str, fail_at: int):
        self.method, self.fail_at, self.calls = method, fail_at, 0

    def _count(self, method: str) -> None:
        if method == self.method:
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError(f"injected failure in {method}")

    def fill_bitmask(self, mask: np.ndarray) -> None:
        self._count("fill_bitmask")
        mask[:] = -1

    def accept_token(self, token: int) -> bool:
        self._count("accept_token")
        return True

    def is_terminated(self) -> bool:
        return False


def check_isolated(reqs: list[Req], streamed: dict[str, list[int]], reference: list[list[int]], what: str):
    victim = reqs[VICTIM]
    assert victim.finish_reason.type == "abort" and victim.finish_reason.status == 500, victim.finish_reason
    assert what in victim.finish_reason.message
    for i, r in enumerate(reqs):
        if i != VICTIM:
            assert r.finish_reason.type == "length", (i, r.finish_reason)
            assert streamed[r.rid] == r.output_ids == reference[i], f"request {i} changed"


@pytest.mark.parametrize("method, fail_at", [("fill_bitmask", 4), ("accept_token", 3)])
def test_a_grammar_failure_aborts_only_its_request(engine, reference, method, fail_at):
    reqs = make_reqs(f"grammar-{method}", FlakyGrammar(method, fail_at))
    streamed = run(engine, reqs)
    check_isolated(reqs, streamed, reference, f"injected failure in {method}")
    assert len(streamed[reqs[VICTIM].rid]) == fail_at - 1  # the tokens before the failure were delivered


def test_a_batch_building_failure_aborts_only_its_request(engine, reference, monkeypatch):
    fold = batch_builder.fold_seed  # called for every work the builder lays out (prefill and decode)
    calls = {"n": 0}

    def flaky_fold(seed):
        if seed == VICTIM:
            calls["n"] += 1
            if calls["n"] >= 5:  # mid-run, after its prefill and some decode steps; from then on it stays bad
                raise ValueError("injected failure in the batch builder")
        return fold(seed)

    monkeypatch.setattr(batch_builder, "fold_seed", flaky_fold)
    reqs = make_reqs("build")
    streamed = run(engine, reqs)
    check_isolated(reqs, streamed, reference, "injected failure in the batch builder")


def test_a_failed_step_aborts_its_requests_and_the_next_ones_run(engine, reference, monkeypatch):
    runner = engine.scheduler.runner
    step = runner.step
    calls = {"n": 0}

    def flaky_step(batch, shape):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device failure")
        return step(batch, shape)

    monkeypatch.setattr(runner, "step", flaky_step)
    reqs = make_reqs("device")
    run(engine, reqs)
    # Nothing pins a device failure on one request: the step's requests are all aborted, with the reason.
    assert all(r.finish_reason.type == "abort" and "injected device failure" in r.finish_reason.message
               for r in reqs)
    after = make_reqs("after")
    streamed = run(engine, after)
    assert [streamed[r.rid] for r in after] == reference


def test_engine_generate_rejects_bad_values_with_a_value_error(engine, reference):
    bad = [
        ({"input_ids": [1, 10**6]}, "outside the vocabulary"),
        ({"input_ids": [1, 2**31]}, "input_ids"),
        ({"input_ids": [1.5, 2]}, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"seed": [1]}}, "seed"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 2**31}}, "top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": float("nan")}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [10**6]}}, "outside the vocabulary"),
        ({"input_ids": [1, 2], "sampling_params": {"logit_bias": dict.fromkeys(range(65), 1)}}, "logit_bias"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
        ({"input_ids": [1, 2], "top_logprobs_num": 10**9, "return_logprob": True}, "top_logprobs_num"),
    ]
    for kwargs, what in bad:
        with pytest.raises(ValueError, match=what):
            engine.generate(**kwargs)
    engine.scheduler.check_integrity()
    # NumPy ints are ints; a seed of any 64-bit value is accepted (folded to the sampler's 32 bits).
    out = engine.generate(input_ids=np.asarray(PROMPTS[0]),
                          sampling_params={**GREEDY_DICT, "seed": 2**63 - 1})
    assert out["output_ids"] == reference[0]
