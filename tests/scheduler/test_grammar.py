"""Structured output: llguidance masks on the real SmolLM2 tokenizer keep random generations valid JSON."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from scheduler.grammar import GrammarBackend, GrammarMatcher, unpack_bitmask
from serve.tokenizer import Tokenizer, load_tokenizer

TOKENIZER_VOCAB = 49152
MODEL_VOCAB = TOKENIZER_VOCAB + 100  # not a multiple of 32: the last mask word is partly padding

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "paid": {"type": "boolean"},
        "lines": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "paid", "lines"],
    "additionalProperties": False,
}
FORMATS = {
    "json_object": ({"type": "json_object"}, {"type": "object"}),
    "person": (
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        PERSON,
    ),
    "order": ({"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}, ORDER),
}
# Tokens a "model" past its warm-up prefers: they close strings, containers and values quickly.
CLOSERS = ['"', "}", "]", '"}', '"]', "}]", "]}", ":", "true"]


@pytest.fixture(scope="module")
def tok(smollm2_gguf: str, cache_dir: str) -> Tokenizer:
    return load_tokenizer(smollm2_gguf, cache_dir)


@pytest.fixture(scope="module")
def backend(tok: Tokenizer) -> GrammarBackend:
    assert tok.vocab_size == TOKENIZER_VOCAB
    return GrammarBackend(tok.backend, MODEL_VOCAB, tok.eos_token_ids)


@pytest.fixture(scope="module")
def policy(tok: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The "model"'s token preferences: (closer ids, whitespace-only ids)."""
    closers = [tok.encode(s, add_special_tokens=False) for s in CLOSERS]
    blanks = [i for i in range(TOKENIZER_VOCAB) if not tok.decode([i]).strip(" \n\r\t")]
    return np.array([i[0] for i in closers if len(i) == 1]), np.array(blanks)


def allowed_ids(matcher: GrammarMatcher, backend: GrammarBackend) -> np.ndarray:
    words = np.zeros(backend.mask_words, np.int32)
    matcher.fill_bitmask(words)
    return np.flatnonzero(unpack_bitmask(words, backend.mask_words * 32))


def generate(
    matcher: GrammarMatcher,
    backend: GrammarBackend,
    policy: tuple[np.ndarray, np.ndarray],
    seed: int,
    max_tokens: int = 200,
) -> list[int]:
    """Sample uniformly among allowed tokens for a few steps, then prefer EOS, then closers, then anything
    but whitespace (like a model ending its answer), accepting each pick; returns the accepted ids."""
    closer_ids, blank_ids = policy
    rng = np.random.default_rng(seed)
    eos = list(backend.eos_token_ids)
    ids: list[int] = []
    while not matcher.is_terminated() and len(ids) < max_tokens:
        allowed = allowed_ids(matcher, backend)
        assert allowed.size and allowed[-1] < TOKENIZER_VOCAB  # never a padding id, never past the last word
        if len(ids) >= 12:
            for preferred in (np.intersect1d(allowed, eos), np.intersect1d(allowed, closer_ids)):
                if preferred.size:
                    allowed = preferred
                    break
            else:
                allowed = (
                    np.setdiff1d(allowed, blank_ids) if np.isin(allowed, blank_ids).mean() < 1 else allowed
                )
        token = int(rng.choice(allowed))
        assert matcher.accept_token(token)
        ids.append(token)
    return ids


def check_schema(value: Any, schema: dict[str, Any], path: str = "$") -> None:
    """The subset of JSON Schema the schemas above use (jsonschema is not a dependency)."""
    kind = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "boolean": bool}
    if kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), (path, value)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), (path, value)
    elif kind is not None:
        assert isinstance(value, types[kind]), (path, value)
    if "enum" in schema:
        assert value in schema["enum"], (path, value)
    if kind == "string":
        assert len(value) <= schema.get("maxLength", len(value)), (path, value)
    if kind == "array":
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)), (path, value)
        for i, item in enumerate(value):
            check_schema(item, schema.get("items", {}), f"{path}[{i}]")
    if kind == "object":
        properties = schema.get("properties", {})
        assert set(schema.get("required", [])) <= value.keys(), (path, value)
        if schema.get("additionalProperties") is False:
            assert value.keys() <= properties.keys(), (path, value)
        for key, item in value.items():
            check_schema(item, properties.get(key, {}), f"{path}.{key}")


def test_unpack_bitmask_hand_case():
    words = np.array([0b101, -(2**31)], np.int32)  # ids 0, 2 and 63
    np.testing.assert_array_equal(np.flatnonzero(unpack_bitmask(words, 64)), [0, 2, 63])
    np.testing.assert_array_equal(np.flatnonzero(unpack_bitmask(words, 40)), [0, 2])
    with pytest.raises(ValueError, match="fewer than"):
        unpack_bitmask(words, 65)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", FORMATS)
def test_random_generation_is_valid_json(name, seed, backend, tok, policy):
    response_format, schema = FORMATS[name]
    matcher = backend.compile(response_format)
    ids = generate(matcher, backend, policy, seed)
    assert matcher.is_terminated(), f"no EOS within 200 tokens: {tok.decode(ids)!r}"
    assert ids[-1] in tok.eos_token_ids and not any(i in tok.eos_token_ids for i in ids[:-1])
    text = tok.decode(ids)
    check_schema(json.loads(text), schema)


def test_complete_grammar_allows_only_eos(backend, tok):
    matcher = backend.compile(FORMATS["json_object"][0])
    for token in tok.encode('{"a": [1, "b"]}', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert not matcher.is_terminated()
    assert sorted(allowed_ids(matcher, backend)) == sorted(tok.eos_token_ids)
    assert matcher.accept_token(tok.eos_token_ids[-1]) and matcher.is_terminated()
    assert sorted(allowed_ids(matcher, backend)) == sorted(tok.eos_token_ids)


def test_disallowed_tokens_are_refused_without_changing_state(backend, tok):
    matcher = backend.compile(FORMATS["person"][0])
    prefix = tok.encode('{"name": "Al"', add_special_tokens=False)
    for token in prefix:
        assert matcher.accept_token(token)
    before = allowed_ids(matcher, backend)
    refused = [
        tok.encode("}", add_special_tokens=False)[0],  # "age", "role" and "tags" are required
        tok.encode("abc", add_special_tokens=False)[0],  # not JSON here
        tok.eos_token_ids[0],  # the grammar is not complete
        TOKENIZER_VOCAB + 5,  # a padding id of the model's vocabulary
        tok.encode("<|im_start|>", add_special_tokens=False)[0],  # a special token
    ]
    for token in refused:
        assert token not in before
        assert not matcher.accept_token(token)
    assert matcher.num_accepted == len(prefix)
    np.testing.assert_array_equal(allowed_ids(matcher, backend), before)
    assert matcher.accept_token(tok.encode(",", add_special_tokens=False)[0])  # still usable


@pytest.mark.parametrize(
    "response_format, message",
    [
        ({"type": "text"}, "not supported"),
        ({"type": "xml"}, "not supported"),
        ("json", "must be an object"),
        ({"type": "json_schema"}, "needs a 'json_schema' object"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "must be an object"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
            "Invalid type: foo",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}},
            "does not exist",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}, "Unimplemented keys"),
    ],
)
def test_bad_response_format_raises(backend, response_format, message):
    with pytest.raises(ValueError, match=message):
        backend.compile(response_format)


@pytest.mark.parametrize("name", ["person", "order"])
def test_rollback_then_reaccept_gives_the_same_masks(name, backend, tok, policy):
    reference = backend.compile(FORMATS[name][0])
    ids = generate(reference, backend, policy, seed=7)
    assert reference.is_terminated()
    replay = backend.compile(FORMATS[name][0])
    masks = []  # masks[i]: allowed ids before ids[i]; the last one after EOS
    for token in ids:
        masks.append(allowed_ids(replay, backend))
        assert replay.accept_token(token)
    masks.append(allowed_ids(replay, backend))
    for num_tokens in [1, 2, 5, len(ids)]:
        replay.rollback(num_tokens)
        kept = len(ids) - num_tokens
        assert replay.num_accepted == kept and not replay.is_terminated()
        np.testing.assert_array_equal(allowed_ids(replay, backend), masks[kept])
        for i in range(kept, len(ids)):
            assert replay.accept_token(ids[i])
            np.testing.assert_array_equal(allowed_ids(replay, backend), masks[i + 1])
        assert replay.is_terminated()
    with pytest.raises(ValueError, match="num_tokens"):
        replay.rollback(len(ids) + 1)


def test_rollback_replays_when_llguidance_refuses(backend, tok):
    class NoRollback:  # an llguidance matcher whose own rollback fails
        def __init__(self, inner):
            self.inner = inner

        def rollback(self, num_tokens):
            return False

        def __getattr__(self, name):
            return getattr(self.inner, name)

    matcher = backend.compile(FORMATS["person"][0])
    prefix = tok.encode('{"name": "Bo", "age": 4', add_special_tokens=False)
    for token in prefix + tok.encode('2, "role"', add_special_tokens=False):
        assert matcher.accept_token(token)
    matcher._matcher = NoRollback(matcher._matcher)
    matcher.rollback(matcher.num_accepted - len(prefix))
    fresh = backend.compile(FORMATS["person"][0])
    for token in prefix:
        assert fresh.accept_token(token)
    np.testing.assert_array_equal(allowed_ids(matcher, backend), allowed_ids(fresh, backend))


def test_model_vocab_padding_is_masked(backend, tok):
    words = np.zeros(backend.mask_words, np.int32)
    assert backend.mask_words == (MODEL_VOCAB + 31) // 32
    matcher = backend.compile(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string"}}}
    )
    matcher.fill_bitmask(words)
    bits = unpack_bitmask(words, backend.mask_words * 32)
    assert bits[:TOKENIZER_VOCAB].sum() > 10 and not bits[TOKENIZER_VOCAB:].any()
    with pytest.raises(ValueError, match="int32"):
        matcher.fill_bitmask(np.zeros(backend.mask_words - 1, np.int32))
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GrammarBackend(tok.backend, TOKENIZER_VOCAB - 1, tok.eos_token_ids)


def test_cached_compiles_are_independent_and_batch_fill_matches(backend, tok):
    first = backend.compile(FORMATS["order"][0])
    second = backend.compile(FORMATS["order"][0])  # from the cache
    for token in tok.encode('{"id": 3', add_special_tokens=False):
        assert first.accept_token(token)
    assert not np.array_equal(allowed_ids(first, backend), allowed_ids(second, backend))
    done = backend.compile(FORMATS["json_object"][0])
    for token in [*tok.encode("{}", add_special_tokens=False), tok.eos_token_ids[0]]:
        assert done.accept_token(token)
    rows = [first, None, second, done]
    batch = np.zeros((len(rows), backend.mask_words), np.int32)
    backend.fill_bitmasks(rows, batch)
    for row, matcher in enumerate(rows):
        expected = np.full(backend.mask_words, -1, np.int32)
        if matcher is not None:
            matcher.fill_bitmask(expected)
        np.testing.assert_array_equal(batch[row], expected)


def test_whitespace_runs_are_bounded(backend, tok):
    matcher = backend.compile(FORMATS["json_object"][0])
    space = tok.encode(" ", add_special_tokens=False)
    assert len(space) == 1 and matcher.accept_token(tok.encode("{", add_special_tokens=False)[0])
    for _ in range(32):  # the default max_whitespace: room to pretty-print
        assert matcher.accept_token(space[0])
    assert not matcher.accept_token(space[0])  # but no endless padding
    assert matcher.accept_token(tok.encode("}", add_special_tokens=False)[0])


@pytest.mark.parametrize("name", ["person", "order"])
def test_draft_masks_are_the_states_after_each_draft_token(name, backend, tok, policy):
    """Speculative decoding's draft-row masks (scheduler/speculative.py): the mask after each draft token is
    what accepting the draft up to it gives, the draft is cut at the first refused token, and the matcher
    is left as it was."""
    from scheduler.speculative import grammar_draft_masks

    response_format, _ = FORMATS[name]
    ids = generate(backend.compile(response_format), backend, policy, seed=3)
    matcher = backend.compile(response_format)
    for t in ids[:5]:
        assert matcher.accept_token(t)
    before = allowed_ids(matcher, backend)
    allowed_at_9 = allowed_ids(_after(backend, response_format, ids[:9]), backend)
    refused = int(np.setdiff1d(np.arange(TOKENIZER_VOCAB), allowed_at_9)[0])
    draft = np.array(ids[5:9] + [refused] + ids[10:12])
    masks = grammar_draft_masks(matcher, draft, backend.mask_words)
    assert len(masks) == 4  # cut at the refused token
    for i, mask in enumerate(masks):
        want = np.zeros(backend.mask_words, np.int32)
        _after(backend, response_format, ids[: 6 + i]).fill_bitmask(want)
        np.testing.assert_array_equal(mask, want)
    assert matcher.num_accepted == 5 and np.array_equal(allowed_ids(matcher, backend), before)


def _after(backend: GrammarBackend, response_format, ids: list[int]) -> GrammarMatcher:
    matcher = backend.compile(response_format)
    for t in ids:
        assert matcher.accept_token(t)
    return matcher
