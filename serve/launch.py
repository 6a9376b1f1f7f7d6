"""Start the server: scheduler and detokenizer processes (serve/children.py), then FastAPI/uvicorn in this
process (on a follower node of a multi-host server: only the follower loop).

A child that dies takes the server down with a clear log line; SIGTERM/SIGINT drain in-flight
requests (new ones get 503) for up to `shutdown_timeout` seconds, then the children are stopped and
everything exits. The children ignore SIGTERM/SIGINT, so a signal to the whole process group or cgroup
(Ctrl-C, systemd) drains exactly as one to this process alone.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

from serve.children import ChildProcesses
from serve.server_args import ServerArgs
from serve.setup import log


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
    children = ChildProcesses(args)  # on this, the main, thread: they then die with it (PR_SET_PDEATHSIG)
    try:
        _, tokenizer = load_model_tokenizer_path(args)
        tm = TokenizerManager(tokenizer, children.scheduler_ready, children.scheduler_addr,
                              children.output_addr, args.random_seed)
        app = build_app(args, tm)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                access_log=False, timeout_graceful_shutdown=1)
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
        log(f"serving {children.scheduler_ready.get('model_path', args.model)} "
            f"at http://{args.host}:{args.port} "
            f"(OpenAI API under /v1)")
        asyncio.run(server.serve())
        return exit_code["code"]
    finally:
        children.terminate()
