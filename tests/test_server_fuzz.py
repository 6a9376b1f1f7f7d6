"""Robustness of the HTTP API: property-based fuzzing from the server's own OpenAPI schema, and hand-made
malformed requests. Nothing may answer 5xx or crash the server; bad input gets 4xx."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.live_server import LiveServer

# A small context keeps every fuzzed generation short; a small body limit makes 413 cheap to reach.
FLAGS = ("--max-running-requests", "4", "--context-length", "96", "--max-total-tokens", "1024",
         "--chunked-prefill-size", "64", "--max-request-bytes", str(2**20))


@pytest.fixture(scope="module")
def fuzz_server():
    srv = LiveServer.start(*FLAGS)
    yield srv
    assert srv.proc.poll() is None, f"server died during fuzzing:\n{srv.log_tail()}"
    srv.stop()


def test_no_server_error_from_schema_fuzzing(fuzz_server):
    # schemathesis' pytest plugin does not load under pytest 9, so its hypothesis strategies are driven here.
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/chat/completions", "/v1/completions", "/generate"} <= paths, paths
    for op in operations:

        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            response = case.call(base_url=fuzz_server.url, timeout=120)
            assert response.status_code < 500, (
                f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}")

        fuzz()


def _post_raw(srv: LiveServer, path: str, content: bytes) -> httpx.Response:
    return httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_malformed_bodies_get_4xx(fuzz_server, path):
    bad_bodies = [
        b"{",  # truncated JSON
        b"[1, 2, 3]",  # not an object
        b'{"model": "x", "messages": "\xff\xfe not utf-8"}',  # bad UTF-8
        b'{"model": 5, "prompt": {"a": 1}, "messages": 7, "text": 3}',  # wrong types everywhere
        b'{"model": "smollm2-135m-instruct", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], '
        b'"text": "hi", "max_tokens": 1000000000000, "n": 1000000000, "temperature": 1e308}',  # huge values
    ]
    for body in bad_bodies:
        r = _post_raw(fuzz_server, path, body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text[:300])
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # An oversized body is refused before it is read.
    r = _post_raw(fuzz_server, path, b'{"prompt": "' + b"a" * (2**20 + 10) + b'"}')
    assert r.status_code == 413
    # And the server still serves.
    ok = httpx.post(fuzz_server.url + "/v1/completions", timeout=60,
                    json={"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 4})
    assert ok.status_code == 200, ok.text
