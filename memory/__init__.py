"""Device pool pytrees and the host allocators that hand out their pages and rows."""

from memory.allocator import PageAllocator, ReqToTokenPool, SnapshotAllocator, TokenCapacity
from memory.pools import (
    CacheSpec,
    KVPool,
    MemoryPools,
    PenaltyPool,
    RecurrentSpec,
    RecurrentStatePool,
    copy_state_slots,
    kv_pool_bytes_per_token,
)

__all__ = [
    "CacheSpec",
    "KVPool",
    "MemoryPools",
    "PageAllocator",
    "PenaltyPool",
    "RecurrentSpec",
    "RecurrentStatePool",
    "ReqToTokenPool",
    "SnapshotAllocator",
    "TokenCapacity",
    "copy_state_slots",
    "kv_pool_bytes_per_token",
]
