"""bench.serving's workloads: random token prompts, ShareGPT conversations, shared-prefix groups."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np

DATASETS = ("random", "sharegpt", "generated-shared-prefix")


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request to send: the prompt text, its token ids (what /generate gets) and the lengths to expect."""

    prompt: str
    prompt_ids: tuple[int, ...]  # the tokenizer's ids of `prompt`, without added special tokens
    output_len: int  # max_tokens to ask for (exactly this many come back with ignore_eos)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def _normal_ids(tokenizer) -> np.ndarray:
    """Every vocabulary id except special tokens (which decode to control text like "<|im_end|>")."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)


def random_text(tokenizer, rng: np.random.Generator, num_tokens: int,
                pool: np.ndarray) -> tuple[str, list[int]]:
    """Text decoded from `num_tokens` random ids, adjusted so that it re-encodes to `num_tokens` ids.

    Decoding then encoding random ids merges or splits tokens, so the text is trimmed (too long) or
    extended with more random ids (too short) a few times; the returned ids are the text's real encoding,
    whose length may still differ from `num_tokens` by a token or two when no round trip is stable.
    """
    ids = rng.choice(pool, size=num_tokens).tolist()
    text = tokenizer.decode(ids)
    for _ in range(8):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == num_tokens:
            break
        if len(ids) > num_tokens:
            ids = ids[:num_tokens]
        else:
            ids = ids + rng.choice(pool, size=num_tokens - len(ids)).tolist()
        text = tokenizer.decode(ids)
    return text, tokenizer.encode(text, add_special_tokens=False)


def _lengths(rng: np.random.Generator, n: int, full: int, range_ratio: float) -> list[int]:
    """`n` lengths uniform over the integers in [max(1, range_ratio * full), full]."""
    low = max(1, int(range_ratio * full))
    return rng.integers(low, full + 1, size=n).tolist()


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                    seed: int) -> list[BenchRequest]:
    """`num_prompts` prompts of random vocabulary tokens; lengths uniform in [ratio * len, len]."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"{range_ratio=} must be in [0, 1]")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"{input_len=} and {output_len=} must be >= 1")
    rng = np.random.default_rng(seed)
    pool = _normal_ids(tokenizer)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        text, ids = random_text(tokenizer, rng, n_in, pool)
        out.append(BenchRequest(text, tuple(ids), n_out))
    return out


def sharegpt_requests(path: str, tokenizer, num_prompts: int, seed: int, fixed_output_len: int | None = None,
                      max_total_len: int | None = None) -> list[BenchRequest]:
    """Prompts from a local ShareGPT JSON file: a list of {"conversations": [{"from", "value"}, ...]}.

    The prompt is the first human turn; the output length is the token length of the first gpt reply
    after it (or `fixed_output_len`). Conversations are shuffled with `seed`; those without such a pair,
    with an empty side, or longer than `max_total_len` tokens in all are skipped. Returns at most
    `num_prompts` requests (fewer if the file has fewer usable ones); raises ValueError if it has none.
    """
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise TypeError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    out: list[BenchRequest] = []
    for i in order:
        if len(out) == num_prompts:
            break
        turns = data[i].get("conversations") or data[i].get("conversation") or []
        human = next((j for j, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if human is None:
            continue
        reply = next((t for t in turns[human + 1:] if t.get("from") in ("gpt", "assistant")), None)
        prompt = turns[human].get("value") or ""
        if reply is None or not prompt or not reply.get("value"):
            continue
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        n_out = fixed_output_len or len(tokenizer.encode(reply["value"], add_special_tokens=False))
        if not ids or n_out < 1 or (max_total_len is not None and len(ids) + n_out > max_total_len):
            continue
        out.append(BenchRequest(prompt, tuple(ids), n_out))
    if not out:
        raise ValueError(f"{path}: no usable conversation (a human turn followed by a gpt reply)")
    return out


def shared_prefix_requests(tokenizer, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                           question_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """`num_groups * prompts_per_group` prompts: each group's share one random system prompt, each prompt
    adds its own random question. Shuffled with `seed` so groups interleave as they would in traffic."""
    for name, v in (("num_groups", num_groups), ("prompts_per_group", prompts_per_group),
                    ("system_prompt_len", system_prompt_len), ("question_len", question_len),
                    ("output_len", output_len)):
        if v < 1:
            raise ValueError(f"{name}={v} must be >= 1")
    rng = np.random.default_rng(seed)
    pool = _normal_ids(tokenizer)
    out = []
    for _ in range(num_groups):
        system, _ = random_text(tokenizer, rng, system_prompt_len, pool)
        for _ in range(prompts_per_group):
            question, _ = random_text(tokenizer, rng, question_len, pool)
            prompt = f"{system}\n\n{question}"
            out.append(BenchRequest(prompt, tuple(tokenizer.encode(prompt, add_special_tokens=False)),
                                    output_len))
    random.Random(seed).shuffle(out)
    return out
