"""bench.serving and bench.sweep against the shared live server: counts, timings and reports add up."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bench import serving, sweep
from bench.datasets import random_requests, shared_prefix_requests, sharegpt_requests
from serve.tokenizer import load_tokenizer

pytest_plugins = ["tests.live_server"]

RESULT_KEYS = {
    "timestamp", "backend", "base_url", "model", "dataset_name", "num_prompts", "request_rate",
    "max_concurrency", "seed", "ignore_eos", "stream", "server", "device", "client_host", "completed",
    "failed", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput",
    "input_throughput", "output_throughput", "total_throughput", "max_concurrency_reached",
    "mean_concurrency", "errors",
} | {f"{s}_{name}_ms" for s in ("mean", "median", "p90", "p99") for name in serving.STAT_NAMES}


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: str, cache_dir: str):
    return load_tokenizer(smollm2_gguf, cache_dir)


def _bench(server, tmp_path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "serving.jsonl"
    rc = serving.main(["--base-url", server.url, "--seed", "0", "--disable-tqdm", "--output-details",
                       "--output-file", str(out), *flags])
    lines = out.read_text().splitlines()
    assert len(lines) == 1, lines
    return rc, json.loads(lines[0])


@pytest.mark.server
@pytest.mark.slow
def test_random_streaming_benchmark_adds_up(server, tmp_path):
    n, n_in, n_out = 12, 32, 16
    rc, r = _bench(server, tmp_path, "--num-prompts", str(n), "--random-input-len", str(n_in),
                   "--random-output-len", str(n_out), "--random-range-ratio", "1", "--max-concurrency", "4")
    assert rc == 0
    assert RESULT_KEYS <= set(r), RESULT_KEYS - set(r)
    assert (r["completed"], r["failed"], r["errors"]) == (n, 0, [])
    assert r["ignore_eos"] and r["stream"] and r["backend"] == "openai-completions"
    d = r["details"]
    assert d["output_lens"] == [n_out] * n and r["total_output_tokens"] == n * n_out
    assert all(abs(x - n_in) <= 2 for x in d["input_lens"]), d["input_lens"]  # the server's own count
    assert r["total_input_tokens"] == sum(d["input_lens"])
    for start, ttft, e2e, itl in zip(d["starts"], d["ttfts"], d["e2e_latencies"], d["itls"]):
        assert 0 < ttft <= e2e
        assert len(itl) <= n_out - 1 and sum(itl) <= e2e - ttft + 1e-6
        assert start + e2e <= r["duration_s"] + 1e-3
    duration = r["duration_s"]
    assert r["output_throughput"] == pytest.approx(n * n_out / duration)
    assert r["request_throughput"] == pytest.approx(n / duration)
    assert r["total_throughput"] == pytest.approx((r["total_input_tokens"] + n * n_out) / duration)
    assert r["max_concurrency_reached"] == 4 and 0 < r["mean_concurrency"] <= 4
    # 16 tokens each, 4 at a time: many decode steps went ahead of their predecessor's tokens
    assert 0 < r["server_overlapped_steps"] < r["server_steps"]
    # the server's settings the numbers depend on, as its /get_server_info reports them
    assert r["server"]["schedule_policy"] == "fcfs" and r["server"]["disable_radix_cache"] is False
    assert r["server"]["max_running_requests"] > 0 and "quantization" in r["server"]
    assert r["median_ttft_ms"] == pytest.approx(np.median(d["ttfts"]) * 1000)
    assert r["p99_e2e_latency_ms"] <= max(d["e2e_latencies"]) * 1000 + 1e-6
    assert all(r[k] is not None and r[k] > 0 for k in RESULT_KEYS if k.endswith("_ms"))


@pytest.mark.server
def test_native_backend_sends_exact_prompt_ids(server, tmp_path):
    rc, r = _bench(server, tmp_path, "--backend", "sglang-native", "--num-prompts", "4", "--random-input-len",
                   "24", "--random-output-len", "6", "--random-range-ratio", "1", "--warmup-requests", "0")
    assert rc == 0 and (r["completed"], r["failed"]) == (4, 0)
    assert r["details"]["input_lens"] == [24] * 4 and r["details"]["output_lens"] == [6] * 4
    # /generate reports cumulative token counts, so every output token after the first chunk has its gap
    assert [len(x) for x in r["details"]["itls"]] == [5] * 4


@pytest.mark.server
def test_failed_requests_are_counted_not_raised(server, tmp_path):
    rc, r = _bench(server, tmp_path, "--model", "no-such-model", "--num-prompts", "3",
                   "--random-input-len", "8", "--random-output-len", "4", "--warmup-requests", "0")
    assert rc == 1 and (r["completed"], r["failed"]) == (0, 3)
    assert r["output_throughput"] == 0 and r["mean_ttft_ms"] is None
    assert len(r["errors"]) == 1 and r["errors"][0].startswith("HTTP 404")


def _conv(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": who, "value": text} for who, text in turns]}


SHAREGPT = [
    _conv(("human", "What is the capital of France?"), ("gpt", "The capital of France is Paris.")),
    _conv(("gpt", "Hello! How can I help?"), ("human", "Name a prime number."), ("gpt", "Seven.")),
    _conv(("human", "This one has no reply.")),
    _conv(("human", ""), ("gpt", "An empty prompt is skipped.")),
    _conv(("human", "Count to three."), ("gpt", "One, two, three. " * 20)),
]


def test_sharegpt_loader(tmp_path, tokenizer):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    reqs = sharegpt_requests(str(path), tokenizer, num_prompts=10, seed=0)
    by_prompt = {r.prompt: r for r in reqs}
    assert set(by_prompt) == {"What is the capital of France?", "Name a prime number.", "Count to three."}
    for conv in (SHAREGPT[0], SHAREGPT[1], SHAREGPT[4]):
        human = next(t["value"] for t in conv["conversations"] if t["from"] == "human")
        reply = conv["conversations"][-1]["value"]
        r = by_prompt[human]
        assert r.output_len == len(tokenizer.encode(reply, add_special_tokens=False))
        assert r.prompt_ids == tuple(tokenizer.encode(human, add_special_tokens=False))
    assert [r.prompt for r in reqs] == [r.prompt for r in sharegpt_requests(str(path), tokenizer, 10, seed=0)]
    assert len(sharegpt_requests(str(path), tokenizer, num_prompts=2, seed=0)) == 2
    assert {r.output_len for r in sharegpt_requests(str(path), tokenizer, 10, 0, fixed_output_len=5)} == {5}
    short = sharegpt_requests(str(path), tokenizer, 10, 0, max_total_len=30)  # drops the long reply
    assert "Count to three." not in {r.prompt for r in short} and len(short) == 2
    (tmp_path / "bad.json").write_text(json.dumps([SHAREGPT[2]]))
    with pytest.raises(ValueError, match="no usable conversation"):
        sharegpt_requests(str(tmp_path / "bad.json"), tokenizer, 10, 0)


@pytest.mark.server
def test_sharegpt_benchmark_over_chat(server, tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    rc, r = _bench(server, tmp_path, "--backend", "openai-chat", "--dataset-name", "sharegpt",
                   "--dataset-path", str(path), "--sharegpt-output-len", "4", "--num-prompts", "3",
                   "--warmup-requests", "0")
    assert rc == 0 and (r["completed"], r["failed"]) == (3, 0) and not r["ignore_eos"]
    assert all(1 <= x <= 4 for x in r["details"]["output_lens"])


def _common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_generated_shared_prefix_shapes(tokenizer):
    groups, per_group, sys_len, q_len = 3, 4, 64, 16
    reqs = shared_prefix_requests(tokenizer, groups, per_group, sys_len, q_len, output_len=8, seed=0)
    assert len(reqs) == groups * per_group and {r.output_len for r in reqs} == {8}
    assert all(abs(r.prompt_len - (sys_len + q_len + 1)) <= 4 for r in reqs), [r.prompt_len for r in reqs]
    # same group <=> the token ids share (nearly) the whole system prompt
    clusters: list[list] = []
    for r in reqs:
        home = next((c for c in clusters if _common_prefix(c[0].prompt_ids, r.prompt_ids) >= sys_len - 2),
                    None)
        if home:
            home.append(r)
        else:
            clusters.append([r])
    assert sorted(len(c) for c in clusters) == [per_group] * groups
    assert all(_common_prefix(a[0].prompt_ids, b[0].prompt_ids) < 8
               for a in clusters for b in clusters if a is not b)
    assert [r.prompt for r in reqs] != [r.prompt for c in clusters for r in c]  # shuffled, not grouped


def test_random_dataset_lengths(tokenizer):
    reqs = random_requests(tokenizer, 64, input_len=100, output_len=40, range_ratio=0.5, seed=3)
    assert all(20 <= r.output_len <= 40 for r in reqs)
    assert all(48 <= r.prompt_len <= 102 for r in reqs) and len({r.prompt_len for r in reqs}) > 10
    assert [r.prompt for r in reqs] == [r.prompt
                                        for r in random_requests(tokenizer, 64, 100, 40, 0.5, seed=3)]
    special = set(tokenizer.all_special_ids)
    assert not any(special & set(r.prompt_ids) for r in reqs)


def test_spread_tokens_and_itl_hand_cases():
    # the estimates already sum to the total
    assert serving.spread_tokens([1, 1, 3, 1], [0.5, 0.1, 0.3, 0.1], 6) == [1, 1, 3, 1]
    # no hint from the text: the extra token went with the chunk that waited longest (never the first)
    assert serving.spread_tokens([1, 1, 1, 1], [0.9, 0.1, 0.2, 0.1], 5) == [1, 1, 2, 1]
    assert serving.itl_of([0.5, 0.6, 0.9, 1.0], [1, 1, 3, 1]) == pytest.approx([0.1] * 5)
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        total = n + int(rng.integers(0, 20))
        counts = serving.spread_tokens(rng.integers(0, 4, n).tolist(), rng.random(n).tolist(), total)
        assert sum(counts) == total and min(counts) >= 1


@pytest.mark.server
@pytest.mark.slow
def test_sweep_writes_points_and_plot(server, tmp_path):
    import matplotlib  # noqa: F401  (a test dependency: a missing install must fail, not skip)
    out = tmp_path / "sweep"
    rc = sweep.main(["--base-url", server.url, "--input-lens", "32", "--output-lens", "8",
                     "--concurrencies", "1,2", "--min-prompts", "4", "--warmup-requests", "0",
                     "--disable-tqdm", "--output-dir", str(out)])
    assert rc == 0
    for c in (1, 2):
        r = json.loads((out / f"in32_out8_c{c}.json").read_text())
        assert (r["completed"], r["failed"], r["max_concurrency"], r["total_output_tokens"]) == (4, 0, c, 32)
        assert r["max_concurrency_reached"] == c
    assert len((out / "sweep.jsonl").read_text().splitlines()) == 2
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 32 | 8 | 2 | 4 | 4/0 |" in (out / "summary.md").read_text()


@pytest.mark.server
@pytest.mark.slow
def test_launch_reports_a_server_that_fails_to_start(tmp_path):
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="exited"):
        sweep.launch_server(f"--model {tmp_path}/missing.gguf", str(log), timeout=120)
    assert os.path.getsize(log) > 0


@pytest.mark.server
@pytest.mark.slow
def test_multi_turn_bench_reports_growing_prompts_found_in_the_cache(server, tmp_path):
    from bench import multiturn

    out = tmp_path / "turns.jsonl"
    assert multiturn.main(["--base-url", server.url, "--num-conversations", "2", "--num-turns", "3",
                           "--system-prompt-len", "40", "--user-len", "20", "--output-len", "8",
                           "--output-file", str(out)]) == 0
    turns = json.loads(out.read_text())["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3] and all(t["ttft_s"] > 0 for t in turns)
    prompts = [t["prompt_tokens"] for t in turns]
    assert prompts[0] < prompts[1] < prompts[2]
    # Each later turn finds at least the whole pages of the turn before it.
    assert all(t["cached_tokens"] >= p // 16 * 16 for t, p in zip(turns[1:], prompts))
