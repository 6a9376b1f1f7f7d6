"""Start the server: scheduler and detokenizer processes, then FastAPI/uvicorn in this process (on a
follower node of a multi-host server: only the follower loop).

A child that dies takes the server down with a clear log line; SIGTERM/SIGINT drain in-flight
requests (new ones get 503) for up to `shutdown_timeout` seconds, then everything exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
import uuid

from serve.server_args import ServerArgs
from serve.setup import log


class ChildProcesses:
    def __init__(self, args: ServerArgs):
        from serve.detokenizer import run_detokenizer_process
        from serve.scheduler_process import run_scheduler_process

        base = os.path.join(tempfile.gettempdir(), f"xlaserve-{uuid.uuid4().hex[:12]}")
        self.scheduler_addr = f"ipc://{base}-scheduler"
        self.detokenizer_addr = f"ipc://{base}-detokenizer"
        self.output_addr = f"ipc://{base}-output"
        ctx = mp.get_context("spawn")  # never fork a process that may hold JAX/XLA threads
        sched_r, sched_w = ctx.Pipe(duplex=False)
        detok_r, detok_w = ctx.Pipe(duplex=False)
        self.procs = {
            "scheduler": ctx.Process(target=run_scheduler_process, name="xlaserve-scheduler", daemon=True,
                                     args=(args, self.scheduler_addr, self.detokenizer_addr, sched_w)),
            "detokenizer": ctx.Process(target=run_detokenizer_process, name="xlaserve-detokenizer", daemon=True,
                                       args=(args, self.detokenizer_addr, self.output_addr, detok_w)),
        }
        self.stopping = False
        for p in self.procs.values():
            p.start()
        try:
            self.detok_ready = self._wait(detok_r, "detokenizer")
            self.scheduler_ready = self._wait(sched_r, "scheduler")
        except BaseException:  # includes a signal during startup: never leave the children behind
            self.terminate()
            raise

    def _wait(self, conn, name: str) -> dict:
        proc = self.procs[name]
        while not conn.poll(0.5):
            if not proc.is_alive():
                self.terminate()
                raise RuntimeError(f"the {name} process exited during startup (exit code {proc.exitcode})")
        msg = conn.recv()
        if not msg.get("ok"):
            self.terminate()
            raise RuntimeError(f"the {name} process failed to start: {msg.get('error')}")
        return msg

    def watch(self, on_death) -> None:
        """Calls `on_death(name, exitcode)` from a thread if a child exits while the server runs."""

        def loop():
            while not self.stopping:
                for name, p in self.procs.items():
                    if not p.is_alive() and not self.stopping:
                        on_death(name, p.exitcode)
                        return
                time.sleep(0.5)

        threading.Thread(target=loop, name="xlaserve-watchdog", daemon=True).start()

    def terminate(self) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def run_follower(args: ServerArgs) -> int:
    """A follower node (`node_rank > 0`): no HTTP server and no scheduler; loads its shards, precompiles and
    runs node 0's steps until node 0 stops (exit 0)."""
    from runtime.distributed import follow
    from serve.setup import build_core

    core = build_core(args)
    log(f"node {args.node_rank}: following node 0 at {args.dist_init_addr}")
    follow(core.runner, args.dist_init_addr, args.node_rank)
    return 0


def launch_server(args: ServerArgs) -> int:
    """Runs the server until SIGTERM/SIGINT (exit 0) or a child process dies (exit 1). On a follower node of a
    multi-host server (`node_rank > 0`) it follows node 0 instead (`run_follower`)."""
    if args.node_rank > 0:
        return run_follower(args)
    import asyncio

    import uvicorn

    from serve.http_server import build_app
    from serve.setup import load_model_tokenizer_path
    from serve.tokenizer_manager import TokenizerManager

    def stop_during_startup(signum, frame):
        raise SystemExit(128 + signum)

    # Until the server runs, a signal stops startup; ChildProcesses cleans up its children on the way out.
    signal.signal(signal.SIGTERM, stop_during_startup)
    signal.signal(signal.SIGINT, stop_during_startup)
    children = ChildProcesses(args)
    try:
        _, tokenizer = load_model_tokenizer_path(args)
        tm = TokenizerManager(tokenizer, children.scheduler_ready, children.scheduler_addr, children.output_addr,
                              args.random_seed)
        app = build_app(args, tm)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                                timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        exit_code = {"code": 0}

        def on_death(name: str, code: int | None) -> None:
            log(f"the {name} process died (exit code {code}); shutting down the server")
            exit_code["code"] = 1
            server.should_exit = True

        def on_signal(signum, frame) -> None:
            if tm.draining:  # a second signal: stop now
                server.should_exit = True
                return
            log(f"received {signal.Signals(signum).name}: finishing {tm.num_in_flight} in-flight requests "
                f"(up to {args.shutdown_timeout:.0f} s), refusing new ones")
            tm.draining = True

            def drain():
                deadline = time.monotonic() + args.shutdown_timeout
                while tm.num_in_flight and time.monotonic() < deadline:
                    time.sleep(0.05)
                server.should_exit = True

            threading.Thread(target=drain, daemon=True).start()

        children.watch(on_death)
        # Ours drain first; uvicorn's own handlers (installed by `capture_signals` inside `serve`) would
        # cancel in-flight requests after a 1 s grace period.
        server.capture_signals = contextlib.nullcontext
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        log(f"serving {children.scheduler_ready.get('model_path', args.model)} at http://{args.host}:{args.port} "
            f"(OpenAI API under /v1)")
        asyncio.run(server.serve())
        return exit_code["code"]
    finally:
        children.terminate()
