"""Online serving benchmark of any OpenAI-compatible server over HTTP (like SGLang's bench_serving).

python -m bench.serving --base-url http://127.0.0.1:30000 --dataset-name random --random-input-len 128 \
    --random-output-len 128 --num-prompts 64 --max-concurrency 16 --output-file serving.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence

import httpx
import numpy as np
from tqdm import tqdm

from bench.datasets import DATASETS, BenchRequest, random_requests, shared_prefix_requests, sharegpt_requests

BACKENDS = {"openai-completions": "/v1/completions", "openai-chat": "/v1/chat/completions",
            "sglang-native": "/generate"}
STAT_NAMES = ("ttft", "tpot", "itl", "e2e_latency")  # each reported as mean/median/p90/p99 in ms
# Server-side settings worth keeping next to the numbers (the keys an xlaserve /get_server_info has).
SERVER_KEYS = ("model_path", "device", "dtype", "context_length", "max_total_tokens", "max_running_requests",
               "chunked_prefill_size", "page_size", "num_continuous_decode_steps", "schedule_policy",
               "disable_radix_cache", "disable_overlap_schedule", "quantization", "kv_cache_dtype",
               "activation_quantization", "speculative_algorithm")


@dataclasses.dataclass
class RequestResult:
    """What one request measured; times in seconds, `start` relative to the start of the run."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the server's count (usage / meta_info) when it gives one, else the dataset's
    output_len: int = 0
    ttft: float = 0.0  # to the first chunk that carries output
    e2e: float = 0.0
    # one gap per output token after the first chunk
    itl: list[float] = dataclasses.field(default_factory=list)
    start: float = 0.0


def spread_tokens(estimates: Sequence[int], gaps: Sequence[float], total: int) -> list[int]:
    """Tokens per streamed chunk, >= 1 each and summing to `total` (when `total` >= the chunk count).

    `estimates` are the tokenizer's counts of each chunk's text (re-encoding merges tokens, so they are only
    a hint); tokens beyond one per chunk go where the estimates put them, or else to the chunks that waited
    longest (`gaps`; a chunk that waited two decode steps carried two tokens, the first chunk excluded).
    """
    n = len(estimates)
    counts = [1] * n
    extra = total - n
    if n == 0 or extra <= 0:
        return counts
    weights = [max(e - 1, 0) for e in estimates]
    if sum(weights) == 0:
        weights = [0.0] + [max(g, 0.0) for g in gaps[1:]]
    if sum(weights) == 0:
        weights = [1.0] * n
    shares = [extra * w / sum(weights) for w in weights]
    floors = [int(s) for s in shares]
    by_remainder = sorted(range(n), key=lambda i: shares[i] - floors[i], reverse=True)
    for i in by_remainder[: extra - sum(floors)]:
        floors[i] += 1
    return [c + f for c, f in zip(counts, floors)]


def itl_of(times: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Inter-token latencies: chunk i >= 1 spreads its gap evenly over the `counts[i]` tokens it carried."""
    out: list[float] = []
    for i in range(1, len(times)):
        out += [(times[i] - times[i - 1]) / counts[i]] * counts[i]
    return out


class Backend:
    """Builds one request body for a server API and reads its streamed or whole responses."""

    def __init__(self, name: str, model: str, ignore_eos: bool, stream: bool, extra: dict, tokenizer):
        if name not in BACKENDS:
            raise ValueError(f"backend {name!r} is unknown; known: {', '.join(BACKENDS)}")
        self.name, self.path, self.model = name, BACKENDS[name], model
        self.ignore_eos, self.stream, self.extra, self.tokenizer = ignore_eos, stream, extra, tokenizer

    def body(self, req: BenchRequest) -> dict:
        if self.name == "sglang-native":
            params = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": self.ignore_eos}
            return {"input_ids": list(req.prompt_ids), "sampling_params": params, "stream": self.stream,
                    **self.extra}
        body: dict = {"model": self.model, "max_tokens": req.output_len, "temperature": 0.0,
                      "stream": self.stream}
        if self.name == "openai-chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True  # SGLang's extra parameter; also accepted by vLLM
        return {**body, **self.extra}

    def event(self, ev: dict, text_so_far: str) -> tuple[str, int | None, dict | None]:
        """One streamed event -> (new text, total output tokens so far if known, usage if given)."""
        if self.name == "sglang-native":
            meta = ev.get("meta_info", {})
            usage = {"prompt_tokens": meta.get("prompt_tokens"),
                     "completion_tokens": meta.get("completion_tokens")}
            return ev.get("text", "")[len(text_so_far):], meta.get("completion_tokens"), usage
        text = ""
        for choice in ev.get("choices") or []:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        return text, None, ev.get("usage")

    def whole(self, body: dict) -> tuple[str, dict | None]:
        """A non-streamed response -> (text, usage if given)."""
        if self.name == "sglang-native":
            meta = body.get("meta_info", {})
            return body.get("text", ""), {"prompt_tokens": meta.get("prompt_tokens"),
                                          "completion_tokens": meta.get("completion_tokens")}
        choice = (body.get("choices") or [{}])[0]
        return choice.get("text") or (choice.get("message") or {}).get("content") or "", body.get("usage")

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0


async def send_request(client: httpx.AsyncClient, backend: Backend, req: BenchRequest) -> RequestResult:
    """Sends `req` and measures it; never raises (a failure is a result with `error` set)."""
    res = RequestResult(prompt_len=req.prompt_len)
    times: list[float] = []
    texts: list[str] = []
    known: list[int | None] = []  # cumulative output tokens per chunk when the server says (native API)
    text, usage, done = "", None, False
    start = time.perf_counter()
    try:
        if backend.stream:
            async with client.stream("POST", backend.path, json=backend.body(req)) as resp:
                if resp.status_code != 200:
                    raw = (await resp.aread()).decode(errors="replace")
                    res.error = f"HTTP {resp.status_code}: {raw[:300]}"
                    return res
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    ev = json.loads(data)
                    if "error" in ev:
                        res.error = f"error event: {json.dumps(ev['error'])[:300]}"
                        return res
                    new_text, total, ev_usage = backend.event(ev, text)
                    usage = ev_usage or usage
                    grew = total is not None and total > ((known[-1] or 0) if known else 0)
                    if new_text or grew:
                        times.append(time.perf_counter() - start)
                        texts.append(new_text)
                        known.append(total)
                    text += new_text
            if not done:
                res.error = "the stream ended without [DONE]"
                return res
        else:
            resp = await client.post(backend.path, json=backend.body(req))
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                return res
            text, usage = backend.whole(resp.json())
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    usage = usage or {}
    res.prompt_len = usage.get("prompt_tokens") or req.prompt_len
    res.output_len = usage.get("completion_tokens") or backend.count(text)
    res.ttft = times[0] if times else res.e2e
    if known and all(k is not None for k in known):
        counts = [b - a for a, b in zip([0] + known[:-1], known)]
    else:
        gaps = [b - a for a, b in zip([0.0] + times[:-1], times)]
        counts = spread_tokens([backend.count(t) for t in texts], gaps, res.output_len)
    res.itl = itl_of(times, counts)
    res.success = True
    return res


async def run_requests(client: httpx.AsyncClient, backend: Backend, requests: list[BenchRequest],
                       request_rate: float, max_concurrency: int | None, seed: int,
                       disable_tqdm: bool) -> tuple[list[RequestResult], float, int]:
    """Sends `requests` with Poisson arrivals at `request_rate`/s (inf: all at once), at most
    `max_concurrency` in flight; returns (results in request order, duration s, peak requests in flight)."""
    rng = np.random.default_rng(seed)
    if math.isinf(request_rate):
        arrivals = np.zeros(len(requests))
    else:
        arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / request_rate, len(requests) - 1))])
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    in_flight = peak = 0
    bar = tqdm(total=len(requests), disable=disable_tqdm, desc="requests", unit="req")
    start = time.perf_counter()

    async def one(req: BenchRequest, at: float) -> RequestResult:
        nonlocal in_flight, peak
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with sem:
            in_flight += 1
            peak = max(peak, in_flight)
            sent = time.perf_counter() - start
            try:
                res = await send_request(client, backend, req)
            finally:
                in_flight -= 1
                bar.update(1)
        res.start = sent
        return res

    results = await asyncio.gather(*(one(r, float(a)) for r, a in zip(requests, arrivals)))
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration, peak


def _stats(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    v = np.asarray(values_s, dtype=np.float64) * 1000.0
    pick = {"mean": np.mean, "median": np.median, "p90": lambda x: np.percentile(x, 90),
            "p99": lambda x: np.percentile(x, 99)}
    return {f"{k}_{name}_ms": (float(f(v)) if v.size else None) for k, f in pick.items()}


def compute_metrics(results: Sequence[RequestResult], duration: float, peak: int) -> dict:
    """Throughputs (per second of `duration`) and latency statistics over the successful requests."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    m = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration, "input_throughput": total_in / duration,
         "output_throughput": total_out / duration, "total_throughput": (total_in + total_out) / duration,
         "max_concurrency_reached": peak, "mean_concurrency": sum(r.e2e for r in ok) / duration}
    m.update(_stats("ttft", [r.ttft for r in ok]))
    m.update(_stats("tpot", [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]))
    m.update(_stats("itl", [x for r in ok for x in r.itl]))
    m.update(_stats("e2e_latency", [r.e2e for r in ok]))
    m["errors"] = sorted({r.error for r in results if not r.success})[:5]
    return m


# ---- command line ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.serving", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--backend", choices=list(BACKENDS), default="openai-completions",
                   help="openai-completions sends the raw prompt text, sglang-native its token ids")
    p.add_argument("--model", default=None,
                   help="model name in requests (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("XLASERVE_API_KEY"))
    p.add_argument("--tokenizer", default=None,
                   help="HF dir, .gguf or alias (default: the server's model_path, "
                   "else the default model)")
    p.add_argument("--cache-dir", default=None, help="where tokenizers and pulled models are cached")
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (for --dataset-name sharegpt)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [ratio * len, len]")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="instead of each reply's length")
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests/s of Poisson arrivals; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed copies of the first request")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="exact output lengths (default: on for random and generated-shared-prefix)")
    p.add_argument("--disable-stream", action="store_true", help="TTFT is then the whole latency")
    p.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--output-file", default=None, help="append the run's result as one JSON line")
    p.add_argument("--output-details", action="store_true",
                   help="per-request lengths and latencies in the JSON")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def _get_json(client: httpx.Client, path: str) -> dict:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        r = client.get(path)
        if r.status_code == 200:
            return r.json()
    return {}


def load_bench_tokenizer(ns: argparse.Namespace, server_info: dict):
    """The tokenizer to build prompts with: --tokenizer, else the server's own (when the path is local here),
    else the default model's."""
    from serve.model_source import resolve_model
    from serve.server_args import ServerArgs
    from serve.tokenizer import load_tokenizer

    cache_dir = ServerArgs(cache_dir=ns.cache_dir).resolved_cache_dir()
    path = ns.tokenizer or server_info.get("tokenizer_path") or server_info.get("model_path")
    if not ns.tokenizer and not (path and os.path.exists(path)):
        path = None  # a remote server's path, or none reported
    return load_tokenizer(resolve_model(path, cache_dir), cache_dir)


def build_requests(ns: argparse.Namespace, tokenizer, context_length: int | None) -> list[BenchRequest]:
    if ns.dataset_name == "random":
        return random_requests(tokenizer, ns.num_prompts, ns.random_input_len, ns.random_output_len,
                               ns.random_range_ratio, ns.seed)
    if ns.dataset_name == "sharegpt":
        if not ns.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a local ShareGPT JSON file)")
        return sharegpt_requests(ns.dataset_path, tokenizer, ns.num_prompts, ns.seed, ns.sharegpt_output_len,
                                 context_length)
    return shared_prefix_requests(tokenizer, ns.gsp_num_groups, ns.gsp_prompts_per_group,
                                  ns.gsp_system_prompt_len, ns.gsp_question_len, ns.gsp_output_len, ns.seed)


def _client_host() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {"node": platform.node(), "cpu": cpu, "num_cpus": os.cpu_count(),
            "python": platform.python_version()}


def format_table(r: dict) -> str:
    def row(label: str, value) -> str:
        if value is None:
            value = "n/a"
        elif isinstance(value, float):
            value = f"{value:.2f}"
        return f"{label:<42}{value:>16}"

    lines = [f"{' Serving Benchmark Result ':=^58}",
             row("Backend:", r["backend"]), row("Dataset:", r["dataset_name"]),
             row("Traffic request rate:", r["request_rate"]),
             row("Max request concurrency:", r["max_concurrency"]),
             row("Max concurrency reached:", r["max_concurrency_reached"]),
             row("Successful requests:", r["completed"]), row("Failed requests:", r["failed"]),
             row("Benchmark duration (s):", r["duration_s"]),
             row("Total input tokens:", r["total_input_tokens"]),
             row("Total generated tokens:", r["total_output_tokens"]),
             row("Request throughput (req/s):", r["request_throughput"]),
             row("Input token throughput (tok/s):", r["input_throughput"]),
             row("Output token throughput (tok/s):", r["output_throughput"]),
             row("Total token throughput (tok/s):", r["total_throughput"]),
             row("Mean concurrency:", r["mean_concurrency"]),
             row("Server retractions during run:", r.get("server_retractions")),
             row("Server steps during run:", r.get("server_steps")),
             row("Of them overlapped (next built early):", r.get("server_overlapped_steps")),
             row("Server compiles during run:", r.get("server_compiles_during_run"))]
    if "spec_verify_steps" in r:
        lines += [row("Speculative verify steps:", r["spec_verify_steps"]),
                  row("Mean accepted length (tokens/step):", r["spec_accept_length"]),
                  row("Draft acceptance rate:", r["spec_acceptance_rate"])]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-Token Latency", "e2e_latency": "End-to-End Latency"}
    for name in STAT_NAMES:
        lines.append(f"{titles[name]:-^58}")
        short = name.split("_")[0].upper()
        for k in ("mean", "median", "p90", "p99"):
            lines.append(row(f"{k.capitalize()} {short} (ms):", r[f"{k}_{name}_ms"]))
    lines.append("=" * 58)
    return "\n".join(lines)


def run_benchmark(ns: argparse.Namespace) -> dict:
    """Runs one benchmark as `ns` (from `build_parser`) says; prints the table, appends the JSON line to
    --output-file, and returns the result record. Raises RuntimeError if the warm-up requests fail."""
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    with httpx.Client(base_url=ns.base_url, headers=headers, timeout=30, trust_env=False) as sync:
        info = _get_json(sync, "/get_server_info")
        model = ns.model or ((_get_json(sync, "/v1/models").get("data") or [{}])[0].get("id"))
    if not model and ns.backend != "sglang-native":
        raise RuntimeError(f"no --model given and GET {ns.base_url}/v1/models named none")
    tokenizer = load_bench_tokenizer(ns, info)
    requests = build_requests(ns, tokenizer, info.get("context_length"))
    ignore_eos = ns.ignore_eos if ns.ignore_eos is not None else ns.dataset_name != "sharegpt"
    extra = json.loads(ns.extra_request_body) if ns.extra_request_body else {}
    backend = Backend(ns.backend, model, ignore_eos, not ns.disable_stream, extra, tokenizer)
    result = asyncio.run(_run(ns, backend, requests, headers))
    with httpx.Client(base_url=ns.base_url, headers=headers, timeout=30, trust_env=False) as sync:
        after = _get_json(sync, "/get_server_info")
    record = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "backend": ns.backend, "base_url": ns.base_url,
        "model": model, "dataset_name": ns.dataset_name, "num_prompts": len(requests),
        "request_rate": ns.request_rate if math.isfinite(ns.request_rate) else "inf",
        "max_concurrency": ns.max_concurrency, "seed": ns.seed, "ignore_eos": ignore_eos,
        "stream": not ns.disable_stream, "random_input_len": ns.random_input_len,
        "random_output_len": ns.random_output_len, "random_range_ratio": ns.random_range_ratio,
        "server": {k: info[k] for k in SERVER_KEYS if k in info},
        # xlaserve does not report its device; the benchmark's host is the device when base_url is local
        "device": info.get("device", "not reported by the server"), "client_host": _client_host(),
        "server_retractions": _delta(info, after, "num_retractions"),
        # steps the server ran, and those dispatched while the step before ran (its overlap schedule)
        "server_steps": _delta(info, after, "num_steps"),
        "server_overlapped_steps": _delta(info, after, "num_overlapped_steps"),
        "server_compiles_during_run": _delta(info, after, "compiles_after_warmup"),
        **_speculative_stats(info, after),
        **result,
    }
    print(format_table(record))
    if ns.output_file:
        with open(ns.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def _speculative_stats(before: dict, after: dict) -> dict:
    """The run's speculative decoding figures from the server's counters (xlaserve's /get_server_info),
    warm-up included; nothing when the server does not speculate."""
    b, a = before.get("speculative") or {}, after.get("speculative") or {}
    if not a.get("enabled"):
        return {}
    keys = ("verify_steps", "draft_tokens", "accepted_tokens")
    steps, drafts, accepted = (a[k] - b.get(k, 0) for k in keys)
    return {"spec_verify_steps": steps, "spec_draft_tokens": drafts, "spec_accepted_tokens": accepted,
            "spec_accept_length": 1 + accepted / steps if steps else None,
            "spec_acceptance_rate": accepted / drafts if drafts else None}


def _delta(before: dict, after: dict, key: str) -> int | None:
    return after[key] - before[key] if key in before and key in after else None


async def _run(ns: argparse.Namespace, backend: Backend, requests: list[BenchRequest], headers: dict) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(6 * 3600.0, connect=60.0)
    async with httpx.AsyncClient(base_url=ns.base_url, headers=headers, timeout=timeout, limits=limits,
                                 trust_env=False) as client:
        if ns.warmup_requests > 0:
            warm = await asyncio.gather(*(send_request(client, backend, requests[0])
                                          for _ in range(ns.warmup_requests)))
            if not all(w.success for w in warm):
                raise RuntimeError(f"warm-up request failed: {next(w.error for w in warm if not w.success)}")
        results, duration, peak = await run_requests(client, backend, requests, ns.request_rate,
                                                     ns.max_concurrency, ns.seed, ns.disable_tqdm)
    out = compute_metrics(results, duration, peak)
    if ns.output_details:
        out["details"] = {"input_lens": [r.prompt_len for r in results],
                          "output_lens": [r.output_len for r in results],
                          "ttfts": [r.ttft for r in results], "e2e_latencies": [r.e2e for r in results],
                          "starts": [r.start for r in results], "itls": [r.itl for r in results],
                          "errors": [r.error for r in results]}
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.serving`; returns 0 when at least one request completed."""
    ns = build_parser().parse_args(argv)
    try:
        record = run_benchmark(ns)
    except (RuntimeError, ValueError, TypeError, OSError) as e:
        print(f"bench.serving: {e}", file=sys.stderr)
        return 1
    return 0 if record["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
