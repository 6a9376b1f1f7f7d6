"""End to end with the official `openai` client: chat, completions, streaming, n, stop, logprobs, JSON."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.register_assert_rewrite("tests.live_server")  # before its import, so its asserts explain failures
from tests.live_server import MODEL, chat_prompt_ids  # noqa: E402

pytest_plugins = ["tests.live_server"]

POEM = [{"role": "user", "content": "Write a short poem about the sea."}]


def _stream_chat(client, **kw) -> tuple[dict[int, str], dict[int, list[str]], list]:
    """Text per choice index, finish reasons per index (every non-null one seen), and all chunks."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    return texts, finishes, chunks


@pytest.mark.server
@pytest.mark.slow
def test_chat_stream_equals_non_stream_and_usage_counts_tokens(server, hf_tokenizer):
    client = server.client()
    full = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=24, temperature=0,
                                          logprobs=True)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(chat_prompt_ids(hf_tokenizer, POEM))
    assert full.usage.completion_tokens == len(choice.logprobs.content) == 24
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    texts, finishes, chunks = _stream_chat(client, messages=POEM, max_tokens=24, temperature=0,
                                           stream_options={"include_usage": True})
    assert texts == {0: choice.message.content}
    assert finishes == {0: ["length"]}
    # include_usage: one last chunk without choices carrying the whole request's usage, and only that one.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    streamed = chunks[-1].usage.model_dump()
    # The same prompt again: the prefix cache now holds every whole page of it but the last token's.
    prompt = full.usage.prompt_tokens
    assert streamed.pop("prompt_tokens_details")["cached_tokens"] == (prompt - 1) // 16 * 16
    assert streamed == {k: v for k, v in full.usage.model_dump().items() if k != "prompt_tokens_details"}
    assert all(ch.usage is None for ch in chunks[:-1])


@pytest.mark.server
def test_chat_stream_without_include_usage_has_no_usage_chunk(server):
    _, finishes, chunks = _stream_chat(server.client(), messages=POEM, max_tokens=4, temperature=0)
    assert finishes == {0: ["length"]}
    assert all(ch.usage is None and ch.choices for ch in chunks)


@pytest.mark.server
def test_finish_reason_stop_when_the_model_ends_and_length_at_max_tokens(server):
    client = server.client()
    question = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    ended = client.chat.completions.create(model=MODEL, messages=question, max_tokens=60, temperature=0)
    assert ended.choices[0].finish_reason == "stop"
    assert "4" in ended.choices[0].message.content
    assert ended.usage.completion_tokens < 60
    assert "<|im_end|>" not in ended.choices[0].message.content  # the end token is not text

    cut = client.chat.completions.create(model=MODEL, messages=question, max_tokens=2, temperature=0)
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == 2
    assert ended.choices[0].message.content.startswith(cut.choices[0].message.content)


@pytest.mark.server
def test_completion_stream_equals_non_stream(server):
    client = server.client()
    prompt = "The three primary colors are"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 20
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.text for ch in chunks for c in ch.choices)
    assert text == full.choices[0].text
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


@pytest.mark.server
@pytest.mark.slow
def test_n2_with_seed_gives_two_reproducible_choices(server):
    client = server.client()
    kw = dict(model=MODEL, messages=POEM, max_tokens=12, temperature=1.0, n=2, seed=1234)
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.message.content for c in first.choices]
    assert all(texts)
    assert texts[0] != texts[1], "the two choices of one request should be different samples"
    assert [c.message.content for c in again.choices] == texts
    assert first.usage.completion_tokens == 24  # both choices count

    streamed, finishes, _ = _stream_chat(client, **{k: v for k, v in kw.items() if k != "model"})
    assert streamed == {0: texts[0], 1: texts[1]}
    assert finishes == {0: ["length"], 1: ["length"]}


@pytest.mark.server
@pytest.mark.slow
def test_stop_string_trims_the_text_before_it(server):
    client = server.client()
    full = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    words = text.split(" ")
    stop = " " + " ".join(words[4:6])  # a two-word stop string from the middle of the greedy output
    at = text.find(stop)
    assert at > 0, (text, stop)

    cut = client.chat.completions.create(model=MODEL, messages=POEM, max_tokens=40, temperature=0,
                                         stop=[stop, "never-appears-xyz"])
    assert cut.choices[0].message.content == text[:at]
    assert cut.choices[0].finish_reason == "stop"

    texts, finishes, _ = _stream_chat(client, messages=POEM, max_tokens=40, temperature=0, stop=stop)
    assert texts == {0: text[:at]}  # the stream never sends a prefix of the stop string it then takes back
    assert finishes == {0: ["stop"]}


@pytest.mark.server
def test_chat_logprobs_have_the_requested_shape_and_match_generate(server, hf_tokenizer):
    r = server.client().chat.completions.create(model=MODEL, messages=POEM, max_tokens=8, temperature=0,
                                                logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert t.top_logprobs[0].token == t.token  # greedy picks the most likely token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)
        assert t.bytes == list(t.token.encode())

    ids = chat_prompt_ids(hf_tokenizer, POEM)
    g = server.post("/generate", {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 3,
                                  "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    assert g.status_code == 200, g.text
    meta = g.json()["meta_info"]
    assert meta["prompt_tokens"] == r.usage.prompt_tokens
    out = meta["output_token_logprobs"]
    assert [hf_tokenizer.decode([tid]) for _, tid in out] == [t.token for t in content]
    assert [lp for lp, _ in out] == pytest.approx([t.logprob for t in content], abs=1e-4)
    for top, t in zip(meta["output_top_logprobs"], content, strict=True):
        assert [lp for lp, _ in top] == pytest.approx([a.logprob for a in t.top_logprobs], abs=1e-4)


@pytest.mark.server
def test_completion_echo_returns_prompt_plus_completion_with_logprobs(server):
    client = server.client()
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                       logprobs=2)
    c = echoed.choices[0]
    assert c.text == prompt + plain.choices[0].text
    n_prompt, n_out = echoed.usage.prompt_tokens, echoed.usage.completion_tokens
    assert n_out == 6
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == n_prompt + n_out
    assert "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    g = server.post("/generate", {"text": prompt, "return_logprob": True,
                                  "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
    assert g.status_code == 200, g.text
    assert [x for x, _ in g.json()["meta_info"]["output_token_logprobs"]] == pytest.approx(
        lp.token_logprobs[n_prompt:], abs=1e-4)


@pytest.mark.server
def test_completion_echo_first_token_has_no_top_logprobs(server):
    r = server.client().completions.create(model=MODEL, prompt="Hello there", max_tokens=1, echo=True,
                                           logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None


@pytest.mark.server
def test_completion_logprobs_k_without_echo(server):
    r = server.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                           temperature=0, logprobs=4)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 4
        assert top[tok] == pytest.approx(val, abs=1e-6) and val == pytest.approx(max(top.values()), abs=1e-6)


@pytest.mark.server
def test_completion_list_of_prompts_answers_each_in_order(server):
    client = server.client()
    prompts = ["One, two, three,", "The opposite of hot is", "def fibonacci(n):"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 18


def _validate(value, schema: dict) -> None:
    """A tiny JSON-schema check: type, properties, required, additionalProperties, enum."""
    kind = schema.get("type")
    types = {"object": dict, "string": str, "integer": int, "number": (int, float), "boolean": bool,
             "array": list}
    if kind:
        assert isinstance(value, types[kind]), (value, schema)
        assert not (kind in ("integer", "number") and isinstance(value, bool)), (value, schema)
    if "enum" in schema:
        assert value in schema["enum"], (value, schema)
    if kind == "object":
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value), (value, schema)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), (value, schema)
        for k, v in value.items():
            if k in props:
                _validate(v, props[k])
    if kind == "array" and "items" in schema:
        for v in value:
            _validate(v, schema["items"])


PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "mood": {"type": "string", "enum": ["happy", "sad"]}},
          "required": ["name", "age", "mood"], "additionalProperties": False}


def test_validator_rejects_what_it_should():
    _validate({"name": "a", "age": 3, "mood": "sad"}, PERSON)
    for bad in ({"name": "a", "age": 3}, {"name": "a", "age": "3", "mood": "sad"},
                {"name": "a", "age": 3, "mood": "ok"}, {"name": "a", "age": 3, "mood": "sad", "x": 1}, [1]):
        with pytest.raises(AssertionError):
            _validate(bad, PERSON)


@pytest.mark.server
@pytest.mark.slow
def test_json_schema_response_validates(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON}}
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=80,
        temperature=0, response_format=fmt)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    _validate(json.loads(r.choices[0].message.content), PERSON)


ASK_JSON = 'Reply with a JSON object with one key "answer" holding the number 4.'


@pytest.mark.server
@pytest.mark.slow
def test_json_object_response_parses(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK_JSON}], max_tokens=120, temperature=0,
        response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.server
@pytest.mark.slow
def test_32_concurrent_streams_all_complete(server):
    async def one(client, i: int):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}], max_tokens=12,
            temperature=0.7, seed=i, stream=True)
        text, finishes = "", []
        async for ch in stream:
            for c in ch.choices:
                text += c.delta.content or ""
                if c.finish_reason:
                    finishes.append(c.finish_reason)
        return text, finishes

    async def main():
        client = server.async_client(timeout=300)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 32
    for text, finishes in results:
        assert text.strip()
        assert len(finishes) == 1 and finishes[0] in ("stop", "length")
    server.wait_idle()


@pytest.mark.server
@pytest.mark.slow
def test_multi_turn_chat_finds_the_earlier_turns_in_the_prefix_cache(server, hf_tokenizer):
    """Each turn resends the conversation: its cached tokens cover every whole page of the previous turn's
    prompt, and the prefix cache's answer matches a flushed, uncached recomputation token for token."""
    client = server.client()
    messages = [{"role": "system", "content": "You answer in one short sentence."}]
    previous_prompt = 0
    for turn, question in enumerate(["Name a color.", "Name a fruit of that color.", "Name an animal.",
                                     "Name a city."]):
        messages.append({"role": "user", "content": question})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        prompt = len(chat_prompt_ids(hf_tokenizer, messages))
        assert r.usage.prompt_tokens == prompt
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert cached % 16 == 0 and cached < prompt
        if turn:
            assert cached >= previous_prompt // 16 * 16, (turn, cached, previous_prompt)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        previous_prompt = prompt
    server.wait_idle()
    assert server.post("/flush_cache").json()["success"]
    uncached = client.chat.completions.create(model=MODEL, messages=messages[:-1], max_tokens=12,
                                              temperature=0)
    assert uncached.usage.prompt_tokens_details.cached_tokens == 0
    assert uncached.choices[0].message.content == messages[-1]["content"]
