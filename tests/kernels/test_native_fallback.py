"""Without native CPU kernels (no compiler, a failed compile, switched off) the startup log says so once, as a
WARNING with the reason and the cost, and the references serve; concurrent first uses build once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.tiny_models import save_tiny_llama

COST = ("their jnp references run instead, decode up to 2-4x and long-context prefill up to 3x slower "
        "(with a bf16 KV cache, seconds a step: XLA:CPU converts the whole pool for each write)")


def _run(code: str, env_changes: dict[str, str], cache: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "XLASERVE_CPU_KERNELS")}
    env.update(env_changes, XLASERVE_CACHE_DIR=cache, PYTHONPATH=REPO)  # an empty kernel cache: it must build
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.slow
def test_engine_startup_warns_once_and_serves_on_the_references(tmp_path) -> None:
    model = save_tiny_llama(str(tmp_path / "llama"))
    code = (
        "import json, sys\nfrom serve import Engine\n"
        "engine = Engine(model=sys.argv[1], in_process=True, skip_tokenizer_init=True, context_length=64,\n"
        "                max_running_requests=1, chunked_prefill_size=32, max_total_tokens=256)\n"
        "out = engine.generate(input_ids=[1, 5, 9], sampling_params={'max_new_tokens': 4})\n"
        "print(json.dumps(out['output_ids']))\n"
    )
    result = _run(code, {"CXX": "/nonexistent/c++"}, str(tmp_path / "cache"), model)
    assert result.returncode == 0, result.stderr[-4000:]
    assert len(json.loads(result.stdout.strip().splitlines()[-1])) == 4
    lines = result.stderr.splitlines()
    warnings = [line for line in lines if "native CPU kernels" in line]
    expected = (
        "[xlaserve] WARNING: native CPU kernels are off: cannot run the C++ compiler '/nonexistent/c++' "
        "(No such file or directory). matmul, decode_attention, prefill_attention, ssd_decode_update, "
        "conv1d_decode_update, gated_delta_decode_update, kda_decode_update, argmax, logsumexp, silu_mul, "
        f"qmatmul, write_rows: {COST}"
    )
    assert warnings == [expected], result.stderr[-4000:]
    (kernels_line,) = [line for line in lines if line.startswith("[xlaserve] kernels:")]
    assert "=native" not in kernels_line and "matmul=reference" in kernels_line
    assert lines.index(kernels_line) + 1 == lines.index(warnings[0])  # next to the kernels line, not later


# The startup's configuration from the environment and report, then the ops' own check, which must not warn
# a second time.
REPORT = (
    "from kernels.backend import KernelBackends\n"
    "from kernels import cpu\n"
    "from serve import native_kernels\n"
    "from serve.server_args import ServerArgs\n"
    "from serve.setup import log_kernels\n"
    "native_kernels.configure(ServerArgs().resolved_cache_dir())\n"
    "log_kernels(KernelBackends(), None)\n"
    "assert not cpu.available()\n"
)


@pytest.mark.parametrize("case", ["no compiler", "compile error", "switched off"])
def test_the_warning_names_the_reason(case: str, tmp_path) -> None:
    if case == "no compiler":  # c++, g++ and clang++ are looked up on PATH
        env, reason = (
            {"PATH": str(tmp_path)},
            "no C++ compiler configured or found on PATH (c++, g++, clang++); install g++ or clang++",
        )
    elif case == "compile error":
        env, reason = {"CXX": "false"}, "false failed to compile them (exit 1; its errors are logged above)"
    else:
        env, reason = {"XLASERVE_CPU_KERNELS": "0"}, "disabled by XLASERVE_CPU_KERNELS=0"
    result = _run(REPORT, env, str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr[-4000:]
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line or "CPU kernels off" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"[xlaserve] WARNING: native CPU kernels are off: {reason}. matmul, "
    ), result.stderr
    assert warnings[0].endswith(COST)
    if case == "compile error":  # the compiler's command line is logged for the details
        assert "false -O3 -march=native" in result.stderr


def test_first_uses_on_many_threads_build_once_and_warn_once(tmp_path) -> None:
    # A "compiler" that counts its runs and fails; the runner precompiles on threads, any may come first.
    counter, compiler = tmp_path / "runs", tmp_path / "cxx"
    compiler.write_text(f"#!/bin/sh\necho run >> {counter}\nexit 1\n")
    compiler.chmod(0o755)
    code = (
        "import concurrent.futures, sys\nfrom kernels import cpu\n"
        "cpu.configure(cpu.BuildConfig(compiler=sys.argv[1], cache_dir=sys.argv[2]))\n"
        "with concurrent.futures.ThreadPoolExecutor(8) as pool:\n"
        "    assert not any(pool.map(lambda _: cpu.available(), range(8)))\n"
    )
    result = _run(code, {}, str(tmp_path / "cache"), str(compiler), str(tmp_path / "cache" / "cpu_kernels"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert counter.read_text() == "run\n"
    summaries = [line for line in result.stderr.splitlines() if line.startswith("native CPU kernels off:")]
    expected = (
        f"native CPU kernels off: {compiler} failed to compile them (exit 1; its errors are logged above)"
    )
    assert summaries == [f"{expected}; {COST}"], result.stderr


def test_the_kernels_read_no_environment_serve_applies_it(tmp_path) -> None:
    # No compiler on PATH and an empty cache: kernels/cpu alone (given only the cache) ignores CXX and
    # XLASERVE_CPU_KERNELS=0, and finds no compiler; configured by serve from the environment, it is off.
    code = (
        "import os, sys\nfrom kernels.cpu import build\n"
        "if sys.argv[1] == 'serve':\n"
        "    from serve import native_kernels\n"
        "    native_kernels.configure(sys.argv[2])\n"
        "else:\n"
        "    build.configure(build.BuildConfig(cache_dir=os.path.join(sys.argv[2], 'cpu_kernels')))\n"
        "print(build.build().reason)\n"
    )
    env = {"PATH": str(tmp_path), "CXX": "/nonexistent/c++", "XLASERVE_CPU_KERNELS": "0"}
    cache = str(tmp_path / "cache")
    alone, served = (_run(code, env, cache, who, cache) for who in ("alone", "serve"))
    assert alone.returncode == 0 and served.returncode == 0, alone.stderr[-4000:] + served.stderr[-4000:]
    assert alone.stdout.startswith("no C++ compiler configured or found on PATH"), alone.stdout
    assert served.stdout == "disabled by XLASERVE_CPU_KERNELS=0\n", served.stdout


def test_serve_reads_the_kernel_variables() -> None:
    from kernels.cpu import BuildConfig
    from serve.native_kernels import DISABLED, build_config

    env = {"CXX": "clang++", "XLASERVE_CPU_KERNELS": "0", "XLASERVE_CPU_THREADS": "3"}
    assert build_config("/c", env) == BuildConfig("clang++", "/c/cpu_kernels", DISABLED, 3)
    # Unset, empty, or any value but 0: the defaults (PATH's compiler, on, every core).
    for env in ({}, {"CXX": "", "XLASERVE_CPU_KERNELS": "1", "XLASERVE_CPU_THREADS": ""}):
        assert build_config("/c", env) == BuildConfig(cache_dir="/c/cpu_kernels")
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match=f"XLASERVE_CPU_THREADS='{bad}' must be a whole number >= 1"):
            build_config("/c", {"XLASERVE_CPU_THREADS": bad})


# Helper threads the kernels start: the process's thread count before and after the first native matmul.
THREADS = (
    "import os, sys\nimport jax.numpy as jnp, numpy as np\n"
    "from kernels import cpu\nfrom serve import native_kernels\n"
    "native_kernels.configure(sys.argv[1])\n"
    "x, w = jnp.ones((1, 64), jnp.float32), jnp.ones((64, 4096), jnp.float32)\n"
    "np.asarray(cpu.matmul_reference(x, w))\n"
    "before = len(os.listdir('/proc/self/task'))\n"
    "assert cpu.available()\n"
    "assert np.allclose(np.asarray(cpu.matmul_native(x, w)), 64.0)\n"
    "print(len(os.listdir('/proc/self/task')) - before)\n"
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_cpu_threads_sets_the_helper_threads(cache_dir: str) -> None:
    started = {}
    for threads in ("1", "3"):  # the session's cache: the library is compiled once for all the tests
        result = _run(THREADS, {"XLASERVE_CPU_THREADS": threads}, cache_dir, cache_dir)
        assert result.returncode == 0, result.stderr[-4000:]
        started[threads] = int(result.stdout.split()[-1])
    assert started["3"] - started["1"] == 2, started
