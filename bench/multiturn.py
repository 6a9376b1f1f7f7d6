"""Multi-turn chat against a live server: each turn resends the whole conversation (as chat clients do).

python -m bench.multiturn --base-url http://127.0.0.1:30000 --num-conversations 4 --num-turns 8

Conversations run concurrently, each turn after the previous answer. Reports, per turn, the median time
to first token and the prompt tokens and cached prompt tokens (`usage.prompt_tokens_details`) the server
reports: with a prefix cache, a late turn's TTFT should stay near the first turn's although its prompt
grows; without one it grows with the conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time

import numpy as np
import openai

# Plain words, so that message lengths in words stay close to lengths in tokens for any tokenizer.
WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government number "
         "night point home water room mother area money story fact month lot right study book eye job word "
         "business issue side kind head house service friend father power hour game line end member law car "
         "city community name president team minute idea kid body information back parent face others level "
         "office door health person art war history party result change morning reason research girl guy "
         "moment air teacher force education").split()


@dataclasses.dataclass
class Turn:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


async def conversation(client: openai.AsyncOpenAI, model: str, rng: np.random.Generator, num_turns: int,
                       system_len: int, user_len: int, output_len: int) -> list[Turn]:
    """One conversation of `num_turns` turns; each sends the whole history and appends the answer."""
    messages = [{"role": "system", "content": _words(rng, system_len)}]
    turns = []
    for _ in range(num_turns):
        messages.append({"role": "user", "content": _words(rng, user_len)})
        start = time.perf_counter()
        first, text, usage = None, "", None
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=output_len, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.perf_counter()
                    text += choice.delta.content
            usage = chunk.usage or usage
        if first is None or usage is None:
            raise RuntimeError("the server streamed no content or no usage")
        details = usage.prompt_tokens_details
        turns.append(Turn(first - start, usage.prompt_tokens, details.cached_tokens if details else 0,
                          usage.completion_tokens))
        messages.append({"role": "assistant", "content": text})
    return turns


async def run(base_url: str, num_conversations: int, num_turns: int, system_len: int, user_len: int,
              output_len: int, seed: int, api_key: str | None = None) -> list[list[Turn]]:
    """Every conversation's turns (conversations concurrent, turns in order)."""
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "none",
                                max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    rngs = [np.random.default_rng(seed + i) for i in range(num_conversations)]
    try:
        return list(await asyncio.gather(*(conversation(client, model, rng, num_turns, system_len, user_len,
                                                        output_len) for rng in rngs)))
    finally:
        await client.close()


def summary(results: list[list[Turn]]) -> list[dict]:
    """Per turn: medians over the conversations."""
    out = []
    for i in range(len(results[0])):
        turn = [conv[i] for conv in results]
        out.append({"turn": i + 1, "ttft_s": statistics.median(t.ttft_s for t in turn),
                    "prompt_tokens": statistics.median(t.prompt_tokens for t in turn),
                    "cached_tokens": statistics.median(t.cached_tokens for t in turn)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-conversations", type=int, default=4)
    p.add_argument("--num-turns", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=256, help="words")
    p.add_argument("--user-len", type=int, default=64, help="words per user message")
    p.add_argument("--output-len", type=int, default=32, help="max tokens per answer")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="append the per-turn summary as one JSON line")
    a = p.parse_args(argv)
    for name in ("num_conversations", "num_turns", "system_prompt_len", "user_len", "output_len"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    results = asyncio.run(run(a.base_url, a.num_conversations, a.num_turns, a.system_prompt_len, a.user_len,
                              a.output_len, a.seed, a.api_key))
    rows = summary(results)
    print(f"{'turn':>4} {'TTFT p50 (s)':>13} {'prompt tokens':>14} {'cached':>8}")
    for r in rows:
        print(f"{r['turn']:>4} {r['ttft_s']:>13.3f} {r['prompt_tokens']:>14.0f} {r['cached_tokens']:>8.0f}")
    print(f"last turn / first turn TTFT: {rows[-1]['ttft_s'] / rows[0]['ttft_s']:.2f}x")
    if a.output_file:
        with open(a.output_file, "a") as f:
            f.write(json.dumps({"args": vars(a), "turns": rows}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
