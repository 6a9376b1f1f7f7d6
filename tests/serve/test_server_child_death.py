"""A dead child process takes the server down with a clear log line instead of leaving it hanging."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

pytest.register_assert_rewrite("tests.live_server")  # before its import, so its asserts explain failures
from tests.live_server import SHARED_FLAGS, LiveServer  # noqa: E402

# A server of its own (10-20 s to start).
pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_killed_scheduler_stops_the_server():
    srv = LiveServer.start(*SHARED_FLAGS)
    try:
        # The scheduler is the child holding the model: the one with the most memory.
        victim = max(srv.children, key=lambda c: c.memory_info().rss)
        os.kill(victim.pid, signal.SIGKILL)
        code = srv.proc.wait(timeout=60)
        assert code != 0
        assert "process died" in srv.log() and "shutting down the server" in srv.log(), srv.log_tail()
        _, alive = psutil.wait_procs(srv.children, timeout=10)
        assert not alive, "orphan children left behind"
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
