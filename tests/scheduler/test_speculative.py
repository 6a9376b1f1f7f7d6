"""Speculative decoding (scheduler/speculative.py): the engine with drafts verified in its decode step
against the engine without them (which is checked against transformers elsewhere): the same tokens,
logprobs and finishes for dense, MoE and MLA models, greedy and sampled, with drafts that are always right,
always wrong, or the ngram drafter's, alone and batched with requests that do not speculate and with
prefills; pages given back. Recurrent and hybrid models too (Mamba-2, Mamba-1, Nemotron-H, MiniMax, Ling
2.5, Qwen3-Next, Kimi-Linear): there each draft row continues the state of the row before it, and the state
after the last accepted draft becomes the request's (kernels/chains.py). The drafter and the cost model
alone: test_speculative_drafting.py."""

from __future__ import annotations

import numpy as np
import pytest

from scheduler.speculative import SpeculativeConfig, StepTimes
from serve import Engine
from serve.server_args import ServerArgs
from tests.helpers import assert_idle_and_consistent
from tests.scheduler.test_prefix_cache import BASE as CACHE_BASE
from tests.scheduler.test_prefix_cache import RECURRENT, _dense, _mla, _moe
from tests.scheduler.test_speculative_drafting import SIZES

# These tests check verification itself: every draft that fits is verified (the cost model that picks how many
# is tested on its own in test_speculative_drafting.py, and in an engine below, with given step times).
BASE = dict(CACHE_BASE, speculative_fixed_drafts=True)

NEW = 24



@pytest.mark.parametrize("kw,flag", [
    (dict(speculative_algorithm="eagle"), "speculative_algorithm"),
    (dict(speculative_algorithm="standalone"), "speculative_draft_model_path"),
    (dict(speculative_algorithm="ngram", speculative_draft_model_path="m"), "speculative_draft_model_path"),
    (dict(speculative_draft_model_path="m"), "speculative_draft_model_path"),
    (dict(speculative_algorithm="standalone", speculative_draft_model_path="m", speculative_num_steps=0),
     "speculative_num_steps"),
    (dict(speculative_algorithm="ngram", speculative_num_draft_tokens=0), "speculative_num_draft_tokens"),
    (dict(speculative_algorithm="ngram", speculative_num_draft_tokens=10**9), "speculative_num_draft_tokens"),
    (dict(speculative_algorithm="standalone", speculative_draft_model_path="m", speculative_num_steps=10**9),
     "speculative_num_steps"),
    (dict(speculative_algorithm="ngram", speculative_ngram_min_match_window_size=4), "min_match_window"),
])
def test_bad_speculative_flags_are_refused_by_name(kw, flag):
    with pytest.raises(ValueError, match=flag):
        ServerArgs(**kw)
    assert ServerArgs(speculative_algorithm="NGRAM").speculative_config() == SpeculativeConfig()
    # ngram drafts up to 7 tokens (steps weigh them), with fixed drafts 4 on CPU (each verify row costs) and
    # 7 elsewhere; standalone 4 (draft-model steps)
    assert ServerArgs(speculative_algorithm="ngram").speculative_config("cpu").num_draft_tokens == 7
    fixed = ServerArgs(speculative_algorithm="ngram", speculative_fixed_drafts=True)
    assert fixed.speculative_config("cpu").num_draft_tokens == 4
    assert fixed.speculative_config("gpu").num_draft_tokens == 7
    assert ServerArgs(speculative_algorithm="ngram", speculative_num_draft_tokens=3).speculative_config(
        "tpu").num_draft_tokens == 3
    standalone = ServerArgs(speculative_algorithm="standalone", speculative_draft_model_path="d")
    assert standalone.speculative_config("gpu").num_draft_tokens == 4


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves (the ngram drafter finds matches) and one that does not."""
    rng = np.random.default_rng(7)
    unit = rng.integers(3, vocab, size=9).tolist()
    return [unit * 5, rng.integers(3, vocab, size=37).tolist(), unit[:4] * 9 + unit, (unit * 3)[5:]]


def _run(engine: Engine, prompts, sampling: list[dict], drafter=None) -> list[dict]:
    if drafter is not None:
        engine.scheduler.speculator.drafter = drafter
    try:
        batched = engine.generate(input_ids=prompts, sampling_params=sampling, return_logprob=True)
        alone = [engine.generate(input_ids=p, sampling_params=s, return_logprob=True)
                 for p, s in zip(prompts, sampling)]
    finally:
        if drafter is not None:
            engine.scheduler.speculator.drafter = engine.scheduler.speculator.ngram
    assert_idle_and_consistent(engine)
    return batched + alone


def _same(got: list[dict], want: list[dict]) -> None:
    """The same tokens and finish reasons; logprobs within f32 rounding. A verify step sums a row's attention
    in other parts than a plain step (the pages its request's rows share, then its own, merged), so a logprob
    of magnitude ~5-7 may differ in its last ~20 ulps (measured: up to 5.7e-6, and 1.0e-5 once on Qwen3-Next
    with the AVX2 decode attention); a wrong state or position moves it by orders of magnitude more."""
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        np.testing.assert_allclose([lp for lp, _ in g["meta_info"]["output_token_logprobs"]],
                                   [lp for lp, _ in w["meta_info"]["output_token_logprobs"]],
                                   atol=1e-5, rtol=2e-6)


def _kimi_linear(tmp_path_factory) -> tuple[str, int]:
    """KDA state (updated in place by the native kernel in decode-only steps, draft rows chained by their
    slots) beside MLA latent pages."""
    from tests.models.test_hybrid_parity import VOCAB
    from tests.models.test_kimi_linear_parity import save_checkpoint

    path = str(tmp_path_factory.mktemp("kimi_linear"))
    save_checkpoint(path)
    return path, VOCAB


FAMILIES = {"dense": _dense, "moe": _moe, "mla": _mla, **RECURRENT, "kimi_linear": _kimi_linear}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path, vocab = FAMILIES[request.param](tmp_path_factory)
    prompts = _prompts(vocab)
    # greedy, and sampled (temperature, top-p, top-k; a seed per request), a stop token among them
    # (penalties on two of them: a draft row must count the drafts before it and not those after it)
    sampling = [{"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
                {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": NEW, "ignore_eos": True, "seed": 11},
                {"temperature": 0.7, "top_k": 20, "max_new_tokens": NEW, "ignore_eos": True, "seed": 5,
                 "frequency_penalty": 0.8, "presence_penalty": 0.5},
                {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True, "repetition_penalty": 1.5}]
    plain = Engine(model=path, **BASE)
    try:
        first = _run(plain, prompts, sampling)
        # a stop token inside the output of prompt 0 (greedy): speculation must stop where plain decoding did
        sampling[0] = dict(sampling[0], stop_token_ids=[first[0]["output_ids"][NEW // 2]])
        want = _run(plain, prompts, sampling)
    finally:
        plain.shutdown()
    # 1-token matches: random tiny models rarely repeat a bigram, and every draft row should get exercised
    engine = Engine(model=path, speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                    speculative_ngram_min_match_window_size=1, **BASE)
    yield dict(engine=engine, prompts=prompts, sampling=sampling, want=want, vocab=vocab)
    engine.shutdown()


def _oracle(want: list[dict], prompts):
    """A drafter proposing the plain run's own next tokens (every draft is accepted)."""
    futures = {tuple(p): w["output_ids"] for p, w in zip(prompts, want)}

    def draft(req, k):
        out = futures[tuple(req.prompt_ids)]
        return np.asarray(out[len(req.output_ids): len(req.output_ids) + k], np.int32)
    return draft


def test_no_draft_is_looked_up_where_none_can_fit(tmp_path):
    """Drafting is host work in every step: none is looked up while the decode rows fill the largest bucket
    (4 requests, buckets 1/2/4), and none after a request whose draft could fill the free rows (4 tokens
    each, at most 3 free rows: one lookup a step at most). Outputs are still plain decoding's."""
    from tests.tiny_models import save_tiny_llama

    path = save_tiny_llama(str(tmp_path / "llama"))
    prompts = _prompts(512)
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    kw = dict(BASE, max_running_requests=4)
    plain = Engine(model=path, **kw)
    try:
        want = plain.generate(input_ids=prompts[:3], sampling_params=[dict(params, max_new_tokens=n)
                                                                       for n in (NEW, 8, 16)])
    finally:
        plain.shutdown()
    engine = Engine(model=path, speculative_algorithm="ngram", speculative_num_draft_tokens=4, **kw)
    try:
        speculator, steps = engine.scheduler.speculator, []
        add = speculator.add_drafts

        def counted_add(works, reqs, table):
            steps.append([sum(w.num_rows for w in works if w.is_decode), 0])
            add(works, reqs, table)

        def counted_draft(req, k):
            steps[-1][1] += 1
            return np.resize(np.asarray(req.all_ids[-2:], np.int32), k)  # k tokens, mostly wrong
        speculator.add_drafts, speculator.drafter = counted_add, counted_draft
        full = engine.generate(input_ids=prompts, sampling_params=params)  # 4 at once: mostly full steps
        assert any(rows == 4 for rows, _ in steps)
        assert all(calls == 0 for rows, calls in steps if rows == 4)
        assert max(calls for _, calls in steps) == 1
        steps.clear()
        got = engine.generate(input_ids=prompts[:3], sampling_params=[dict(params, max_new_tokens=n)
                                                                       for n in (NEW, 8, 16)])
        assert_idle_and_consistent(engine)
    finally:
        engine.shutdown()
    assert len(full) == 4 and [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert max(calls for _, calls in steps) == 1  # 3 decoding requests, one free row: the first fills it
    assert any(calls for rows, calls in steps if rows < 4)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "always_right", "always_wrong"])
def test_speculation_gives_the_tokens_of_plain_decoding(family, drafter):
    """Greedy and seeded sampled requests, batched and alone: the same tokens, logprobs and finish reasons
    with drafts verified as without, whether every draft is accepted, none is, or the ngram drafter's."""
    engine, prompts, want = family["engine"], family["prompts"], family["want"]
    s = engine.scheduler.speculator
    before = (s.verify_steps, s.draft_tokens, s.accepted_tokens)
    fn = {"ngram": None, "always_right": _oracle(want, prompts),
          "always_wrong": lambda req, k: (np.asarray(_oracle(want, prompts)(req, k)) + 1) % family["vocab"]}
    got = _run(engine, prompts, family["sampling"], fn[drafter])
    _same(got, want)
    steps, drafts, accepted = (a - b for a, b in zip(
        (s.verify_steps, s.draft_tokens, s.accepted_tokens), before))
    assert steps > 0 and drafts > 0
    if drafter == "always_right":
        # every draft accepted, except those past a stop; each verify step gains 1 + accepted tokens
        assert accepted >= 0.9 * drafts
        assert steps < 0.5 * sum(len(w["output_ids"]) for w in want)
    elif drafter == "always_wrong":
        assert accepted == 0
    metas = [g["meta_info"] for g in got]
    assert all(m["spec_verify_ct"] >= 1 for m in metas if "spec_verify_ct" in m)
    assert sum(m.get("spec_draft_tokens", 0) for m in metas) == drafts


@pytest.mark.slow
def test_speculation_with_other_requests_and_prefills_in_the_step(family):
    """Requests with penalties next to ones with min_new_tokens (holding stop tokens
    back in the draft rows too), arriving while others decode (prefill chunks in the verify steps):
    everyone's tokens are the plain engine's."""
    engine, prompts = family["engine"], family["prompts"]
    # the greedy run's own tokens as stop tokens: without min_new_tokens they would end it early
    first = engine.generate(input_ids=prompts[1], sampling_params={"temperature": 0, "max_new_tokens": NEW,
                                                                    "ignore_eos": True})["output_ids"]
    sampling = [{"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True, "frequency_penalty": 0.5},
                {"temperature": 0, "max_new_tokens": NEW, "min_new_tokens": NEW // 2,
                 "stop_token_ids": first[2: NEW // 2]},
                {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
                {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}]
    long = prompts[1] * 3  # a long prompt, chunked over several steps while the others decode
    batch, params = prompts + [long], sampling + [sampling[2]]
    plain = Engine(model=engine.args.model, **BASE)
    try:
        want = plain.generate(input_ids=batch, sampling_params=params, return_logprob=True)
    finally:
        plain.shutdown()
    for drafter in (None, _oracle(want, batch)):  # ngram's drafts, then always-right ones from the start
        if drafter is not None:
            engine.scheduler.speculator.drafter = drafter
        try:
            spec = engine.generate(input_ids=batch, sampling_params=params, return_logprob=True)
        finally:
            engine.scheduler.speculator.drafter = engine.scheduler.speculator.ngram
        assert_idle_and_consistent(engine)
        _same(spec, want)
    assert spec[0]["meta_info"]["spec_verify_ct"] > 0  # the request with penalties speculated too


@pytest.mark.slow
def test_recurrent_drafts_are_capped_by_the_scratch_state_slots(tmp_path):
    """A recurrent model gets scratch state slots for its draft rows (and says so); a step never verifies
    more draft rows than there are, and the engine still gives plain decoding's tokens."""
    from tests.tiny_models import save_tiny_mamba2

    path = save_tiny_mamba2(str(tmp_path / "mamba2"))
    prompts = _prompts(512)
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    plain = Engine(model=path, **BASE)
    try:
        want = plain.generate(input_ids=prompts, sampling_params=params)
    finally:
        plain.shutdown()
    # 32 decode rows: 8 requests with 3 drafts each would fill 32, the 12 scratch slots allow 12 draft rows
    engine = Engine(model=path, speculative_algorithm="ngram", speculative_num_draft_tokens=3,
                    **dict(BASE, max_running_requests=32))
    try:
        slots = engine.scheduler.runner.cfg.draft_state_slots
        assert slots == 3 * 4  # 3 drafts for each of up to 4 requests (pool_sizing.DRAFTING_REQUESTS)
        assert engine.scheduler.speculative_info()["enabled"] is True
        rows = []
        speculator = engine.scheduler.speculator
        add = speculator.add_drafts

        def counted(works, reqs, table):
            add(works, reqs, table)
            rows.append(sum(len(w.draft) for w in works if w.draft is not None))
        speculator.add_drafts = counted
        speculator.drafter = _oracle(want, prompts)  # always k right tokens: more than fit, none rejected
        got = engine.generate(input_ids=prompts * 2, sampling_params=params)
        assert_idle_and_consistent(engine)
    finally:
        engine.shutdown()
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want] * 2
    assert max(rows) == slots


@pytest.fixture(scope="module")
def standalone_models(tmp_path_factory):
    """A tiny Llama target, drafters for it (itself; another random Llama; one with a larger vocabulary), and
    a Nemotron-H hybrid target with a Llama drafter of its vocabulary."""
    from tests.models.test_hybrid_parity import VOCAB as HYBRID_VOCAB
    from tests.scheduler.test_prefix_cache import _nemotron_h
    from tests.tiny_models import save_tiny_llama

    root = tmp_path_factory.mktemp("standalone")
    target = save_tiny_llama(str(root / "target"))
    return dict(target=target, other=save_tiny_llama(str(root / "other"), seed=5),
                wide=save_tiny_llama(str(root / "wide"), seed=6, vocab_size=600),
                hybrid=_nemotron_h(tmp_path_factory)[0],
                hybrid_drafter=save_tiny_llama(str(root / "hybrid_drafter"), seed=7, vocab_size=HYBRID_VOCAB))


@pytest.mark.slow
@pytest.mark.parametrize("target,drafter", [("target", "target"), ("target", "other"), ("target", "wide"),
                                            ("hybrid", "hybrid_drafter")])
def test_standalone_draft_model_gives_the_tokens_of_plain_decoding(standalone_models, target, drafter):
    """`--speculative-algorithm standalone`: the draft model proposes each request's draft; greedy and seeded
    sampled requests, batched and alone, with prompts longer than a step's prefill budget (the draft model
    catches up over several steps) get plain decoding's tokens and logprobs. The model as its own drafter
    has its greedy drafts accepted; a draft model with a larger vocabulary has drafts outside the model's
    cut."""
    path = standalone_models[target]
    vocab = 512 if target == "target" else 300
    prompts = _prompts(vocab) + [np.random.default_rng(1).integers(3, vocab, size=80).tolist()]
    sampling = [{"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
                {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": NEW, "ignore_eos": True, "seed": 11},
                {"temperature": 0.7, "top_k": 20, "max_new_tokens": NEW, "ignore_eos": True, "seed": 5},
                {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
                {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}]
    plain = Engine(model=path, **BASE)
    try:
        want = _run(plain, prompts, sampling)
    finally:
        plain.shutdown()
    engine = Engine(model=path, speculative_algorithm="standalone", speculative_num_steps=3,
                    speculative_draft_model_path=standalone_models[drafter], **BASE)
    checked = []
    try:
        drafter_ = engine.scheduler.speculator.model_drafter
        if drafter == target:  # same weights: the draft pool's K/V must equal the model's where it is right
            propose = drafter_.propose

            def checking(items):
                table = engine.scheduler.req_to_token
                for req, _ in items:
                    pos = np.arange(req.draft_computed)
                    page = table.page_size
                    slots = table.table[req.row, pos // page] * page + pos % page
                    want_k = np.asarray(engine.runner.pools.kv.k[:, slots])
                    np.testing.assert_allclose(np.asarray(drafter_.runner.pools.kv.k[:, slots]), want_k,
                                               atol=1e-4, rtol=1e-4)
                    checked.append(len(pos))
                return propose(items)
            drafter_.propose = checking
        got = _run(engine, prompts, sampling)
        info = engine.scheduler.speculative_info()
    finally:
        engine.shutdown()
    assert drafter != target or sum(checked) > 100
    _same(got, want)
    assert info["num_draft_tokens"] == 3 and info["draft_model_steps"] > 0 and info["draft_tokens"] > 0
    if drafter == target:
        greedy = [g["meta_info"] for g, s in zip(got, sampling * 2) if s["temperature"] == 0]
        accepted = sum(m["spec_accepted_tokens"] for m in greedy)
        assert accepted >= 0.9 * sum(m["spec_draft_tokens"] for m in greedy)


@pytest.mark.slow
def test_standalone_refuses_what_cannot_draft(standalone_models, tmp_path):
    from tests.tiny_models import save_tiny_mamba2

    mamba = save_tiny_mamba2(str(tmp_path / "mamba2"))
    with pytest.raises(ValueError, match="recurrent layers are not supported in a draft model"):
        Engine(model=standalone_models["target"], speculative_algorithm="standalone",
               speculative_draft_model_path=mamba, **BASE)
    with pytest.raises(ValueError, match="needs a model with attention layers"):
        Engine(model=mamba, speculative_algorithm="standalone",
               speculative_draft_model_path=standalone_models["target"], **BASE)


@pytest.mark.slow
def test_sampled_tokens_follow_the_models_distribution_with_speculation(tmp_path):
    """Temperature 1, thousands of seeds, a tiny vocabulary: the joint distribution of the first three output
    tokens with speculation on (drafts proposed at every step, so the second and third tokens are often
    sampled by draft rows) matches the one transformers' forward gives, by a chi-square test."""
    import torch
    import transformers
    from scipy.stats import chi2

    from tests.tiny_models import save_tiny_llama

    vocab, n = 8, 4000
    path = save_tiny_llama(str(tmp_path / "v8"), seed=3, vocab_size=vocab, initializer_range=0.3)
    prompt = [1, 5, 3, 6, 4]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    grid = np.array([[a, b] for a in range(vocab) for b in range(vocab)])
    with torch.no_grad():
        ids = torch.tensor([prompt + [a, b] for a, b in grid])
        probs = torch.softmax(hf(ids).logits[:, -3:].double(), -1).numpy()  # [64, 3, V]
    # p(o1) p(o2 | o1) p(o3 | o1, o2) for every (o1, o2, o3)
    joint = probs[:, 0, grid[:, 0]].diagonal()[:, None] * probs[:, 1, grid[:, 1]].diagonal()[:, None] \
        * probs[:, 2, :]
    engine = Engine(model=path, speculative_algorithm="ngram", speculative_num_draft_tokens=2,
                    **dict(BASE, max_running_requests=32))
    try:
        def likely(req, k):  # the most likely next two tokens: most drafts are accepted
            o1 = req.output_ids[0]
            d1 = int(probs[o1 * vocab, 1].argmax())
            return np.array([d1, int(probs[o1 * vocab + d1, 2].argmax())][:k], np.int32)
        engine.scheduler.speculator.drafter = likely
        outs = [o for part in range(0, n, 1000) for o in engine.generate(
            input_ids=[prompt] * 1000, sampling_params=[
                {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True, "seed": s}
                for s in range(part, part + 1000)])]
        accepted = engine.scheduler.speculator.accepted_tokens
        # (a vocabulary smaller than the top-logprobs width: every token once, in order)
        top = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1}, return_logprob=True,
                              top_logprobs_num=20)["meta_info"]["output_top_logprobs"][0]
    finally:
        engine.shutdown()
    assert sorted(t for _, t, *_ in top) == list(range(vocab))
    assert accepted > n // 2  # many second and third tokens came from draft rows
    counts = np.zeros((vocab * vocab, vocab))
    for o in outs:
        a, b, c = o["output_ids"]
        counts[a * vocab + b, c] += 1
    expected = (joint * n).ravel()
    observed = counts.ravel()
    rare = expected < 5  # cells too rare for the test are pooled into one
    e = np.append(expected[~rare], expected[rare].sum())
    o_ = np.append(observed[~rare], observed[rare].sum())
    stat = ((o_ - e) ** 2 / e).sum()
    assert chi2.sf(stat, len(e) - 1) > 1e-3, (stat, len(e))



def _tiny_llama_engine(tmp_path, **kw):
    from tests.tiny_models import save_tiny_llama

    path = save_tiny_llama(str(tmp_path / "llama"))
    return path, Engine(model=path, speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                        speculative_ngram_min_match_window_size=1, **dict(CACHE_BASE, **kw))


class _GivenTimes(StepTimes):
    """Step times from a formula of the rows (the test's machine), recording the shapes the steps had."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds, self.shapes = seconds, []

    def record(self, shape, seconds):
        self.shapes.append(shape)

    def estimate(self, shape):
        return self.seconds(shape[0])


def test_speculation_turns_itself_off_where_verify_rows_cost_more_than_they_yield(tmp_path):
    """The scheduler times its decode steps (by shape); with given costs, draft rows that cost as much as a
    step are declined (no draft verified) and free ones taken, the tokens the plain engine's either way.
    One request at a time: a step with a prefill verifies drafts in its decode section's padding rows."""
    prompts = _prompts(512)
    params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    path, engine = _tiny_llama_engine(tmp_path)
    got = {}
    try:
        speculator = engine.scheduler.speculator
        assert speculator.info()["adaptive"] and speculator.info()["declined_steps"] == 0
        engine.generate(input_ids=prompts[0], sampling_params=params)  # measured: the step shapes it ran
        assert speculator.step_times.steps > 0
        assert all(rows in SIZES and width >= 1 for rows, width, _ in speculator.step_times.table)
        for name, seconds in (("costly", lambda rows: float(rows)), ("free", lambda rows: 1.0)):
            speculator.step_times = _GivenTimes(seconds)
            before = speculator.info()
            got[name] = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
            after = speculator.info()
            got[name + " verified"] = after["verify_steps"] - before["verify_steps"]
            got[name + " declined"] = after["declined_steps"] - before["declined_steps"]
            assert speculator.step_times.shapes  # the scheduler recorded its decode steps
        assert got["costly verified"] == 0 and got["costly declined"] > 0
        assert got["free verified"] > 0 and got["free declined"] == 0
        assert_idle_and_consistent(engine)
    finally:
        engine.shutdown()
    plain = Engine(model=path, **CACHE_BASE)
    try:
        want = [plain.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    finally:
        plain.shutdown()
    assert got["costly"] == want and got["free"] == want


@pytest.mark.parametrize("fixed", [False, True])
def test_only_unweighed_drafts_back_off_after_a_wholly_rejected_one(tmp_path, fixed):
    """A request whose drafts are always wrong: where drafts are weighed it drafts at every step (its
    rejections lower its acceptance rate, hence its rows; here verify rows are free, so every step verifies
    one), where they are not (`--speculative-fixed-drafts`) it skips drafting for 1, 3, 7, 15 steps after
    each wholly rejected draft. The tokens are the plain engine's either way."""
    prompt = _prompts(512)[0]
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    path, engine = _tiny_llama_engine(tmp_path, speculative_fixed_drafts=fixed, disable_overlap_schedule=True)
    try:
        speculator = engine.scheduler.speculator
        speculator.step_times = _GivenTimes(lambda rows: 1.0)
        speculator.drafter = lambda req, k: np.full(k, 3, np.int32)  # (token 3 is never the greedy pick here)
        got = engine.generate(input_ids=prompt, sampling_params=params)
        assert_idle_and_consistent(engine)
        info = speculator.info()
    finally:
        engine.shutdown()
    plain = Engine(model=path, **CACHE_BASE)
    try:
        want = plain.generate(input_ids=prompt, sampling_params=params)
    finally:
        plain.shutdown()
    assert got["output_ids"] == want["output_ids"] and 3 not in want["output_ids"]
    assert info["accepted_tokens"] == 0
    # 39 decode steps, the last of which has no room for a draft (its token is the request's last)
    assert info["verify_steps"] == (1 + 1 + 1 + 1 + 1 if fixed else 38)
