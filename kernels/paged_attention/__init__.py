"""Paged attention over a KV pool: block-ragged queries, K/V read through a page table."""

from kernels import backend
from kernels.paged_attention import reference

paged_attention = backend.dispatched("paged_attention", reference.paged_attention)
write_kv = backend.dispatched("write_kv", reference.write_kv)

__all__ = ["paged_attention", "write_kv"]
