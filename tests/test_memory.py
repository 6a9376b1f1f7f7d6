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
