"""Every refused request gets its HTTP status and the OpenAI error body, and the server keeps serving."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

pytest.register_assert_rewrite("tests.live_server")  # before its import, so its asserts explain failures
from tests.live_server import MODEL, LiveServer, assert_error_shape  # noqa: E402

pytest_plugins = ["tests.live_server"]

HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 4}
LONG = "hello " * 600  # > 512 tokens, the shared server's context length


def _still_serves(srv: LiveServer) -> None:
    r = srv.post("/v1/chat/completions", {**CHAT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


CHAT_400 = {
    "temperature below 0": ({**CHAT, "temperature": -0.5}, "temperature"),
    "top_p 0": ({**CHAT, "top_p": 0}, "top_p"),
    "top_p above 1": ({**CHAT, "top_p": 1.5}, "top_p"),
    "n 0": ({**CHAT, "n": 0}, "n"),
    "max_tokens 0": ({**CHAT, "max_tokens": 0}, "max_tokens"),
    "temperature a string": ({**CHAT, "temperature": "hot"}, "temperature"),
    "messages empty": ({**CHAT, "messages": []}, "messages"),
    "messages missing": ({"model": MODEL}, "messages"),
    "prompt longer than the context": ({**CHAT, "messages": [{"role": "user", "content": LONG}]}, "messages"),
    "max_tokens beyond the context": ({**CHAT, "max_tokens": 600}, "max_tokens"),
    "streaming with a bad field": ({**CHAT, "stream": True, "temperature": -1}, "temperature"),
    "top_logprobs without logprobs": ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    "top_logprobs above the maximum": ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
}


@pytest.mark.parametrize("body,param", CHAT_400.values(), ids=CHAT_400.keys())
@pytest.mark.server
def test_chat_bad_request_is_400_with_error_body(server, body, param):
    err = assert_error_shape(server.post("/v1/chat/completions", body), 400, param)
    assert err["type"] == "invalid_request_error"
    _still_serves(server)


COMPLETION_400 = {
    "prompt longer than the context": ({"model": MODEL, "prompt": LONG, "max_tokens": 4}, "prompt"),
    "logprobs above the maximum": ({"model": MODEL, "prompt": "a", "logprobs": 21}, "logprobs"),
    "empty prompt list": ({"model": MODEL, "prompt": []}, "prompt"),
    "max_tokens 0 without echo": ({"model": MODEL, "prompt": "a", "max_tokens": 0}, "max_tokens"),
}


@pytest.mark.parametrize("body,param", COMPLETION_400.values(), ids=COMPLETION_400.keys())
@pytest.mark.server
def test_completion_bad_request_is_400_with_error_body(server, body, param):
    assert_error_shape(server.post("/v1/completions", body), 400, param)
    _still_serves(server)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
@pytest.mark.server
def test_invalid_json_body_is_400(server, path):
    r = httpx.post(server.url + path, content=b'{"model": "x", "messages": [', timeout=30,
                   headers={"Content-Type": "application/json"})
    assert_error_shape(r, 400)
    _still_serves(server)


@pytest.mark.server
def test_generate_prompt_longer_than_the_context_is_400(server):
    r = server.post("/generate", {"text": LONG, "sampling_params": {"max_new_tokens": 4}})
    assert_error_shape(r, 400)
    _still_serves(server)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", {**CHAT, "model": "gpt-4o"}),
                                       ("/v1/completions", {"model": "gpt-4o", "prompt": "a"})])
@pytest.mark.server
def test_unknown_model_is_404(server, path, body):
    err = assert_error_shape(server.post(path, body), 404, "model")
    assert "gpt-4o" in err["message"]
    _still_serves(server)


@pytest.mark.server
def test_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HI)


# ---- a small server that requires an API key and queues at most 2 requests -----------------------------

KEY = "test-key-123"


@pytest.fixture(scope="module")
def small_server():
    srv = LiveServer.start("--api-key", KEY, "--max-queued-requests", "2", "--max-running-requests", "1",
                           "--context-length", "256", "--max-total-tokens", "1024", "--chunked-prefill-size",
                           "64", api_key=KEY)
    yield srv
    srv.stop()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
                         ids=["no key", "wrong key", "no Bearer"])
@pytest.mark.server
@pytest.mark.slow
def test_api_key_is_required(small_server, headers):
    r = httpx.post(f"{small_server.url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30)
    assert_error_shape(r, 401)
    r = httpx.get(f"{small_server.url}/v1/models", headers=headers, timeout=30)
    assert_error_shape(r, 401)


@pytest.mark.server
@pytest.mark.slow
def test_api_key_accepted_and_health_open(small_server):
    r = small_server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    assert r.choices[0].message.content
    assert httpx.get(f"{small_server.url}/health", timeout=30).status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{small_server.url}/v1", api_key="wrong", max_retries=0).models.list()


def _flood(srv: LiveServer, n: int, stream: bool) -> list[tuple[int, str]]:
    """Sends n long chat requests at once; (status, body text) of each."""
    barrier = threading.Barrier(n)
    results: list[tuple[int, str] | None] = [None] * n

    def send(i: int) -> None:
        messages = [{"role": "user", "content": f"Tell me a long story number {i}."}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 60, "ignore_eos": True, "temperature": 0,
                "stream": stream}
        barrier.wait()
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, headers=srv.headers,
                          timeout=300) as r:
            results[i] = (r.status_code, r.read().decode())

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


@pytest.mark.server
@pytest.mark.slow
def test_more_than_max_queued_requests_get_503_and_the_rest_complete(small_server):
    # 1 runs, 2 may wait: of 8 long requests sent at once, at most 3 are admitted before the first ends.
    results = [httpx.Response(status, text=text) for status, text in _flood(small_server, 8, stream=False)]
    statuses = [r.status_code for r in results]
    assert set(statuses) <= {200, 503}, statuses
    assert 1 <= statuses.count(200) <= 3, statuses
    for r in results:
        if r.status_code == 503:
            err = assert_error_shape(r, 503)
            assert err["type"] == "server_error"
        else:
            body = r.json()
            assert body["usage"]["completion_tokens"] == 60
            assert body["choices"][0]["finish_reason"] == "length"
    small_server.wait_idle()
    r = small_server.client().chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
    assert r.choices[0].message.content


@pytest.mark.server
@pytest.mark.slow
def test_streaming_requests_over_the_queue_limit_get_503(small_server):
    results = _flood(small_server, 8, stream=True)
    statuses = [status for status, _ in results]
    assert 1 <= statuses.count(200) <= 3 and statuses.count(503) >= 5, statuses
    for status, text in results:
        if status == 200:
            assert '"error"' not in text and text.rstrip().endswith("data: [DONE]")
        else:
            assert_error_shape(httpx.Response(status, text=text), 503)
    small_server.wait_idle()


ENDPOINTS = [("GET", "/v1/models"), ("GET", "/health_generate"), ("GET", "/get_server_info"),
             ("GET", "/metrics"),
             ("GET", "/openapi.json"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
             ("POST", "/generate"), ("POST", "/abort_request"), ("POST", "/flush_cache")]


@pytest.mark.parametrize("method,path", ENDPOINTS)
@pytest.mark.server
@pytest.mark.slow
def test_every_endpoint_but_health_needs_the_key(small_server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.request(method, small_server.url + path, headers=headers, json={}, timeout=30)
        assert_error_shape(r, 401)
    # With the key the same call is not refused for authentication.
    ok = httpx.request(method, small_server.url + path, headers=small_server.headers, json={}, timeout=120)
    assert ok.status_code != 401


def test_server_binds_loopback_by_default():
    from serve.server_args import ServerArgs

    assert ServerArgs().host == "127.0.0.1"


def test_the_prefill_chunk_defaults_by_backend_and_must_be_whole_blocks():
    from serve.server_args import ServerArgs

    block = "prefill_block_size"
    assert ServerArgs().prefill_chunk("cpu") == 256 and ServerArgs().prefill_chunk("gpu") == 512
    assert ServerArgs(chunked_prefill_size=1024).prefill_chunk("cpu") == 1024
    with pytest.raises(ValueError, match=f"chunked_prefill_size=100 must be a multiple of {block}=16"):
        ServerArgs(chunked_prefill_size=100)
    with pytest.raises(ValueError, match=f"chunked_prefill_size=256 must be a multiple of {block}=48"):
        ServerArgs(prefill_block_size=48).prefill_chunk("cpu")  # the default chunk too, when it is used


def test_quantization_choices_are_checked_at_startup():
    """A bad --quantization is one clear error naming the choices, before anything loads."""
    from serve.server_args import ServerArgs

    for choice in (None, "none", "int4", "int8", "fp8", "auto"):
        ServerArgs(quantization=choice)
    with pytest.raises(ValueError, match="quantization='int3' must be one of none, int4, int8, fp8, auto"):
        ServerArgs(quantization="int3")
