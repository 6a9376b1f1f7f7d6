"""Paged attention over a KV pool: block-ragged queries, K/V read through a page table."""

from kernels.paged_attention.reference import paged_attention, write_kv

__all__ = ["paged_attention", "write_kv"]
