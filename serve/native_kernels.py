"""The native CPU kernels' settings from xlaserve's environment variables (kernels/cpu reads none itself)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kernels.cpu import build as cpu_build

DISABLED = "disabled by XLASERVE_CPU_KERNELS=0"


def build_config(cache_dir: str, environ: Mapping[str, str] = os.environ) -> cpu_build.BuildConfig:
    """The kernels' configuration for xlaserve's cache directory `cache_dir` (the library goes to its
    `cpu_kernels/`): compiled with `$CXX` (else the first of c++, g++, clang++ on PATH), switched off by
    `XLASERVE_CPU_KERNELS=0`, run on `$XLASERVE_CPU_THREADS` threads (else every core). Raises ValueError
    naming a bad XLASERVE_CPU_THREADS."""
    threads = environ.get("XLASERVE_CPU_THREADS") or None
    if threads is not None and not (threads.strip().isdigit() and int(threads) >= 1):
        raise ValueError(f"XLASERVE_CPU_THREADS={threads!r} must be a whole number >= 1 (unset: every core)")
    return cpu_build.BuildConfig(
        compiler=environ.get("CXX") or None,
        cache_dir=os.path.join(cache_dir, "cpu_kernels"),
        disabled=DISABLED if environ.get("XLASERVE_CPU_KERNELS") == "0" else None,
        num_threads=int(threads) if threads is not None else None,
    )


def configure(cache_dir: str) -> None:
    """Configures kernels.cpu for this process from the environment (`build_config`). Call it before anything
    builds the kernels: only the process's first build reads the configuration. `build_core` (the Engine and
    the server's scheduler process) and `xlaserve build-kernels` call it; so must any other program (bench/)
    that runs the kernels and should honour these variables."""
    cpu_build.configure(build_config(cache_dir))
