"""How the memory budget splits between KV pages and recurrent state slots."""

from __future__ import annotations

import os
from typing import NamedTuple

import jax

from memory import CacheSpec


def device_memory_bytes() -> int:
    """Memory of this process's first device; host RAM for CPU (where `memory_stats` is unavailable)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class PoolPlan(NamedTuple):
    num_pages: int  # KV pages including the dummy page 0 (bookkeeping only when the model has no KV layers)
    max_running_requests: int  # capped by the recurrent slots (a running request holds one)
    kv_bytes: int
    recurrent_bytes: int

    def describe(self, spec: CacheSpec, page_size: int) -> str:
        parts = []
        if spec.has_kv:
            tokens = (self.num_pages - 1) * page_size
            parts.append(f"KV pool {self.num_pages - 1} pages x {page_size} = {tokens} tokens "
                         f"({self.kv_bytes / 2**20:.0f} MiB)")
        if spec.recurrent:
            parts.append(f"recurrent state {self.max_running_requests} slots "
                         f"({self.recurrent_bytes / 2**20:.0f} MiB, {spec.recurrent.num_layers} layers)")
        return "; ".join(parts)


def plan_pools(
    spec: CacheSpec,
    dtype,
    *,
    page_size: int,
    weight_bytes: int,
    mem_fraction_static: float,
    max_total_tokens: int | None,
    max_running_requests: int,
    max_pages_per_request: int,
    max_recurrent_slots: int | None = None,
    recurrent_state_memory_ratio: float = 0.5,
) -> PoolPlan:
    """Sizes both pools from the budget (device memory x `mem_fraction_static` - weights).

    Recurrent slots cap concurrency: `max_recurrent_slots` if given, else the share
    `recurrent_state_memory_ratio` of the budget (all of it for a model without attention layers),
    never more than `max_running_requests`. KV pages cap resident context: `max_total_tokens` if given,
    else what the budget leaves after the slots.
    """
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"{mem_fraction_static=} must be in (0, 1]")
    if not 0 < recurrent_state_memory_ratio < 1:
        raise ValueError(f"{recurrent_state_memory_ratio=} must be in (0, 1)")
    budget = int(device_memory_bytes() * mem_fraction_static) - weight_bytes
    running, recurrent_bytes = max_running_requests, 0
    if spec.recurrent is not None:
        per_slot = spec.recurrent.bytes_per_slot(dtype)
        if max_recurrent_slots is not None:
            if max_recurrent_slots < 1:
                raise ValueError(f"{max_recurrent_slots=} must be >= 1")
            slots = max_recurrent_slots
        else:
            share = budget * (recurrent_state_memory_ratio if spec.has_kv else 1.0)
            slots = int(share // per_slot)
            if slots < 1:
                raise ValueError(
                    f"mem_fraction_static={mem_fraction_static} leaves {budget / 2**20:.0f} MiB "
                    "after weights: no "
                    f"room for one recurrent state slot ({per_slot / 2**20:.1f} MiB); raise it or set "
                    "max_recurrent_slots"
                )
        running = min(running, slots)
        recurrent_bytes = (running + 1) * per_slot  # + the dummy slot 0
    if not spec.has_kv:
        # No attention layers: pages only count tokens; give every request its full context.
        return PoolPlan(running * max_pages_per_request + 1, running, 0, recurrent_bytes)
    per_page = page_size * spec.kv_bytes_per_token(dtype)
    if max_total_tokens is not None:
        if max_total_tokens < page_size:
            raise ValueError(f"{max_total_tokens=} must be at least one page ({page_size=})")
        pages = max_total_tokens // page_size + 1
    else:
        pages = (budget - recurrent_bytes) // per_page
        if pages < 2:
            raise ValueError(
                f"mem_fraction_static={mem_fraction_static} "
                f"leaves {(budget - recurrent_bytes) / 2**20:.0f} MiB "
                "after weights and recurrent state: no room for the KV pool; raise it or set max_total_tokens"
            )
    return PoolPlan(int(pages), running, int(pages) * per_page, recurrent_bytes)
