"""Mamba-1 selective scan from initial to final SSM states (block-laid-out prefill, one-step decode)."""

from kernels.selective_scan.reference import selective_scan_decode, selective_scan_prefill

__all__ = ["selective_scan_decode", "selective_scan_prefill"]
