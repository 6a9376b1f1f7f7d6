"""A real `xlaserve serve` subprocess for end-to-end tests, and the session-wide shared one.

Test modules load this as a plugin (`pytest_plugins = ["tests.live_server"]`) so that the session-scoped
`server` fixture is defined once and every module talks to the same process.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import openai
import psutil
import pytest

from tests.helpers import REPO

MODEL = "smollm2-135m-instruct"
# The shared server's flags; tests that need others start their own (see `LiveServer.start`).
SHARED_FLAGS = ("--max-running-requests", "8", "--context-length", "512", "--max-total-tokens", "4096",
                "--chunked-prefill-size", "128")
STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `procs` still alive after waiting up to `timeout` s (an unreaped zombie counts as gone)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout)

    def running(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [p for p in alive if running(p)]


class LiveServer:
    """One server process; `stop()` (or the fixture teardown) ends it and checks its children are gone."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: str, api_key: str | None):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{port}"
        self.children: list[psutil.Process] = []

    @classmethod
    def start(cls, *flags: str, env: dict[str, str] | None = None, api_key: str | None = None,
              own_process_group: bool = False) -> LiveServer:
        """Starts `python -m serve serve --port <free> *flags` and returns once /health answers 200.

        `api_key` is only what clients of this object send; pass `--api-key` in `flags` or
        XLASERVE_API_KEY in `env` to make the server require it. With `own_process_group` the server leads a
        new process group, so that `os.killpg` reaches the server and its children and not pytest.
        """
        port = free_port()
        fd, log_path = tempfile.mkstemp(prefix=f"xlaserve-test-{port}-", suffix=".log")
        full_env = {k: v for k, v in os.environ.items() if k != "XLASERVE_API_KEY"}  # only what env says
        full_env.update(env or {})
        proc = subprocess.Popen([sys.executable, "-m", "serve", "serve", "--port", str(port), *flags],
                                cwd=REPO, env=full_env, stdout=fd, stderr=subprocess.STDOUT,
                                process_group=0 if own_process_group else None)
        os.close(fd)
        server = cls(proc, port, log_path, api_key)
        try:
            server._wait_ready()
        except BaseException:
            server.stop()
            raise
        server.children = psutil.Process(proc.pid).children(recursive=True)
        return server

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200 and "serving " in self.log():
                    return
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 4000) -> str:
        return self.log()[-n:]

    # ---- clients -------------------------------------------------------------------------

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "x", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "x", max_retries=0, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=kw.pop("timeout", 60), **kw)

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={**self.headers, **kw.pop("headers", {})},
                          timeout=kw.pop("timeout", 120), **kw)

    def info(self) -> dict:
        r = self.get("/get_server_info")
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Polls /get_server_info until nothing runs or waits and the whole KV pool is free; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if (info["num_running_requests"] == 0 and info["num_waiting_requests"] == 0
                    and info["free_tokens"] == info["max_total_tokens"] and info["in_flight_requests"] == 0):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {json.dumps(info)}")
            time.sleep(0.1)

    # ---- shutdown ------------------------------------------------------------------------

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM, then SIGKILL after `timeout`; kills any child left behind.

        Raises AssertionError (after cleaning up) unless the server exited 0 and its children are gone;
        the log file is deleted otherwise.
        """
        problems = []
        if self.proc.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):  # those spawned since start(), if any
                known = {p.pid for p in self.children}
                self.children += [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                                  if p.pid not in known]
            self.proc.send_signal(signal.SIGTERM)
            try:
                if self.proc.wait(timeout) != 0:
                    problems.append(f"exit code {self.proc.returncode} after SIGTERM")
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                problems.append(f"still running {timeout} s after SIGTERM")
        alive = still_running(self.children, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        if alive:
            problems.append(f"children left behind: {[p.pid for p in alive]}")
        if problems:
            raise AssertionError(f"server {self.proc.pid}: {'; '.join(problems)} (log: {self.log_path})\n"
                                 f"{self.log_tail()}")
        with contextlib.suppress(OSError):
            os.remove(self.log_path)  # kept only when something went wrong


@pytest.fixture(scope="session")
def server() -> Iterator[LiveServer]:
    """The shared server (SHARED_FLAGS), started once per test session."""
    srv = LiveServer.start(*SHARED_FLAGS)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def hf_tokenizer(server: LiveServer):
    """transformers' tokenizer of the served model, from the HF-style directory built for its GGUF."""
    from transformers import AutoTokenizer

    from serve.tokenizer import load_tokenizer

    model_path = server.info()["model_path"]
    if os.path.isdir(model_path):
        return AutoTokenizer.from_pretrained(model_path)
    from serve.server_args import ServerArgs

    cache_dir = ServerArgs().resolved_cache_dir()
    load_tokenizer(model_path, cache_dir)  # makes sure the directory exists
    stem = os.path.basename(model_path).removesuffix(".gguf")
    dirs = glob.glob(os.path.join(cache_dir, "tokenizers", f"{stem}-*"))
    return AutoTokenizer.from_pretrained(max(dirs, key=os.path.getmtime))


def chat_prompt_ids(hf_tokenizer, messages: list[dict]) -> list[int]:
    """The chat-template-applied prompt's token ids, by transformers (independent of the server's code)."""
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf_tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_error_shape(response: httpx.Response, status: int, param: str | None = ...) -> dict:
    """The OpenAI error body: {"error": {"message", "type", "param", "code"}}; returns the inner object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not ...:
        assert err["param"] == param, err
    return err
