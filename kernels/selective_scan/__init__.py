"""Mamba-1 selective scan with per-slot SSM state (prefill over block-laid-out sequences, one-step decode)."""

from kernels.selective_scan.reference import selective_scan_decode, selective_scan_prefill

__all__ = ["selective_scan_decode", "selective_scan_prefill"]
