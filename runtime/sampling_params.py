"""Per-request sampling parameters (SGLang names), validated on construction."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (off) or >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty={self.presence_penalty} must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0")
        if self.min_new_tokens < 0 or self.min_new_tokens > max(self.max_new_tokens, 0):
            raise ValueError(f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens]")
        for tok, bias in self.logit_bias:
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias for token {tok} is {bias}; must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """From an SGLang-style dict; unknown keys raise ValueError naming them."""
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown sampling params {sorted(unknown)}; known: {sorted(known)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = (d["stop"],)
        for key in ("stop", "stop_token_ids"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
            else:
                d.pop(key, None)
        if isinstance(d.get("logit_bias"), dict):
            d["logit_bias"] = tuple((int(k), float(v)) for k, v in d["logit_bias"].items())
        if d.get("top_k") == 0:
            d["top_k"] = -1
        return cls(**d)
