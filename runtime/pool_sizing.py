"""How many KV pages fit the memory budget."""

from __future__ import annotations

import os

import jax

from memory import kv_pool_bytes_per_token


def device_memory_bytes() -> int:
    """Memory of the first device; host RAM for CPU (where `memory_stats` is unavailable)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def num_kv_pages(
    *,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    dtype,
    page_size: int,
    weight_bytes: int,
    mem_fraction_static: float,
    max_total_tokens: int | None,
) -> int:
    """Pages (including the dummy page 0) for `max_total_tokens`, or for what the budget leaves after weights."""
    if max_total_tokens is not None:
        if max_total_tokens < page_size:
            raise ValueError(f"{max_total_tokens=} must be at least one page ({page_size=})")
        return max_total_tokens // page_size + 1
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"{mem_fraction_static=} must be in (0, 1]")
    budget = int(device_memory_bytes() * mem_fraction_static) - weight_bytes
    per_page = page_size * kv_pool_bytes_per_token(num_layers, kv_heads, head_dim, dtype)
    pages = budget // per_page
    if pages < 2:
        raise ValueError(
            f"mem_fraction_static={mem_fraction_static} leaves {budget / 2**20:.0f} MiB after weights: "
            "no room for the KV pool; raise it or set max_total_tokens"
        )
    return int(pages)
