"""Prometheus metrics of the server (request outcomes, latencies, tokens, pool usage)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("xlaserve_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("xlaserve_prompt_tokens", "prompt tokens of finished requests",
                                     registry=r)
        self.cached_prompt_tokens = Counter(
            "xlaserve_cached_prompt_tokens", "prompt tokens of finished requests found in the prefix cache",
            registry=r)
        self.generation_tokens = Counter("xlaserve_generation_tokens", "generated tokens", registry=r)
        self.spec_verify_steps = Counter(
            "xlaserve_spec_verify_steps", "decode steps of finished requests that verified a draft",
            registry=r)
        self.spec_draft_tokens = Counter(
            "xlaserve_spec_draft_tokens", "draft tokens proposed for finished requests", registry=r)
        self.spec_accepted_tokens = Counter(
            "xlaserve_spec_accepted_tokens", "draft tokens of finished requests the model accepted",
            registry=r)
        self.ttft = Histogram("xlaserve_time_to_first_token_seconds", "time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("xlaserve_inter_token_latency_seconds", "time between output tokens", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("xlaserve_e2e_request_latency_seconds", "request latency", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.running = Gauge("xlaserve_num_running_requests", "requests being decoded", registry=r)
        self.queued = Gauge("xlaserve_num_queued_requests", "requests waiting for admission", registry=r)
        self.used_tokens = Gauge("xlaserve_kv_used_tokens", "KV pool tokens in use", registry=r)
        self.total_tokens = Gauge("xlaserve_kv_total_tokens", "KV pool capacity in tokens", registry=r)
        self.token_usage = Gauge("xlaserve_kv_token_usage", "fraction of the KV pool in use", registry=r)

    def update_from_server_info(self, info: dict) -> None:
        self.running.set(info["num_running_requests"])
        self.queued.set(info["num_waiting_requests"])
        self.used_tokens.set(info["used_tokens"])
        self.total_tokens.set(info["max_total_tokens"])
        self.token_usage.set(info["used_tokens"] / max(info["max_total_tokens"], 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
