"""JAX's persistent compilation cache: a restart reloads compiled steps instead of recompiling."""

from __future__ import annotations

import os

import jax


def enable_persistent_cache(path: str | None) -> None:
    """Caches every compiled program under `path`; None leaves caching off."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache everything: the step programs are small but there are dozens of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
