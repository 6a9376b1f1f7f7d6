"""Benchmarks of xlaserve, reported against rooflines measured in the same run."""
