"""Speculative decoding through the OpenAI API (`--speculative-algorithm ngram`, tiny Llama): greedy
completions, plain and streamed, match transformers' greedy tokens; a stop string ends the text where it
would without speculation; the server reports its drafts (/get_server_info, /metrics, meta_info)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.hf_reference import hf_greedy_recomputed
from tests.live_server import LiveServer
from tests.tiny_models import save_tiny_llama, write_word_tokenizer

pytest_plugins = ["tests.live_server"]

# A server of its own (10-20 s to start).
pytestmark = [pytest.mark.server, pytest.mark.slow]

VOCAB = 512
NAME = "tiny-llama-spec"
BASE = [7, 300, 41, 9, 123, 77, 5, 250]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    path = save_tiny_llama(str(tmp_path_factory.mktemp("served_llama_spec")))
    write_word_tokenizer(path, VOCAB)
    srv = LiveServer.start("--model", path, "--max-running-requests", "4", "--context-length", "256",
                           "--chunked-prefill-size", "64", "--served-model-name", NAME,
                           "--speculative-algorithm", "ngram", "--speculative-fixed-drafts",
                           "--speculative-ngram-min-match-window-size", "1")
    # base + the model's own continuation + base: tokens the model favours recur, so the drafter finds matches
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = BASE + hf_greedy_recomputed(model, BASE, 24) + BASE
    yield srv, model, prompt
    srv.stop()


def _text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


def test_greedy_completions_match_hf_plain_and_streamed(spec_server):
    srv, model, prompt = spec_server
    expected = hf_greedy_recomputed(model, prompt, 24)
    client = srv.client()
    before = srv.info()["speculative"]
    out = client.completions.create(model=NAME, prompt=_text(prompt), max_tokens=24, temperature=0)
    assert out.choices[0].text.split() == _text(expected).split()
    assert out.usage.completion_tokens == 24 and out.choices[0].finish_reason == "length"
    stream = client.completions.create(model=NAME, prompt=_text(prompt), max_tokens=24, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices).split() == _text(expected).split()
    # a stop string in the middle of the output: the text ends before it, as without speculation
    stop = f"t{expected[10]}"
    cut = expected[: expected.index(expected[10])]
    out = client.completions.create(model=NAME, prompt=_text(prompt), max_tokens=24, temperature=0,
                                    stop=[stop])
    assert out.choices[0].text.split() == _text(cut).split() and out.choices[0].finish_reason == "stop"
    server_info = srv.wait_idle()
    info = server_info["speculative"]
    assert info["enabled"] and info["algorithm"] == "ngram"
    # CPU's default with fixed drafts
    assert server_info["speculative_num_draft_tokens"] == info["num_draft_tokens"] == 4
    assert info["verify_steps"] > before["verify_steps"] and info["draft_tokens"] > before["draft_tokens"]
    metrics = srv.get("/metrics").text
    assert "xlaserve_spec_draft_tokens_total" in metrics


def test_native_generate_reports_the_requests_drafts(spec_server):
    srv, _, prompt = spec_server
    r = srv.post("/generate", {"input_ids": prompt,
                               "sampling_params": {"temperature": 0, "max_new_tokens": 24}})
    meta = r.json()["meta_info"]
    assert meta["completion_tokens"] == 24
    # the prompt that drafted in the test above drafts here too: its figures are consistent
    assert meta["spec_draft_tokens"] >= meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == 1 + meta["spec_accepted_tokens"] / meta["spec_verify_ct"]
    assert r.status_code == 200


@pytest.fixture(scope="module")
def smollm2_spec_server():
    """SmolLM2 with the shared server's flags plus ngram speculation."""
    from tests.live_server import SHARED_FLAGS

    srv = LiveServer.start(*SHARED_FLAGS, "--speculative-algorithm", "ngram")
    yield srv
    srv.stop()


GROUNDED = ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog, and the lazy dog "
            "does not move at all.")
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24},
                                     "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}


def test_smollm2_structured_and_plain_chat_match_the_server_without_speculation(server, smollm2_spec_server):
    """Greedy chats on the real model, with and without a JSON schema (the grammar masks every draft row with
    its state after the drafts before it): the same text as the shared server without speculation, and
    drafts accepted along the way."""
    import json

    from tests.live_server import MODEL

    before = smollm2_spec_server.info()["speculative"]
    asks = [dict(messages=[{"role": "user", "content": GROUNDED}], max_tokens=40),
            dict(messages=[{"role": "user", "content": "Describe a person with three hobbies as JSON."}],
                 max_tokens=160, response_format={"type": "json_schema",
                                                  "json_schema": {"name": "p", "schema": PERSON}})]
    for ask in asks:
        plain, spec = (s.client().chat.completions.create(model=MODEL, temperature=0, **ask)
                       for s in (server, smollm2_spec_server))
        assert spec.choices[0].message.content == plain.choices[0].message.content
        assert spec.choices[0].finish_reason == plain.choices[0].finish_reason
    assert spec.choices[0].finish_reason == "stop"
    assert set(json.loads(spec.choices[0].message.content)) == {"name", "age", "hobbies"}
    after = smollm2_spec_server.info()["speculative"]
    assert after["accepted_tokens"] > before["accepted_tokens"]
