"""Soak test against a live server: many mixed requests, some clients hanging up at random moments.

python -m bench.soak --base-url http://127.0.0.1:30000 --num-requests 5000 --concurrency 32

Counts lost/hung requests (no answer within --request-timeout), 5xx answers, and checks that once
idle the server's pools are entirely free and its allocator integrity holds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time

import httpx
import numpy as np

PROMPTS = ["Tell me a story about a dragon.", "What is 17 times 23?", "List three colors.",
           "Write a haiku about the sea.", "Explain photosynthesis briefly.", "Say hello in French.",
           "Why is the sky blue?", "Give me a JSON object with a name field."]


@dataclasses.dataclass
class SoakResult:
    num_requests: int
    completed: int
    disconnected: int
    errors_4xx: int
    errors_5xx: int
    lost: int  # no answer within the timeout
    duration_s: float
    requests_per_s: float
    p50_latency_s: float
    p99_latency_s: float
    idle_info: dict


async def _one(client: httpx.AsyncClient, i: int, rng: random.Random, model: str, disconnect: bool,
               timeout: float) -> tuple[str, float]:
    stream = rng.random() < 0.5
    chat = rng.random() < 0.5
    body = {"model": model, "max_tokens": rng.choice([1, 4, 8, 16]), "stream": stream,
            "temperature": rng.choice([0.0, 0.7, 1.2]), "top_p": rng.choice([1.0, 0.9]),
            "seed": i}
    if rng.random() < 0.2:
        body["frequency_penalty"] = 0.5
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS) * rng.choice([1, 3, 6])}]
    else:
        path = "/v1/completions"
        body["prompt"] = rng.choice(PROMPTS) * rng.choice([1, 3, 6])
    start = time.perf_counter()
    try:
        if disconnect:
            # Hang up at a random moment: before the answer, or after a few streamed chunks.
            async with client.stream("POST", path, json={**body, "stream": True, "max_tokens": 32}) as r:
                chunks = rng.randint(0, 3)
                async for _ in r.aiter_lines():
                    chunks -= 1
                    if chunks < 0:
                        break
            return "disconnected", time.perf_counter() - start
        if stream:
            async with client.stream("POST", path, json=body, timeout=timeout) as r:
                async for _ in r.aiter_lines():
                    pass
                status = r.status_code
        else:
            status = (await client.post(path, json=body, timeout=timeout)).status_code
    except httpx.TimeoutException:
        return "lost", time.perf_counter() - start
    kind = "ok" if status == 200 else ("5xx" if status >= 500 else "4xx")
    return kind, time.perf_counter() - start


async def soak(base_url: str, num_requests: int, concurrency: int, disconnect_frac: float = 0.1,
               seed: int = 0, request_timeout: float = 300.0, api_key: str | None = None) -> SoakResult:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=request_timeout,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)

        async def guarded(i):
            r = random.Random(rng.random())
            async with sem:
                return await _one(client, i, r, model, r.random() < disconnect_frac, request_timeout)

        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(i) for i in range(num_requests)))
        duration = time.perf_counter() - start
        # Idle: nothing running or waiting, every KV page free, allocator integrity intact.
        deadline = time.monotonic() + 30
        while True:
            info = (await client.get("/get_server_info")).json()
            idle = (info["num_running_requests"] == 0 and info["num_waiting_requests"] == 0
                    and info["free_tokens"] == info["max_total_tokens"])
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    kinds = [k for k, _ in results]
    latencies = np.array([t for k, t in results if k == "ok"] or [0.0])
    return SoakResult(
        num_requests=num_requests, completed=kinds.count("ok"), disconnected=kinds.count("disconnected"),
        errors_4xx=kinds.count("4xx"), errors_5xx=kinds.count("5xx"), lost=kinds.count("lost"),
        duration_s=duration, requests_per_s=num_requests / duration,
        p50_latency_s=float(np.percentile(latencies, 50)), p99_latency_s=float(np.percentile(latencies, 99)),
        idle_info={k: info.get(k) for k in ("num_running_requests", "num_waiting_requests", "free_tokens",
                                            "max_total_tokens", "integrity", "compiles_after_warmup")},
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect-frac", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    r = asyncio.run(soak(a.base_url, a.num_requests, a.concurrency, a.disconnect_frac, a.seed,
                         api_key=a.api_key))
    print(json.dumps(dataclasses.asdict(r), indent=2))
    ok = r.lost == 0 and r.errors_5xx == 0 and r.idle_info["integrity"] == "ok" and \
        r.idle_info["free_tokens"] == r.idle_info["max_total_tokens"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
