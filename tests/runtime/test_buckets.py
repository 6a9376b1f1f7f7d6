"""Bucket shapes (runtime/buckets.py): which prefill programs exist and which one a step takes."""

import pytest

from runtime.buckets import Buckets


def _buckets(chunk: int) -> Buckets:
    return Buckets.make(max_running_requests=16, chunked_prefill_size=chunk, prefill_block_size=16,
                        max_context_len=8192, page_size=16)


@pytest.mark.parametrize("chunk,counts", [(256, (2, 8, 12, 16)), (512, (2, 8, 24, 32)), (128, (2, 6, 8)),
                                          (64, (2, 4)), (16, (1,))])
def test_prefill_counts_x4_and_three_quarters(chunk, counts):
    assert _buckets(chunk).prefill_block_counts == counts


def test_a_lone_shared_prefix_arrival_is_not_padded_to_the_chunk():
    """~130 uncached tokens (9 blocks of 16) take the 12-block program, a full chunk the 16-block one."""
    b = _buckets(256)
    assert b.pick(9, 16, 80).prefill_blocks == 12
    assert b.pick(13, 16, 80).prefill_blocks == 16
    assert b.pick(8, 0, 80).prefill_blocks == 8
    assert all(s.prefill_blocks in (0, 2, 8, 12, 16) for s in b.all_shapes())
