"""Server endpoints beyond the OpenAI API, aborts and disconnects freeing the pool, and graceful SIGTERM."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

pytest.register_assert_rewrite("tests.live_server")  # before its import, so its asserts explain failures
from tests.live_server import (  # noqa: E402
    MODEL,
    REPO,
    SHARED_FLAGS,
    LiveServer,
    assert_error_shape,
    free_port,
    still_running,
)

pytest_plugins = ["tests.live_server"]

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.server
def test_models_lists_the_served_model(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert server.get("/v1/models").json()["data"][0]["max_model_len"] == 512


@pytest.mark.server
def test_health_and_health_generate(server):
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate").status_code == 200


@pytest.mark.server
@pytest.mark.slow
def test_server_info_reports_pool_and_no_compiles_after_warmup(server):
    # Prompts and batch sizes of several buckets, all of which were precompiled at startup.
    client = server.client()
    for words in (3, 40, 150):
        client.completions.create(model=MODEL, prompt="word " * words, max_tokens=3, temperature=0)
    client.completions.create(model=MODEL, prompt=["a b", "c d", "e f", "g h", "i j"], max_tokens=5)
    info = server.wait_idle()
    assert info["max_total_tokens"] == 4096 and info["context_length"] == 512
    assert info["free_tokens"] == 4096
    assert info["compiles_after_warmup"] == 0
    assert info["num_finished_requests"] >= 8


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


@pytest.mark.server
def test_metrics_count_requests_and_latencies(server):
    server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=3,
                                            extra_body={"ignore_eos": True})
    r = server.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    before = r.text
    for name in ("xlaserve_time_to_first_token_seconds_bucket", "xlaserve_e2e_request_latency_seconds_count",
                 "xlaserve_kv_token_usage", "xlaserve_kv_total_tokens", "xlaserve_num_running_requests"):
        assert re.search(rf"^{name}[{{ ]", before, re.M), name
    assert _metric(before, "xlaserve_kv_total_tokens") == 4096

    server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=3,
                                            extra_body={"ignore_eos": True})
    after = server.get("/metrics").text
    length = '{outcome="length"}'
    assert (_metric(after, "xlaserve_requests_total", length)
            == _metric(before, "xlaserve_requests_total", length) + 1)
    assert (_metric(after, "xlaserve_time_to_first_token_seconds_count")
            == _metric(before, "xlaserve_time_to_first_token_seconds_count") + 1)
    assert (_metric(after, "xlaserve_generation_tokens_total")
            == _metric(before, "xlaserve_generation_tokens_total") + 3)


@pytest.mark.server
def test_generate_streams_sse_and_ends_with_finish_reason(server):
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 10}}
    whole = server.post("/generate", body).json()
    events = []
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(line.removeprefix("data: "))
    assert events[-1] == "[DONE]"
    items = [json.loads(e) for e in events[:-1]]
    assert len(items) > 1
    assert all(it["meta_info"]["finish_reason"] is None for it in items[:-1])
    assert items[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert items[-1]["text"] == whole["text"] and items[-1]["output_ids"] == whole["output_ids"]
    assert len(whole["output_ids"]) == whole["meta_info"]["completion_tokens"] == 10


@pytest.mark.server
def test_abort_request_ends_a_running_generate(server):
    result = {}

    def run():
        params = {"max_new_tokens": 450, "ignore_eos": True}
        result["r"] = server.post("/generate", {"text": "Tell me a story.", "rid": "abort-me",
                                                "sampling_params": params})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while server.info()["num_running_requests"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    r = server.post("/abort_request", {"rid": "abort-me"})
    assert r.status_code == 200 and r.json()["success"] is True
    t.join(20)
    assert not t.is_alive(), "the aborted request did not return"
    meta = result["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < 450
    server.wait_idle()
    assert_error_shape(server.post("/abort_request", {}), 400, "rid")


@pytest.mark.server
@pytest.mark.slow
def test_flush_cache_refuses_while_a_request_runs_then_empties_the_cache(server):
    result = {}

    def run():
        params = {"max_new_tokens": 300, "ignore_eos": True}
        # A prompt of several pages: cached once its prefill is done, whenever the abort comes.
        result["r"] = server.post("/generate", {"text": "Tell me a long story. " * 12, "rid": "flush-me",
                                                "sampling_params": params})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 30
    while server.info()["num_running_requests"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    refused = server.post("/flush_cache")
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert "requests are waiting or running" in refused.json()["message"]
    server.post("/abort_request", {"rid": "flush-me"})
    t.join(20)
    assert not t.is_alive()
    server.wait_idle()
    assert server.info()["prefix_cache"]["cached_tokens"] > 0
    flushed = server.post("/flush_cache")
    assert flushed.status_code == 200 and flushed.json()["success"] is True
    info = server.info()
    assert info["prefix_cache"]["cached_tokens"] == 0 and info["integrity"] == "ok"


def _disconnect_mid_stream(server: LiveServer, path: str, body: dict) -> None:
    """Opens a streaming request, reads three events, and drops the connection while it still runs."""
    body = {**body, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + path, json=body) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                assert server.info()["num_running_requests"] == 1
                break  # leaving iter_lines early closes the connection: the client is gone


def _assert_pool_freed_early(server: LiveServer, steps_before: int) -> None:
    """The pool is free again, and well before the dropped request could have run its 450 tokens."""
    info = server.wait_idle(timeout=10)
    assert info["num_steps"] - steps_before < 100, "the request ran on after its client left"


LONG_RUN = {"max_tokens": 450, "ignore_eos": True}
STREAMS = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": HI, **LONG_RUN}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "Once", **LONG_RUN}),
    "generate": ("/generate", {"text": "Once", "sampling_params": {"max_new_tokens": 450,
                                                                   "ignore_eos": True}}),
}


@pytest.mark.parametrize("path,body", STREAMS.values(), ids=STREAMS.keys())
@pytest.mark.server
def test_client_disconnect_mid_stream_frees_the_pool(server, path, body):
    steps_before = server.info()["num_steps"]
    _disconnect_mid_stream(server, path, body)
    _assert_pool_freed_early(server, steps_before)




@pytest.mark.parametrize("path,body", [
    pytest.param(*STREAMS["chat"], id="chat", marks=()),
    pytest.param(*STREAMS["completions"], id="completions", marks=()),
    pytest.param(*STREAMS["generate"], id="generate"),
])
@pytest.mark.server
def test_client_disconnect_mid_stream_logs_no_error(server, path, body):
    errors_before = server.log().count("Traceback")
    _disconnect_mid_stream(server, path, body)
    server.wait_idle(timeout=10)
    time.sleep(0.5)  # the handler ends (and would log) just after the pool is free
    assert server.log().count("Traceback") == errors_before, server.log_tail(3000)


@pytest.mark.server
def test_client_gone_from_non_streaming_request_frees_the_pool(server):
    body = json.dumps({"text": "Once", "rid": "hang-up-on-me",
                       "sampling_params": {"max_new_tokens": 450, "ignore_eos": True}}).encode()
    steps_before = server.info()["num_steps"]
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 30
            while server.info()["num_running_requests"] == 0:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.05)
        # the socket is closed: the client is gone while its request runs
        _assert_pool_freed_early(server, steps_before)
    finally:  # do not leave the request running into later tests
        server.post("/abort_request", {"rid": "hang-up-on-me"})


# ---- a dedicated server (key from the environment) that is sent SIGTERM ---------------------------------

ENV_KEY = "env-key-456"


@pytest.fixture(scope="module")
def doomed_server():
    srv = LiveServer.start(*SHARED_FLAGS, "--shutdown-timeout", "60", env={"XLASERVE_API_KEY": ENV_KEY},
                           api_key=ENV_KEY)
    yield srv
    srv.stop()


@pytest.mark.server
@pytest.mark.slow
def test_api_key_from_the_environment(doomed_server):
    r = httpx.post(f"{doomed_server.url}/v1/chat/completions", json={"model": MODEL, "messages": HI},
                   timeout=30)
    assert_error_shape(r, 401)
    assert doomed_server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices


@pytest.mark.server
@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests_refuses_new_ones_and_exits_0(doomed_server):
    srv = doomed_server
    n, max_tokens = 3, 150
    results: list = [None] * n
    answered_at = [0.0] * n

    def send(i: int) -> None:
        results[i] = srv.post("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": f"Story {i}, please."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}, timeout=120)
        answered_at[i] = time.monotonic()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while srv.info()["num_running_requests"] < n:
        assert time.monotonic() < deadline, "the requests never all started"
        time.sleep(0.05)
    children = psutil.Process(srv.proc.pid).children(recursive=True)
    assert len(children) >= 2  # scheduler and detokenizer

    srv.proc.send_signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    time.sleep(0.3)
    late = None  # a request after the signal: 503, or refused if the port is already closed
    with contextlib.suppress(httpx.ConnectError):
        late = srv.post("/v1/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2}, timeout=30)
    for t in threads:
        t.join(120)
    exit_code = srv.proc.wait(timeout=60)
    alive = still_running(children, timeout=10)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.url}/health", timeout=5)
    assert exit_code == 0
    assert not alive, f"children left after exit: {[p.pid for p in alive]}"
    assert "leaked semaphore" not in srv.log() and "Traceback" not in srv.log(), srv.log_tail()
    if late is not None:
        assert_error_shape(late, 503)

    assert max(answered_at) > signalled_at, "no request was still in flight at the signal"
    for r in results:  # every request in flight at the signal was answered in full
        assert r is not None and r.status_code == 200, r and r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == max_tokens
        assert body["choices"][0]["message"]["content"]


def _num_started(procs: list[psutil.Process]) -> int:
    """How many of `procs` are the server's scheduler and detokenizer (serve/children.py)."""
    n = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            n += "serve.children" in " ".join(p.cmdline())
    return n


@pytest.mark.server
@pytest.mark.slow
def test_sigterm_during_startup_leaves_no_children():
    cmd = [sys.executable, "-m", "serve", "serve", "--port", str(free_port()), *SHARED_FLAGS]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 60
        while _num_started(children) < 2:
            # until the scheduler and detokenizer are started (the scheduler then loads the model for seconds)
            assert proc.poll() is None and time.monotonic() < deadline, "the server spawned no children"
            time.sleep(0.05)
            with contextlib.suppress(psutil.Error):
                children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        alive = still_running(children, timeout=5)
        assert not alive, f"children left running after the server exited: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
