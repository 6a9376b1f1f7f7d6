"""A dead child process takes the server down with a clear log line instead of leaving it hanging."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_killed_scheduler_stops_the_server(tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "serve", "serve", "--port", str(port), "--max-running-requests", "8",
         "--context-length", "512", "--max-total-tokens", "4096", "--chunked-prefill-size", "128"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise AssertionError("server did not start")
        children = psutil.Process(proc.pid).children(recursive=True)
        sched = [c for c in children if "scheduler" in " ".join(c.cmdline()) or c.name() == "xlaserve-scheduler"]
        # spawn children show as python processes; the scheduler is the one holding the most memory
        victim = sched[0] if sched else max(children, key=lambda c: c.memory_info().rss)
        os.kill(victim.pid, signal.SIGKILL)
        code = proc.wait(timeout=60)
        assert code != 0
        log.seek(0)
        text = log.read()
        assert "process died" in text and "shutting down the server" in text, text[-2000:]
        time.sleep(1)
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "orphans left"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
