"""The scheduler and detokenizer child processes: started as `python -m serve.children NAME`, stopped by the
process that started them, and gone within a second of its death however it dies.

Protocol (both sides are in this file so that they cannot drift apart):

- The child runs `python -P -m serve.children NAME --ready-fd FD --parent-pid PID [--die-with-parent] ADDR...`
  with PYTHONPATH set to the parent's `sys.path`, so it imports the same packages as the parent without
  re-running the parent's `__main__` (a script without a `__main__` guard, `python - < file` and a REPL all
  work, unlike multiprocessing's spawn). `-P` keeps the working directory off the path, so a stray
  `serve.py` there cannot shadow the package (it is on the parent's path anyway if the parent uses it).
- ServerArgs arrive as JSON on the child's stdin (never on the command line, which any user can read with
  `ps`: it may hold the API key).
- The child writes one JSON line to the inherited pipe FD, `{"ok": true, ...}` when ready or
  `{"ok": false, "error": ...}`, then closes it; the parent sees EOF without a line if the child died first.
- Stopping: the child ignores SIGINT and SIGTERM, because those arrive for the whole process group (Ctrl-C
  in a terminal) or the whole cgroup (systemd's KillMode=control-group) and the server must drain its
  in-flight requests before the children go. The parent sends STOP_SIGNAL (SIGUSR1) after the drain; the
  child raises SystemExit on it, so its `finally` blocks run, and the parent kills it if it is not gone
  within `STOP_GRACE_S`.
- Parent death (even `kill -9`): with `--die-with-parent` the kernel SIGKILLs the child when the parent dies
  (PR_SET_PDEATHSIG). Linux ties that to the parent *thread* that created the child, so the parent passes
  the flag only when starting children from its main thread. A thread in the child also polls getppid()
  every POLL_S seconds as the portable backstop; it works while the main thread is busy or blocked.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

STOP_SIGNAL = signal.SIGUSR1
STOP_GRACE_S = 10.0  # a step or an XLA compile finishes well within this; then the child is killed
POLL_S = 0.5

# name -> (module, entry function): the entry takes (ServerArgs, *addresses, report_ready).
ENTRIES = {
    "scheduler": ("serve.scheduler_process", "run_scheduler_process"),
    "detokenizer": ("serve.detokenizer", "run_detokenizer_process"),
}


# ---- the parent's side -------------------------------------------------------------------------------------


class ChildProcesses:
    """Starts the scheduler and detokenizer and waits until both are ready (`scheduler_ready`, `detok_ready`
    hold their reports).

    Raises RuntimeError naming the child if one fails or exits during startup, after stopping the other; a
    BaseException during startup (a signal) also stops both. Create it on the main thread where possible:
    children started from another thread notice the parent's death by polling only (up to POLL_S late).
    """

    def __init__(self, args):
        base = os.path.join(tempfile.gettempdir(), f"xlaserve-{uuid.uuid4().hex[:12]}")
        self.scheduler_addr = f"ipc://{base}-scheduler"
        self.detokenizer_addr = f"ipc://{base}-detokenizer"
        self.output_addr = f"ipc://{base}-output"
        self.procs: dict[str, subprocess.Popen] = {}
        self._ready_fds: dict[str, int] = {}
        self.stopping = False
        config = json.dumps(dataclasses.asdict(args)).encode()
        try:
            self._start("scheduler", config, self.scheduler_addr, self.detokenizer_addr)
            self._start("detokenizer", config, self.detokenizer_addr, self.output_addr, self.scheduler_addr)
            self.detok_ready = self._wait("detokenizer")
            self.scheduler_ready = self._wait("scheduler")
        except BaseException:  # includes a signal during startup: never leave the children behind
            self.terminate()
            raise

    def _start(self, name: str, config: bytes, *addrs: str) -> None:
        read_fd, write_fd = os.pipe()
        self._ready_fds[name] = read_fd
        cmd = [sys.executable, "-P", "-m", "serve.children", name, "--ready-fd", str(write_fd),
               "--parent-pid", str(os.getpid()), *addrs]
        if threading.current_thread() is threading.main_thread():
            cmd.append("--die-with-parent")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if isinstance(p, str))}
        try:
            # stdout and stderr are inherited: the child's log lines and tracebacks land in the server's log.
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env)
            self.procs[name] = proc
        finally:
            os.close(write_fd)  # the child holds the only write end: EOF here once it reports or dies
        with contextlib.suppress(BrokenPipeError):  # it died at once: `_wait` reports its exit code
            proc.stdin.write(config)
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()

    def _wait(self, name: str) -> dict:
        proc, fd = self.procs[name], self._ready_fds[name]
        poller = select.poll()  # not select.select: a process with many files open may hand us fd > 1023
        poller.register(fd, select.POLLIN)
        data = b""
        while not data.endswith(b"\n"):
            if not poller.poll(POLL_S * 1000):
                if proc.poll() is None:
                    continue
                # exited, yet a grandchild may hold the pipe open: take what is there without blocking
                os.set_blocking(fd, False)
            chunk = b""
            with contextlib.suppress(BlockingIOError):
                chunk = os.read(fd, 1 << 16)
            if not chunk:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(STOP_GRACE_S)
                raise RuntimeError(f"the {name} process exited during startup (exit code {proc.returncode})")
            data += chunk
        msg = json.loads(data)
        if not msg.get("ok"):
            raise RuntimeError(f"the {name} process failed to start: {msg.get('error')}")
        return msg

    def dead(self) -> tuple[str, int] | None:
        """(name, exit code) of a child that has exited, if any."""
        for name, p in self.procs.items():
            if p.poll() is not None:
                return name, p.returncode
        return None

    def watch(self, on_death) -> None:
        """Calls `on_death(name, exitcode)` from a thread if a child exits while the server runs."""

        def loop():
            while not self.stopping:
                dead = self.dead()
                if dead is not None and not self.stopping:
                    on_death(*dead)
                    return
                time.sleep(POLL_S)

        threading.Thread(target=loop, name="xlaserve-watchdog", daemon=True).start()

    def terminate(self) -> None:
        """Stops the children (STOP_SIGNAL, then SIGKILL after STOP_GRACE_S) and removes their sockets'
        files. Idempotent; safe to call at interpreter exit."""
        self.stopping = True
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(STOP_SIGNAL)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for fd in self._ready_fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._ready_fds.clear()
        for addr in (self.scheduler_addr, self.detokenizer_addr, self.output_addr):
            with contextlib.suppress(OSError):  # a killed child leaves its bound socket's file behind
                os.unlink(addr.removeprefix("ipc://"))


# ---- the child's side --------------------------------------------------------------------------------------


def _stop(signum, frame) -> None:
    raise SystemExit(0)


def _die_with_parent(parent_pid: int) -> None:
    """PR_SET_PDEATHSIG(SIGKILL) where the platform has it; then exit if the parent is already gone (it may
    have died before the call, and the kernel would never send the signal)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _watch_parent(parent_pid: int, name: str) -> None:
    """A daemon thread: once the parent is gone, stop the main thread as the parent would, and exit hard if
    that has not worked within STOP_GRACE_S (the main thread may be blocked in native code)."""
    main = threading.main_thread().ident

    def loop():
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        print(f"[xlaserve] {name}: the server process is gone; exiting", file=sys.stderr, flush=True)
        signal.pthread_kill(main, STOP_SIGNAL)  # to the main thread, so a blocking call returns EINTR
        time.sleep(STOP_GRACE_S)
        os._exit(1)

    threading.Thread(target=loop, name=f"xlaserve-{name}-parent-watch", daemon=True).start()


def _reporter(fd: int):
    """`report_ready(msg)`: writes `msg` as one JSON line to the parent, once; a parent that stopped
    listening (it is shutting down) is not an error."""
    sent = []

    def report_ready(msg: dict) -> None:
        if sent:  # the fd is closed, and its number may belong to another file by now
            return
        sent.append(msg)
        with contextlib.suppress(OSError), os.fdopen(fd, "wb") as f:
            f.write(json.dumps(msg).encode() + b"\n")

    return report_ready


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m serve.children")
    parser.add_argument("name", choices=sorted(ENTRIES))
    parser.add_argument("addrs", nargs="+")
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--die-with-parent", action="store_true")
    ns = parser.parse_args(argv)
    # First, before the slow imports: from here on a signal to the group or cgroup cannot cut the drain short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(STOP_SIGNAL, _stop)
    if ns.die_with_parent:
        _die_with_parent(ns.parent_pid)
    _watch_parent(ns.parent_pid, ns.name)
    report_ready = _reporter(ns.ready_fd)
    try:
        import importlib

        from serve.server_args import ServerArgs

        args = ServerArgs(**json.load(sys.stdin))
        module, func = ENTRIES[ns.name]
        entry = getattr(importlib.import_module(module), func)
    except BaseException as e:
        report_ready({"ok": False, "error": f"{type(e).__name__}: {e}"})
        raise
    entry(args, *ns.addrs, report_ready)


if __name__ == "__main__":
    main()
