"""`Engine()` by default drives the server's scheduler and detokenizer processes over ZMQ: same results
as the in-process scheduler, and no processes left behind."""

from __future__ import annotations

import pytest

from serve import Engine

SETTINGS = dict(dtype="float32", max_running_requests=8, chunked_prefill_size=128, context_length=512,
                max_total_tokens=4096)  # the smollm2_engine fixture's, so compiled programs are shared


@pytest.fixture(scope="module")
def process_engine(smollm2_gguf):
    engine = Engine(model=smollm2_gguf, **SETTINGS)
    yield engine
    procs = list(engine._backend.children.procs.values())
    engine.shutdown()
    assert not any(p.is_alive() for p in procs), "child processes survived shutdown"


def test_chat_answers_paris(process_engine):
    out = process_engine.chat([{"role": "user", "content": "What is the capital of France?"}],
                              sampling_params={"temperature": 0, "max_new_tokens": 32})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_same_outputs_and_logprobs_as_in_process(process_engine, smollm2_engine):
    prompts = ["Once upon a time", "The three primary colors are", "def fibonacci(n):"]
    params = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    kwargs = dict(return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    ours = process_engine.generate(prompt=prompts, sampling_params=params, **kwargs)
    ref = smollm2_engine.generate(prompt=prompts, sampling_params=params, **kwargs)
    for a, b in zip(ours, ref):
        assert a["output_ids"] == b["output_ids"]
        assert a["text"] == b["text"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got, want = a["meta_info"][key], b["meta_info"][key]
            assert [t for _, t in got] == [t for _, t in want]
            diffs = [abs(x - y) for (x, _), (y, _) in zip(got, want) if x is not None]
            assert max(diffs) < 1e-4, max(diffs)
        assert len(a["meta_info"]["output_top_logprobs"]) == 20


def test_stop_string_trimmed_and_bad_request_refused(process_engine):
    base = process_engine.generate(prompt="The alphabet starts with A, B, C,",
                                   sampling_params={"temperature": 0, "max_new_tokens": 16})
    words = base["text"].split()
    stop = words[1]
    out = process_engine.generate(prompt="The alphabet starts with A, B, C,",
                                  sampling_params={"temperature": 0, "max_new_tokens": 16, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == base["text"][: base["text"].find(stop)]
    with pytest.raises(ValueError, match="exceeds the limit"):
        process_engine.generate(input_ids=[5] * 600, sampling_params={"max_new_tokens": 4})
    assert process_engine.server_info()["free_tokens"] == 4096
