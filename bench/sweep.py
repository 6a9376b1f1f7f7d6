"""Serving benchmark over a grid of input length x output length x concurrency, one JSON per point, a plot.

python -m bench.sweep --base-url http://127.0.0.1:30000 --input-lens 128,512 --output-lens 128 \
    --concurrencies 1,8,32,64 --output-dir sweep-results
python -m bench.sweep --launch --server-args "--max-total-tokens 65536 --max-running-requests 64" ...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx

from bench import serving


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list integers >= 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.sweep", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default=None,
                   help="default http://127.0.0.1:30000, or the launched server's")
    p.add_argument("--backend", choices=list(serving.BACKENDS), default="openai-completions")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--input-lens", type=_ints, default=[128, 512])
    p.add_argument("--output-lens", type=_ints, default=[128])
    p.add_argument("--concurrencies", type=_ints, default=[1, 8, 32, 64])
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per point "
                   "(default: max(--prompts-per-concurrency * concurrency, --min-prompts))")
    p.add_argument("--prompts-per-concurrency", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--random-range-ratio", type=float, default=1.0, help="1.0: exact lengths")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-dir", default="sweep-results")
    p.add_argument("--output-details", action="store_true",
                   help="per-request lengths and latencies in each JSON")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--launch", action="store_true",
                   help="start `xlaserve serve` for the sweep, stop it after")
    p.add_argument("--server-args", default="",
                   help="flags for the launched server, e.g. \"--max-total-tokens "
                   "65536\" (a free port is picked unless --port is among them)")
    p.add_argument("--startup-timeout", type=float, default=1200.0,
                   help="seconds to wait for the launched server")
    return p


def num_prompts_for(ns: argparse.Namespace, concurrency: int) -> int:
    return ns.num_prompts or max(ns.prompts_per_concurrency * concurrency, ns.min_prompts)


def point_argv(ns: argparse.Namespace, base_url: str, input_len: int, output_len: int,
               concurrency: int) -> list[str]:
    """bench.serving's command line for one grid point."""
    argv = ["--base-url", base_url, "--backend", ns.backend, "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", str(ns.random_range_ratio),
            "--num-prompts", str(num_prompts_for(ns, concurrency)),
            "--max-concurrency", str(concurrency), "--request-rate", str(ns.request_rate),
            "--seed", str(ns.seed),
            "--warmup-requests", str(ns.warmup_requests)]
    for flag in ("model", "api_key", "tokenizer", "cache_dir"):
        if getattr(ns, flag):
            argv += ["--" + flag.replace("_", "-"), getattr(ns, flag)]
    return argv + [f for f, on in (("--disable-tqdm", ns.disable_tqdm),
                                   ("--output-details", ns.output_details)) if on]


# ---- a launched server -----------------------------------------------------------------------------------


def launch_server(server_args: str, log_path: str, timeout: float) -> tuple[subprocess.Popen, str]:
    """Starts `python -m serve serve` with `server_args` (in its own process group, output to `log_path`) and
    returns (process, base URL) once GET /health answers 200. Raises RuntimeError if it exits or times out."""
    args = shlex.split(server_args)
    if "--port" not in args:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args += ["--port", str(s.getsockname()[1])]
    port = args[args.index("--port") + 1]
    host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
    base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "serve", "serve", *args], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} during startup; see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2, trust_env=False).status_code == 200:
                return proc, base_url
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (the server drains and stops its children), then SIGKILL to its process group after
    `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own group (start_new_session), children included
            proc.wait()


# ---- report ----------------------------------------------------------------------------------------------


def summary_table(records: list[dict]) -> str:
    """A markdown table, one row per point."""
    cols = [("in", "random_input_len", "d"), ("out", "random_output_len", "d"),
            ("conc", "max_concurrency", "d"),
            ("prompts", "num_prompts", "d"), ("ok/fail", None, ""), ("dur s", "duration_s", ".1f"),
            ("req/s", "request_throughput", ".2f"), ("out tok/s", "output_throughput", ".1f"),
            ("total tok/s", "total_throughput", ".1f"), ("TTFT p50 ms", "median_ttft_ms", ".0f"),
            ("TTFT p99 ms", "p99_ttft_ms", ".0f"), ("TPOT p50 ms", "median_tpot_ms", ".1f"),
            ("ITL p50 ms", "median_itl_ms", ".1f"), ("ITL p99 ms", "p99_itl_ms", ".1f"),
            ("E2E p50 s", "median_e2e_latency_ms", ".2f"), ("peak conc", "max_concurrency_reached", "d")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        cells = []
        for _, key, fmt in cols:
            if key is None:
                cells.append(f"{r['completed']}/{r['failed']}")
            elif r.get(key) is None:
                cells.append("n/a")
            else:
                value = r[key] / 1000.0 if key == "median_e2e_latency_ms" else r[key]
                cells.append(format(value, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(records: list[dict], path: str, title: str) -> None:
    """Output throughput, TTFT p50/p99 and ITL p50/p99 against concurrency; one colour per (input, output)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = sorted({(r["random_input_len"], r["random_output_len"]) for r in records})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    # latencies span orders of magnitude between concurrency 1 and a saturated server: log scale
    panels = [("output throughput (tok/s)", "linear", [("output_throughput", "-", "")]),
              ("TTFT (ms)", "log", [("median_ttft_ms", "-", " p50"), ("p99_ttft_ms", "--", " p99")]),
              ("ITL (ms)", "log", [("median_itl_ms", "-", " p50"), ("p99_itl_ms", "--", " p99")])]
    for ax, (ylabel, yscale, series) in zip(axes, panels):
        for i, (n_in, n_out) in enumerate(pairs):
            pts = sorted((r["max_concurrency"], r) for r in records
                         if (r["random_input_len"], r["random_output_len"]) == (n_in, n_out))
            for key, style, suffix in series:
                xy = [(c, r[key]) for c, r in pts if r.get(key) is not None]
                if xy:
                    ax.plot(*zip(*xy), style, marker="o", color=f"C{i}",
                            label=f"in {n_in} / out {n_out}{suffix}")
        concurrencies = sorted({r["max_concurrency"] for r in records})
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.set_yscale(yscale)
        if yscale == "linear":
            ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_sweep(ns: argparse.Namespace, base_url: str) -> list[dict]:
    """Runs every grid point; writes in{I}_out{O}_c{C}.json per point and sweep.jsonl into --output-dir.
    A point that fails to start (e.g. its warm-up request fails) is reported and skipped."""
    records = []
    open(os.path.join(ns.output_dir, "sweep.jsonl"), "w").close()  # this sweep's points only
    for input_len in ns.input_lens:
        for output_len in ns.output_lens:
            for concurrency in ns.concurrencies:
                label = f"in{input_len}_out{output_len}_c{concurrency}"
                print(f"\n### {label} ({num_prompts_for(ns, concurrency)} prompts)", flush=True)
                argv = point_argv(ns, base_url, input_len, output_len, concurrency)
                try:
                    record = serving.run_benchmark(serving.build_parser().parse_args(argv))
                except (RuntimeError, ValueError) as e:
                    print(f"bench.sweep: {label} failed: {e}", file=sys.stderr)
                    continue
                with open(os.path.join(ns.output_dir, f"{label}.json"), "w") as f:
                    json.dump(record, f, indent=1)
                with open(os.path.join(ns.output_dir, "sweep.jsonl"), "a") as f:
                    f.write(json.dumps(record) + "\n")
                records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.sweep`; returns 0 when every point ran with no failed request."""
    ns = build_parser().parse_args(argv)
    os.makedirs(ns.output_dir, exist_ok=True)
    started = time.perf_counter()
    proc = None
    base_url = ns.base_url or "http://127.0.0.1:30000"
    try:
        if ns.launch:
            log_path = os.path.join(ns.output_dir, "server.log")
            print(f"starting the server ({ns.server_args or 'default flags'}); log in {log_path}", flush=True)
            proc, base_url = launch_server(ns.server_args, log_path, ns.startup_timeout)
            print(f"server up at {base_url} after {time.perf_counter() - started:.0f} s", flush=True)
        records = run_sweep(ns, base_url)
    except RuntimeError as e:
        print(f"bench.sweep: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            stop_server(proc)
    total_s = time.perf_counter() - started
    if not records:
        print("bench.sweep: no point ran", file=sys.stderr)
        return 1
    table = summary_table(records)
    first = records[0]
    host = first["client_host"]
    title = (f"{first['backend']} | {first['model']} | device: {first['device']} | client {host['cpu']} x "
             f"{host['num_cpus']} | {first['timestamp']}")
    with open(os.path.join(ns.output_dir, "summary.md"), "w") as f:
        f.write(f"{title}\n\n{table}\n\ntotal sweep time {total_s:.0f} s\n")
    png = os.path.join(ns.output_dir, "sweep.png")
    try:
        plot(records, png, title)
    except ImportError:
        png = "none (matplotlib is not installed: pip install 'xlaserve[bench]')"
    print(f"\n{title}\n{table}\n\nplot: {png}\ntotal sweep time {total_s:.0f} s")
    expected = len(ns.input_lens) * len(ns.output_lens) * len(ns.concurrencies)
    return 0 if len(records) == expected and all(r["failed"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
