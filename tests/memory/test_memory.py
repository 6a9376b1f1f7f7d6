"""Host allocators: pages and request rows are never lost, duplicated or leaked."""

from __future__ import annotations

import numpy as np
import pytest

from memory import PageAllocator, ReqToTokenPool


def make(num_pages=9, rows=3, max_pages=4, page_size=4):
    pages = PageAllocator(num_pages)
    return pages, ReqToTokenPool(rows, max_pages, pages, page_size)


def test_page_zero_is_never_handed_out():
    pages, pool = make()
    row = pool.allocate_row()
    assert pool.reserve(row, 16)
    assert 0 not in pool.table[row, :4]
    pool.check_integrity()


def test_reserve_grows_by_pages_and_fails_without_side_effects():
    pages, pool = make(num_pages=5)  # 4 usable pages of 4 tokens
    a, b = pool.allocate_row(), pool.allocate_row()
    assert pool.reserve(a, 5) and pool.num_pages_of[a] == 2
    assert pool.reserve(a, 8) and pool.num_pages_of[a] == 2  # still fits
    assert pool.reserve(b, 8) and pages.num_free == 0
    assert not pool.reserve(a, 9)
    assert pool.num_pages_of[a] == 2 and pages.num_free == 0
    pool.check_integrity()
    pool.free_row(a)
    assert pages.num_free == 2
    pool.check_integrity()


def test_random_churn_keeps_integrity():
    rng = np.random.default_rng(0)
    pages, pool = make(num_pages=33, rows=6, max_pages=8)
    held: dict[int, int] = {}
    for _ in range(500):
        if held and (rng.random() < 0.3 or not pool.can_allocate_row()):
            row = int(rng.choice(list(held)))
            pool.free_row(row)
            del held[row]
        elif pool.can_allocate_row():
            row = pool.allocate_row()
            held[row] = 0
        for row in held:
            want = min(held[row] + int(rng.integers(0, 6)), 32)
            if pool.reserve(row, want):
                held[row] = want
        pool.check_integrity()
    for row in list(held):
        pool.free_row(row)
    pool.check_integrity()
    assert pages.num_free == 32


def test_errors_name_the_problem():
    pages, pool = make()
    with pytest.raises(ValueError, match="not allocated"):
        pool.free_row(2)
    row = pool.allocate_row()
    with pytest.raises(ValueError, match="exceeds the per-request page table"):
        pool.reserve(row, 100)
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(1)


# ---- pool planning: the budget split between KV pages and recurrent state slots ----------------------------

def _plan(spec, monkeypatch, **kw):
    from runtime import pool_sizing

    monkeypatch.setattr(pool_sizing, "device_memory_bytes", lambda: 1000 * 2**20)
    args = dict(page_size=16, weight_bytes=100 * 2**20, mem_fraction_static=0.5, max_total_tokens=None,
                max_running_requests=64, max_pages_per_request=32)
    return pool_sizing.plan_pools(spec, np.float32, **{**args, **kw})


def test_hybrid_budget_splits_by_ratio_and_slots_cap_running_requests(monkeypatch):
    from memory import CacheSpec, RecurrentSpec

    rec = RecurrentSpec(num_layers=4, ssm_shape=(8, 16, 64), conv_shape=(256, 3))  # ~0.13 MiB per slot
    spec = CacheSpec(num_kv_layers=2, num_kv_heads=2, head_dim=64, recurrent=rec)
    budget = 400 * 2**20  # 1000 MiB x 0.5 - 100 MiB of weights
    plan = _plan(spec, monkeypatch, recurrent_state_memory_ratio=0.01)
    per_slot = rec.bytes_per_slot(np.float32)
    assert plan.max_running_requests == int(0.01 * budget // per_slot) < 64
    assert plan.recurrent_bytes == (plan.max_running_requests + 1) * per_slot
    assert plan.kv_bytes <= budget - plan.recurrent_bytes < plan.kv_bytes + 16 * 2 * 2 * 2 * 64 * 4
    fixed = _plan(spec, monkeypatch, max_recurrent_slots=5)
    assert fixed.max_running_requests == 5 and fixed.recurrent_bytes == 6 * per_slot
    assert fixed.kv_bytes > plan.kv_bytes  # fewer slots leave more for KV


def test_memory_the_process_already_holds_is_not_planned_with(monkeypatch):
    """A second engine in one process (the other's pools and weights on the device) plans with what is left of
    the fraction, and says so when nothing is (a GPU's second engine otherwise ran out of memory at its first
    step)."""
    from memory import CacheSpec

    spec = CacheSpec(num_kv_layers=2, num_kv_heads=2, head_dim=64)
    alone = _plan(spec, monkeypatch)
    second = _plan(spec, monkeypatch, other_bytes=200 * 2**20)  # of the 400 MiB budget
    per_page = 16 * spec.kv_bytes_per_token(np.float32)
    assert alone.num_pages == 400 * 2**20 // per_page and second.num_pages == 200 * 2**20 // per_page
    with pytest.raises(ValueError, match="MiB this process already holds on the device"):
        _plan(spec, monkeypatch, other_bytes=400 * 2**20)


def test_recurrent_only_model_has_no_kv_pool_and_all_budget_for_slots(monkeypatch):
    from memory import CacheSpec, RecurrentSpec

    spec = CacheSpec(num_kv_layers=0, recurrent=RecurrentSpec(24, (24, 64, 128), (1792, 3)))  # mamba2-130m
    plan = _plan(spec, monkeypatch, max_running_requests=8)
    assert plan.kv_bytes == 0 and plan.max_running_requests == 8
    assert plan.num_pages == 8 * 32 + 1  # bookkeeping pages: every request can hold its full context
    with pytest.raises(ValueError, match="no room for one recurrent state slot"):
        _plan(spec, monkeypatch, weight_bytes=499 * 2**20)


def test_prefix_cache_snapshots_share_the_recurrent_budget(monkeypatch):
    from memory import CacheSpec, RecurrentSpec
    from runtime.pool_sizing import SNAPSHOTS_PER_REQUEST

    rec = RecurrentSpec(num_layers=4, ssm_shape=(8, 16, 64), conv_shape=(256, 3))
    spec = CacheSpec(num_kv_layers=2, num_kv_heads=2, head_dim=64, recurrent=rec)
    per_slot, budget = rec.bytes_per_slot(np.float32), 400 * 2**20
    plain = _plan(spec, monkeypatch, recurrent_state_memory_ratio=0.01)
    auto = _plan(spec, monkeypatch, recurrent_state_memory_ratio=0.01, state_snapshots=True)
    # Each running request brings its snapshots: fewer requests fit the same share.
    assert auto.max_running_requests == int(0.01 * budget // (per_slot * (1 + SNAPSHOTS_PER_REQUEST)))
    assert auto.state_snapshots == SNAPSHOTS_PER_REQUEST * auto.max_running_requests
    assert auto.snapshot_bytes == (auto.state_snapshots + 1) * per_slot
    assert auto.max_running_requests < plain.max_running_requests and plain.state_snapshots == 0
    assert auto.kv_bytes <= budget - auto.recurrent_bytes - auto.snapshot_bytes
    fixed = _plan(spec, monkeypatch, recurrent_state_memory_ratio=0.01, state_snapshots=True,
                  max_state_snapshots=10)
    assert fixed.state_snapshots == 10 and fixed.snapshot_bytes == 11 * per_slot
    assert fixed.max_running_requests == int((0.01 * budget - 11 * per_slot) // per_slot)
    assert "prefix-cache state snapshots 10 slots" in fixed.describe(spec, 16)
    off = _plan(spec, monkeypatch, state_snapshots=True, max_state_snapshots=0)
    assert off.state_snapshots == off.snapshot_bytes == 0
    with pytest.raises(ValueError, match="max_state_snapshots"):
        _plan(spec, monkeypatch, state_snapshots=True, max_state_snapshots=-1)
    # A model without recurrent layers keeps no snapshots whatever is asked.
    dense = CacheSpec(num_kv_layers=2, num_kv_heads=2, head_dim=64)
    assert _plan(dense, monkeypatch, state_snapshots=True).state_snapshots == 0
