"""Host cost of the radix prefix cache per request (match + lock + insert) on a tree of 10,000+ nodes.

The tree is grown by simulated chat traffic: groups of requests share a system prompt, half of the requests
continue an earlier conversation of their group (the history plus a new question), each caches its prompt
and answer. Then more requests of the same traffic are timed, one operation at a time. The baseline, timed
on the same prompts, is a vLLM-style lookup of chained page hashes in a dict (what a hash-based prefix
cache pays just to find its hit); the target is 1 ms for match + insert.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import platform
import statistics
import sys
import time

import numpy as np

from memory.radix_cache import RadixCache


class Traffic:
    """Chat requests over shared system prompts; `next()` gives (prompt, answer) token lists."""

    def __init__(self, rng: np.random.Generator, groups: int, system_len: int, question: tuple[int, int],
                 answer: int, max_turns: int, vocab: int = 32000):
        self.rng, self.question, self.answer, self.max_turns = rng, question, answer, max_turns
        self.vocab = vocab
        self.systems = [self._tokens(system_len) for _ in range(groups)]
        # per group: (history, turns) of each conversation
        self.conversations: list[list[tuple[list[int], int]]] = [[] for _ in range(groups)]

    def _tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, n).tolist()

    def next(self) -> tuple[list[int], list[int]]:
        g = int(self.rng.integers(len(self.systems)))
        convs = self.conversations[g]
        if convs and self.rng.random() < 0.5:
            i = int(self.rng.integers(len(convs)))
            history, turns = convs[i]
        else:
            i, history, turns = len(convs), self.systems[g], 0
            convs.append((history, turns))
        prompt = history + self._tokens(int(self.rng.integers(*self.question)))
        answer = self._tokens(self.answer)
        convs[i] = (prompt + answer, turns + 1) if turns + 1 < self.max_turns else (self.systems[g], 0)
        return prompt, answer


def serve_one(cache: RadixCache, prompt: list[int], answer: list[int], new_page, capacity: int | None,
              timings: dict | None) -> None:
    """One request's cache traffic: match and lock at admission, evict to make room for its new pages when
    the pool (`capacity` pages, None: unbounded) is full, insert prompt + answer and swap the lock at the
    end, then release it. Page ids come from a counter; evicted ones are simply dropped."""
    ps = cache.page_size
    t0 = time.perf_counter_ns()
    m = cache.match_prefix(prompt[:-1])
    t1 = time.perf_counter_ns()
    cache.lock(m.node)
    tokens = prompt + answer
    need = -(-len(tokens) // ps) - len(m.pages)
    t2 = time.perf_counter_ns()
    if capacity is not None and cache.num_cached_pages + need > capacity:
        cache.evict(cache.num_cached_pages + need - capacity)
    t3 = time.perf_counter_ns()
    pages = m.pages + [next(new_page) for _ in range(need)]
    t4 = time.perf_counter_ns()
    r = cache.insert(tokens, pages)
    t5 = time.perf_counter_ns()
    cache.lock(r.node)
    cache.unlock(m.node)
    cache.unlock(r.node)
    t6 = time.perf_counter_ns()
    if timings is not None:
        timings["match"].append((t1 - t0) / 1e3)
        timings["evict"].append((t3 - t2) / 1e3)
        timings["insert"].append((t5 - t4) / 1e3)
        timings["total"].append((t3 - t0 + t6 - t4) / 1e3)
        timings["prompt_tokens"].append(len(prompt))
        timings["cached_tokens"].append(m.num_tokens)


def hashed_lookup(table: dict, tokens: list[int], page_size: int) -> int:
    """Baseline: tokens found by chaining one hash per page and probing a dict (vLLM's prefix cache)."""
    h, n = None, 0
    for i in range(0, len(tokens) // page_size * page_size, page_size):
        h = hash((h, tuple(tokens[i : i + page_size])))
        if h not in table:
            break
        n += page_size
    return n


def hashed_insert(table: dict, tokens: list[int], page_size: int) -> None:
    h = None
    for i in range(0, len(tokens) // page_size * page_size, page_size):
        h = hash((h, tuple(tokens[i : i + page_size])))
        table[h] = i // page_size


def summary(xs: list[float]) -> dict:
    q = np.percentile(xs, [50, 90, 99])
    return {"p50": round(q[0], 1), "p90": round(q[1], 1), "p99": round(q[2], 1),
            "mean": round(statistics.fmean(xs), 1)}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def full_gc_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=int, default=10_000, help="grow the tree to at least this many nodes")
    p.add_argument("--requests", type=int, default=2000, help="timed requests")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--groups", type=int, default=64, help="distinct system prompts")
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question", type=int, nargs=2, default=(32, 256), help="question length range [lo, hi)")
    p.add_argument("--answer", type=int, default=128)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = p.parse_args()

    gc_before_ms = full_gc_ms()
    traffic = Traffic(np.random.default_rng(args.seed), args.groups, args.system_len, tuple(args.question),
                      args.answer, args.max_turns)
    cache = RadixCache(args.page_size)
    new_page = itertools.count(1)
    table: dict = {}  # the baseline's contents: the same prompts and answers
    start = time.perf_counter()
    while cache.num_nodes < args.nodes:
        prompt, answer = traffic.next()
        serve_one(cache, prompt, answer, new_page, None, None)
        hashed_insert(table, prompt + answer, args.page_size)
    build_s = time.perf_counter() - start
    nodes, capacity = cache.num_nodes, cache.num_cached_pages
    requests = [traffic.next() for _ in range(args.requests)]

    # Timed: a warm server, its pool full of cached pages, so every request evicts what it adds. The
    # collector is off while timing (a full collection is timed apart, after the workload is dropped).
    timings = {k: [] for k in ["match", "evict", "insert", "total", "prompt_tokens", "cached_tokens"]}
    baseline = []
    gc.collect()
    gc.disable()
    for prompt, answer in requests:
        t0 = time.perf_counter_ns()
        hashed_lookup(table, prompt[:-1], args.page_size)
        baseline.append((time.perf_counter_ns() - t0) / 1e3)
        hashed_insert(table, prompt + answer, args.page_size)
        serve_one(cache, prompt, answer, new_page, capacity, timings)
    gc.enable()
    cache.check_integrity()
    del traffic, table, requests  # so that the collection below walks the tree, not the workload
    gc.collect()
    gc_after_ms = full_gc_ms()

    match, total = summary(timings["match"]), summary(timings["total"])
    result = {
        "host": cpu_name(), "python": platform.python_version(), "page_size": args.page_size,
        "nodes": nodes, "cached_pages": capacity, "build_s": round(build_s, 2), "requests": args.requests,
        "prompt_tokens_mean": round(statistics.fmean(timings["prompt_tokens"])),
        "hit_rate": round(sum(timings["cached_tokens"]) / sum(timings["prompt_tokens"]), 3),
        "match_us": match, "evict_us": summary(timings["evict"]), "insert_us": summary(timings["insert"]),
        "request_us": total, "hashed_lookup_us": summary(baseline),
        "match_vs_hashed_p50": round(match["p50"] / statistics.median(baseline), 2),
        "budget_used_p99": round(total["p99"] / 1000, 3),
        "full_gc_ms": {"before_tree": round(gc_before_ms, 1), "with_tree": round(gc_after_ms, 1)},
    }
    print(f"host: {result['host']}, Python {result['python']}; page_size {args.page_size}")
    print(f"tree: {nodes} nodes, {capacity} pages ({capacity * args.page_size} tokens), "
          f"grown in {build_s:.1f} s;"
          f" {args.requests} timed requests of {result['prompt_tokens_mean']} prompt tokens on average,"
          f" {result['hit_rate']:.0%} of them cached; the pool stays full (each request evicts)")
    rows = [("match_prefix", "match_us"), ("evict", "evict_us"), ("insert", "insert_us"),
            ("request: match..unlock", "request_us"), ("baseline: hashed-page lookup", "hashed_lookup_us")]
    for name, key in rows:
        s = result[key]
        print(f"  {name:30s} p50 {s['p50']:7.1f} us  p90 {s['p90']:7.1f} us  p99 {s['p99']:7.1f} us")
    print(f"match p50 is {result['match_vs_hashed_p50']}x the hashed lookup; a request's p99 uses "
          f"{result['budget_used_p99']:.1%} of the 1 ms budget; tree after: {cache.num_nodes} nodes")
    print(f"full gc.collect(): {gc_before_ms:.1f} ms before the tree (jax imported by `memory`), "
          f"{gc_after_ms:.1f} ms with it")
    if args.json:
        print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
