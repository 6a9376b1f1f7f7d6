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


def device_bytes_in_use() -> int:
    """Bytes this process holds on its first device now (0 where `memory_stats` is unavailable: CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(stats.get("bytes_in_use", 0))


# Default prefix-cache snapshots per running request: one the request fills as it decodes, the rest for the
# tree (measured: with 2, decoding requests held half the slots and the shared prefixes were evicted; see
# docs/benchmarks.md).
SNAPSHOTS_PER_REQUEST = 4
# Speculative decoding on a recurrent model: scratch state slots for the draft rows of this many requests per
# step (each draft token's row leaves its state in one); speculation pays most at small batches.
DRAFTING_REQUESTS = 4


class PoolPlan(NamedTuple):
    num_pages: int  # KV pages including the dummy page 0 (bookkeeping only when the model has no KV layers)
    max_running_requests: int  # capped by the recurrent slots (a running request holds one)
    kv_bytes: int
    recurrent_bytes: int
    state_snapshots: int = 0  # prefix-cache snapshot slots of the recurrent state (the dummy excluded)
    snapshot_bytes: int = 0
    draft_state_slots: int = 0  # scratch state slots for speculative draft rows (in recurrent_bytes)

    def describe(self, spec: CacheSpec, page_size: int) -> str:
        parts = []
        if spec.has_kv:
            tokens = (self.num_pages - 1) * page_size
            parts.append(f"KV pool {self.num_pages - 1} pages x {page_size} = {tokens} tokens "
                         f"({self.kv_bytes / 2**20:.0f} MiB)")
        if spec.recurrent:
            drafts = f" + {self.draft_state_slots} for draft rows" if self.draft_state_slots else ""
            parts.append(f"recurrent state {self.max_running_requests} slots{drafts} "
                         f"({self.recurrent_bytes / 2**20:.0f} MiB, {spec.recurrent.num_layers} layers)")
            if self.state_snapshots:
                parts.append(f"prefix-cache state snapshots {self.state_snapshots} slots "
                             f"({self.snapshot_bytes / 2**20:.0f} MiB)")
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
    state_snapshots: bool = False,
    max_state_snapshots: int | None = None,
    kv_dtype=None,
    draft_tokens: int = 0,
    draft_kv_bytes_per_token: int = 0,
    device_memory: int | None = None,
    other_bytes: int = 0,
) -> PoolPlan:
    """Sizes the pools from the budget (device memory x `mem_fraction_static` - weights - `other_bytes`, what
    the process already holds on the device besides these weights: another engine's pools and weights).

    Recurrent slots cap concurrency: `max_recurrent_slots` if given, else the share
    `recurrent_state_memory_ratio` of the budget (all of it for a model without attention layers),
    never more than `max_running_requests`. With `state_snapshots` (the prefix cache of a recurrent model)
    that share also holds `max_state_snapshots` snapshot slots of the same size (default
    SNAPSHOTS_PER_REQUEST per running request), and with `draft_tokens` (speculative decoding's drafts per
    request) `draft_tokens` scratch slots for each of up to DRAFTING_REQUESTS requests. KV pages cap resident
    context: `max_total_tokens` if given, else what the budget leaves after the slots; a page's bytes
    include `draft_kv_bytes_per_token` (a draft model's K/V, kept in pages of the same ids) and `kv_bytes`
    counts both. `device_memory`: one device's bytes (default `device_memory_bytes()`).
    """
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"{mem_fraction_static=} must be in (0, 1]")
    if not 0 < recurrent_state_memory_ratio < 1:
        raise ValueError(f"{recurrent_state_memory_ratio=} must be in (0, 1)")
    if device_memory is None:
        device_memory = device_memory_bytes()
    budget = int(device_memory * mem_fraction_static) - weight_bytes - other_bytes
    after = "after weights" + (f" and {other_bytes / 2**20:.0f} MiB this process already holds on the device "
                               "(another engine?)" if other_bytes else "")
    running, recurrent_bytes, snapshots, snapshot_bytes, draft_slots = max_running_requests, 0, 0, 0, 0
    if max_state_snapshots is not None and max_state_snapshots < 0:
        raise ValueError(f"{max_state_snapshots=} must be >= 0")
    if spec.recurrent is not None:
        per_slot = spec.recurrent.bytes_per_slot(dtype)
        auto_snapshots = state_snapshots and max_state_snapshots is None
        if max_recurrent_slots is not None:
            if max_recurrent_slots < 1:
                raise ValueError(f"{max_recurrent_slots=} must be >= 1")
            slots = max_recurrent_slots
        else:
            share = budget * (recurrent_state_memory_ratio if spec.has_kv else 1.0)
            if state_snapshots and not auto_snapshots:
                share -= (max_state_snapshots + 1) * per_slot
            slots = int(share // (per_slot * (1 + SNAPSHOTS_PER_REQUEST * auto_snapshots)))
            if slots < 1:
                raise ValueError(
                    f"mem_fraction_static={mem_fraction_static} leaves {budget / 2**20:.0f} MiB "
                    f"{after}: no "
                    f"room for one recurrent state slot ({per_slot / 2**20:.1f} MiB); raise it or set "
                    "max_recurrent_slots"
                )
        running = min(running, slots)
        draft_slots = draft_tokens * min(running, DRAFTING_REQUESTS)
        recurrent_bytes = (running + 1 + draft_slots) * per_slot  # + the dummy slot 0
        if state_snapshots:
            snapshots = SNAPSHOTS_PER_REQUEST * running if auto_snapshots else max_state_snapshots
            snapshot_bytes = (snapshots + 1) * per_slot if snapshots else 0
    if not spec.has_kv:
        # No attention layers: pages only count tokens; give every request its full context.
        return PoolPlan(running * max_pages_per_request + 1, running, 0, recurrent_bytes, snapshots,
                        snapshot_bytes, draft_slots)
    per_page = page_size * (spec.kv_bytes_per_token(kv_dtype or dtype) + draft_kv_bytes_per_token)
    if max_total_tokens is not None:
        if max_total_tokens < page_size:
            raise ValueError(f"{max_total_tokens=} must be at least one page ({page_size=})")
        pages = max_total_tokens // page_size + 1
    else:
        recurrent_bytes_all = recurrent_bytes + snapshot_bytes
        pages = (budget - recurrent_bytes_all) // per_page
        if pages < 2:
            raise ValueError(
                f"mem_fraction_static={mem_fraction_static} "
                f"leaves {(budget - recurrent_bytes_all) / 2**20:.0f} MiB "
                f"{after} and recurrent state: no room for the KV pool; raise it or set max_total_tokens"
            )
    return PoolPlan(int(pages), running, int(pages) * per_page, recurrent_bytes, snapshots, snapshot_bytes,
                    draft_slots)
