"""Shutdown in every launch mode: a signal to the whole process group drains like one to the server alone, and
`kill -9` of the server leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

pytest.register_assert_rewrite("tests.live_server")  # before its import, so its asserts explain failures
from tests.live_server import MODEL, SHARED_FLAGS, LiveServer, still_running  # noqa: E402

# A server of its own per test (10-20 s to start, 25-45 s in all).
pytestmark = [pytest.mark.server, pytest.mark.slow]

MAX_TOKENS = 120  # long enough to be in flight at the signal, short enough to finish quickly after it


def _stream(srv: LiveServer, kind: str, i: int, result: dict) -> None:
    """One streaming request of `kind` ("chat" or "generate"); fills `result` with its events."""
    if kind == "chat":
        path, body = "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": f"Story {i}, please."}], "stream": True,
            "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    else:
        path, body = "/generate", {"text": f"Story {i}:", "stream": True,
                                   "sampling_params": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}}
    result["events"] = events = []
    try:
        with httpx.stream("POST", srv.url + path, json=body, timeout=120) as r:
            result["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
    except httpx.HTTPError as e:
        result["error"] = repr(e)


def _assert_complete(kind: str, result: dict) -> None:
    events = result["events"]
    assert result.get("status") == 200 and "error" not in result, result
    assert events and events[-1] == "[DONE]", events[-3:]
    items = [json.loads(e) for e in events[:-1]]
    if kind == "chat":
        assert items[-1]["usage"]["completion_tokens"] == MAX_TOKENS, items[-1]
        finishes = [c["finish_reason"] for it in items for c in it["choices"] if c["finish_reason"]]
        assert finishes == ["length"], finishes
        assert "".join(c["delta"].get("content") or "" for it in items for c in it["choices"])
    else:
        last = items[-1]
        assert last["meta_info"]["finish_reason"]["type"] == "length", last["meta_info"]
        assert len(last["output_ids"]) == last["meta_info"]["completion_tokens"] == MAX_TOKENS
        assert last["text"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_the_process_group_finishes_streams_and_exits_0(signum):
    """What systemd (KillMode=control-group) and Ctrl-C in a terminal do: every process gets the signal."""
    srv = LiveServer.start(*SHARED_FLAGS, "--shutdown-timeout", "60", own_process_group=True)
    try:
        children = list(srv.children)
        assert len(children) == 2, [p.cmdline() for p in children]  # scheduler, detokenizer; no tracker
        kinds = ["chat", "chat", "generate"]
        results = [{} for _ in kinds]
        threads = [threading.Thread(target=_stream, args=(srv, k, i, r))
                   for i, (k, r) in enumerate(zip(kinds, results))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not all(len(r.get("events", ())) >= 2 for r in results):  # every stream is under way
            assert time.monotonic() < deadline, "the streams never all started"
            time.sleep(0.05)

        os.killpg(srv.proc.pid, signum)
        for t in threads:
            t.join(120)
        exit_code = srv.proc.wait(timeout=60)
        alive = still_running(children, timeout=10)
        log = srv.log()
        assert exit_code == 0, log[-4000:]
        assert not alive, f"children left after exit: {[p.pid for p in alive]}"
        assert f"received {signal.Signals(signum).name}" in log, log[-4000:]
        for bad in ("Traceback", "Exception in ASGI application", "leaked semaphore", "process died"):
            assert bad not in log, log[-4000:]
        for kind, result in zip(kinds, results):  # every stream in flight at the signal ended in full
            _assert_complete(kind, result)
    finally:
        srv.stop()  # a no-op if it exited; otherwise kills it and reports what was left


def test_kill_9_of_the_server_takes_its_children_down_at_once():
    srv = LiveServer.start(*SHARED_FLAGS, own_process_group=True)
    children = list(srv.children)
    try:
        names = [" ".join(p.cmdline()) for p in children]
        assert len(children) == 2 and all("serve.children" in n for n in names), names
        result: dict = {}
        t = threading.Thread(target=_stream, args=(srv, "generate", 0, result), daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while len(result.get("events", ())) < 2:  # generating, the scheduler busy, the detokenizer sending
            assert time.monotonic() < deadline, "the stream never started"
            time.sleep(0.05)
        srv.proc.kill()
        killed_at = time.monotonic()
        srv.proc.wait()
        alive = still_running(children, timeout=5)
        took = time.monotonic() - killed_at
        assert not alive, f"children still running 5 s after kill -9: {[p.pid for p in alive]}"
        assert took < 3, f"children took {took:.1f} s to go"
        t.join(10)
    finally:
        for p in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        with contextlib.suppress(OSError):
            os.remove(srv.log_path)
