"""The `xlaserve` command line: `generate` for a quick try, `pull` and `build-kernels` to prepare ahead."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from serve.server_args import ServerArgs, add_cli_args, from_cli


def _server_args(ns: argparse.Namespace) -> ServerArgs:
    """The options, or exit 2 with one line saying which value is wrong (not a traceback)."""
    try:
        return from_cli(ns)
    except ValueError as e:
        print(f"xlaserve: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _generate(ns: argparse.Namespace) -> int:
    from serve.engine import Engine

    args = _server_args(ns)
    engine = Engine(**dataclasses.asdict(args))
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p,
              "top_k": ns.top_k}
    if ns.seed is not None:
        params["seed"] = ns.seed
    try:
        for prompt in ns.prompt:
            if ns.raw:
                out = engine.generate(prompt=prompt, sampling_params=params)
            else:
                out = engine.chat([{"role": "user", "content": prompt}], sampling_params=params)
            if ns.json:
                print(json.dumps(out))
            else:
                meta = out["meta_info"]
                print(out["text"])
                print(f"[{meta['completion_tokens']} tokens, {meta['e2e_latency']:.2f} s, "
                      f"finish {meta['finish_reason']}]", file=sys.stderr)
    finally:
        engine.shutdown()
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from serve.launch import launch_server

    return launch_server(_server_args(ns))


def _pull(ns: argparse.Namespace) -> int:
    """Prints the model's path on stdout (for `MODEL=$(xlaserve pull)`), except to a terminal that the pull's
    last progress line ("saved to PATH", on stderr) has just shown it to. An unknown alias or a failed
    download: the reason on stderr, exit 1."""
    from serve.model_source import DEFAULT_MODEL, cached_model_path, pull_model

    alias = ns.name or DEFAULT_MODEL
    cache_dir = ServerArgs(cache_dir=ns.cache_dir).resolved_cache_dir()
    try:
        cached = not ns.force and os.path.isfile(cached_model_path(alias, cache_dir))
        path = pull_model(alias, cache_dir, force=ns.force)
    except (ValueError, RuntimeError) as e:
        print(f"xlaserve pull: {e}", file=sys.stderr)
        return 1
    if cached or not (sys.stdout.isatty() and sys.stderr.isatty()):
        print(path)
    return 0


def _build_kernels(ns: argparse.Namespace) -> int:
    """Builds (or finds built) the native CPU kernels where `serve` will look for them, from the same
    environment ($CXX, XLASERVE_CPU_KERNELS, $XLASERVE_CACHE_DIR), and prints the library's path: exit 0.
    Prints why they are unavailable to stderr and exits 1 otherwise, so an image build that cannot compile
    them fails there instead of serving on the slow references."""
    from kernels.cpu import build
    from serve import native_kernels

    try:
        native_kernels.configure(ServerArgs(cache_dir=ns.cache_dir).resolved_cache_dir())
    except ValueError as e:
        print(f"xlaserve build-kernels: {e}", file=sys.stderr)
        return 2
    result = build.build()
    if result.path is None:
        print(f"native CPU kernels unavailable: {result.reason}", file=sys.stderr)
        return 1
    print(result.path)
    return 0


# `xlaserve bench ...` and `xlaserve eval ...` forward to the bench package's own CLIs. They are looked up by
# name at call time: bench/ sits outside the serving code's import graph (nothing in it imports bench).
_FORWARDED = {
    ("bench", "serving"): "bench.serving",
    ("bench", "sweep"): "bench.sweep",
    ("bench", "soak"): "bench.soak",
    ("bench", "one-batch"): "bench.one_batch",
    ("bench", "startup"): "bench.startup",
    ("bench", "multi-turn"): "bench.multiturn",
    ("eval",): "bench.eval",
}


# Modules of an optional extra that forwarded commands import: a missing one is named with its extra.
_EXTRA_OF_MODULE = {"matplotlib": "bench"}
_OUR_PACKAGES = ("serve", "runtime", "kernels", "models", "scheduler", "memory", "bench")


def _forward(argv: list[str]) -> int | None:
    """Runs a forwarded subcommand if argv names one; None otherwise. A third-party module it needs that is
    not installed ends it with exit 2 and one line naming what to install (not a traceback)."""
    import importlib

    for prefix, module in _FORWARDED.items():
        if tuple(argv[: len(prefix)]) == prefix:
            command = f"xlaserve {' '.join(prefix)}"
            rest = argv[len(prefix):]
            try:
                mod = importlib.import_module(module)
                if module == "bench.one_batch" or module == "bench.startup":
                    sys.argv = [command, *rest]
                    return mod.main() or 0
                return mod.main(rest) or 0
            except ModuleNotFoundError as e:
                top = (e.name or "").split(".")[0]
                if not top or top in _OUR_PACKAGES:  # a broken checkout, not a missing dependency
                    raise
                extra = _EXTRA_OF_MODULE.get(top)
                fix = f"pip install 'xlaserve[{extra}]'" if extra else f"pip install {top}"
                print(f"{command}: needs the Python package {top!r}, which is not installed: {fix}",
                      file=sys.stderr)
                return 2
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xlaserve", description="LLM serving engine on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_cli_args(srv)
    srv.set_defaults(func=_serve)

    gen = sub.add_parser("generate",
                         help="load a model and answer prompts in-process (chat template unless --raw)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="print SGLang-shaped JSON results")
    add_cli_args(gen)
    gen.set_defaults(func=_generate)

    pull = sub.add_parser("pull",
                          help="download a model alias into the cache (then everything works offline)")
    pull.add_argument("name", nargs="?", default=None, help="alias (default: smollm2-135m-instruct)")
    pull.add_argument("--cache-dir", default=None)
    pull.add_argument("--force", action="store_true", help="download again even if cached")
    pull.set_defaults(func=_pull)

    kernels = sub.add_parser("build-kernels",
                             help="compile the native CPU kernels ahead of time (prints the library's path)")
    kernels.add_argument("--cache-dir", default=None,
                         help="as serve's --cache-dir (default: $XLASERVE_CACHE_DIR or the user cache); the "
                              "library goes to its cpu_kernels/")
    kernels.set_defaults(func=_build_kernels)

    bench = sub.add_parser("bench", help="benchmarks: serving (load test), sweep, soak, one-batch, startup, "
                                         "multi-turn (each has its own --help)")
    bench.add_argument("which", choices=["serving", "sweep", "soak", "one-batch", "startup", "multi-turn"])
    sub.add_parser("eval", help="accuracy evals against an OpenAI-compatible server: gsm8k, aime, math "
                                "(see `xlaserve eval --help`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    forwarded = _forward(argv)
    if forwarded is not None:
        return forwarded
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
