"""Device pool pytrees and the host allocators that hand out their pages and rows."""

from memory.allocator import PageAllocator, ReqToTokenPool, TokenCapacity
from memory.pools import KVPool, MemoryPools, PenaltyPool, kv_pool_bytes_per_token

__all__ = [
    "KVPool",
    "MemoryPools",
    "PageAllocator",
    "PenaltyPool",
    "ReqToTokenPool",
    "TokenCapacity",
    "kv_pool_bytes_per_token",
]
