"""Engine start time (load + precompile every bucket) with a cold, then warm, persistent compilation cache."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from serve.model_source import resolve_model
from serve.server_args import ServerArgs, add_cli_args, from_cli

_RESULT = "STARTUP_RESULT "  # prefix of the child's one stdout line the parent parses


def child(args_json: str) -> None:
    """Starts one Engine in this (fresh) process and prints its timings as one JSON line."""
    start = time.perf_counter()
    from serve.engine import Engine  # imported here so the import (jax included) is timed

    import_s = time.perf_counter() - start
    engine = Engine(in_process=True, **json.loads(args_json))
    result = {
        "import_s": import_s,
        "startup_s": engine.startup_seconds,
        "precompile_s": engine.precompile_seconds,
        "num_programs": len(engine.runner.programs()),
        "compiles_after_warmup": engine.runner.compiles_after_warmup,
    }
    engine.shutdown()
    print(_RESULT + json.dumps(result), flush=True)


def start_once(args: ServerArgs, label: str) -> dict:
    """Runs `child` in a new interpreter, so no in-process jax cache carries over; raises if it fails."""
    cmd = [sys.executable, "-m", "bench.startup", "--child-args", json.dumps(dataclasses.asdict(args))]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall_s = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{label} start failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    log = [line for line in proc.stderr.splitlines() if line.startswith("[xlaserve]")]
    return {**json.loads(lines[-1][len(_RESULT) :]), "process_s": wall_s, "log": log}


def _dir_stats(path: str) -> tuple[int, int]:
    files = [os.path.join(root, f) for root, _, names in os.walk(path) for f in names]
    return len(files), sum(os.path.getsize(f) for f in files)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_cli_args(p)  # every server flag, with the server's defaults
    p.add_argument("--child-args", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.child_args is not None:
        child(ns.child_args)
        return
    args = from_cli(ns)
    if args.disable_compilation_cache:
        raise ValueError("--disable-compilation-cache leaves nothing to warm; drop it")
    # Pull the model (and fix its path) before timing, so a first download is not counted as startup.
    model_path = resolve_model(args.model, args.resolved_cache_dir())
    if args.tokenizer_path:
        args = dataclasses.replace(
            args, tokenizer_path=resolve_model(args.tokenizer_path, args.resolved_cache_dir())
        )
    user_cache_dir = args.compilation_cache_dir
    with tempfile.TemporaryDirectory(prefix="xlaserve-jax-cache-") as tmp:
        args = dataclasses.replace(args, model=model_path, compilation_cache_dir=user_cache_dir or tmp)
        if user_cache_dir and os.listdir(user_cache_dir):
            print(
                f"warning: --compilation-cache-dir {user_cache_dir} is not empty, so the 'cold' start is not "
                "cold",
                file=sys.stderr,
            )
        print(
            f"model {model_path}; compilation cache {args.compilation_cache_dir}; "
            f"{os.cpu_count()} CPUs, each start in a fresh subprocess"
        )
        cold = start_once(args, "cold")
        for line in cold["log"]:
            print(f"  {line}")
        entries, nbytes = _dir_stats(args.compilation_cache_dir)
        print(f"cold cache filled: {entries} entries, {nbytes / 2**20:.1f} MiB")
        warm = start_once(args, "warm")

    print(
        f"\n{'start':<5} {'process s':>9} {'import s':>8} {'startup s':>9} {'precompile s':>12} "
        f"{'load s':>7} {'programs':>8}"
    )
    for label, r in (("cold", cold), ("warm", warm)):
        print(
            f"{label:<5} {r['process_s']:>9.2f} {r['import_s']:>8.2f} {r['startup_s']:>9.2f} "
            f"{r['precompile_s']:>12.2f} {r['startup_s'] - r['precompile_s']:>7.2f} {r['num_programs']:>8}"
        )
    print(
        "process: subprocess wall time (interpreter + imports + Engine + shutdown); startup: "
        "Engine.startup_seconds (model load, pool sizing, precompile); load: startup - precompile"
    )
    print(
        f"warm/cold: startup {warm['startup_s'] / cold['startup_s']:.2f}, "
        f"precompile {warm['precompile_s'] / cold['precompile_s']:.2f}; "
        f"{cold['num_programs']} step programs"
    )


if __name__ == "__main__":
    main()
