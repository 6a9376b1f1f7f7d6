"""Device pool pytrees and the host allocators that hand out their pages and rows."""

from memory.allocator import PageAllocator, ReqToTokenPool, TokenCapacity
from memory.pools import (
    CacheSpec,
    KVPool,
    MemoryPools,
    PenaltyPool,
    RecurrentSpec,
    RecurrentStatePool,
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
    "TokenCapacity",
    "kv_pool_bytes_per_token",
]
