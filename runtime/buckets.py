"""Shape buckets: the fixed set of step shapes compiled at startup."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


class StepShape(NamedTuple):
    prefill_blocks: int  # query blocks of `prefill_block_size` tokens
    decode: int  # single-token decode slots
    pages: int  # page-table width per sequence


def _geometric_up_to(n: int, start: int, factor: int) -> tuple[int, ...]:
    out, x = [], start
    while x < n:
        out.append(x)
        x *= factor
    return (*out, n)


def _prefill_counts(max_blocks: int) -> tuple[int, ...]:
    """Prefill block counts: x4 steps from 2, and 3/4 of the largest. The last is the common step of a
    server whose arrivals each bring fewer uncached tokens than a full chunk (a shared prefix cached, ~130
    new tokens: 9 blocks of 16), which a full-chunk program pads by up to 2x: on a 2-core CPU a mixed step
    costs about its padded rows (SmolLM2 at 1.1 k tokens of context, 16 decode rows: 16 blocks ~305 ms, 24
    blocks ~445 ms)."""
    counts = set(_geometric_up_to(max_blocks, min(2, max_blocks), 4))
    if max_blocks >= 8:
        counts.add(max_blocks * 3 // 4)
    return tuple(sorted(counts))


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Decode-only shapes (decode sizes x page widths) and prefill shapes (blocks x {0, max decode} x widths).

    A prefill step carries either no decode tokens or room for every running request, so mixed batches
    add one bucket dimension of two values instead of a full cross product.
    """

    prefill_block_size: int
    decode_sizes: tuple[int, ...]
    prefill_block_counts: tuple[int, ...]
    page_widths: tuple[int, ...]

    def __post_init__(self):
        for name in ("decode_sizes", "prefill_block_counts", "page_widths"):
            values = getattr(self, name)
            if not values or list(values) != sorted(set(values)) or values[0] <= 0:
                raise ValueError(f"{name}={values} must be a non-empty increasing tuple of positive ints")

    @classmethod
    def make(cls, *, max_running_requests: int, chunked_prefill_size: int, prefill_block_size: int,
             max_context_len: int, page_size: int, min_page_width_tokens: int = 256) -> Buckets:
        if chunked_prefill_size % prefill_block_size:
            raise ValueError(f"{chunked_prefill_size=} must be a multiple of {prefill_block_size=}")
        max_pages = -(-max_context_len // page_size)
        max_blocks = chunked_prefill_size // prefill_block_size
        return cls(
            prefill_block_size=prefill_block_size,
            decode_sizes=_geometric_up_to(max_running_requests, 1, 2),
            # Coarser steps for prefill and page widths keep the program count (compile time) down;
            # a prefill pads at most 4x, and attention cost only grows with the page width.
            prefill_block_counts=_prefill_counts(max_blocks),
            page_widths=_geometric_up_to(
                max_pages, min(max(1, min_page_width_tokens // page_size), max_pages), 8
            ),
        )

    @property
    def max_decode(self) -> int:
        return self.decode_sizes[-1]

    @property
    def max_prefill_blocks(self) -> int:
        return self.prefill_block_counts[-1]

    @property
    def max_pages(self) -> int:
        return self.page_widths[-1]

    def all_shapes(self) -> list[StepShape]:
        shapes = [StepShape(0, d, p) for d in self.decode_sizes for p in self.page_widths]
        shapes += [
            StepShape(b, d, p)
            for b in self.prefill_block_counts for d in (0, self.max_decode) for p in self.page_widths
        ]
        return shapes

    def pick(self, prefill_blocks: int, decode: int, pages: int) -> StepShape:
        """Smallest compiled shape that holds the given counts; ValueError if none does."""
        def up(values, x):
            for v in values:
                if v >= x:
                    return v
            raise ValueError(f"{x} exceeds the largest bucket {values[-1]}")

        width = up(self.page_widths, max(pages, 1))
        if prefill_blocks == 0:
            return StepShape(0, up(self.decode_sizes, decode), width)
        return StepShape(up(self.prefill_block_counts, prefill_blocks), self.max_decode if decode else 0,
                         width)
