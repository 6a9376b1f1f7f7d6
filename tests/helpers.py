"""Shared by the test modules: the repository root, tolerances, sampling presets and checks."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
