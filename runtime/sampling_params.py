"""Per-request sampling parameters (SGLang names), validated on construction."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Stop strings are matched against the decoded tail after every token, in the scheduler and again in the
# detokenizer, so their count and total size bound per-token work; 5 MB of them once stalled the server.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 1024


class SamplingParamError(ValueError):
    """A bad sampling parameter; `param` names it (e.g. "top_k", "stop[2]")."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # NumPy integers too


def _int(name: str, v: Any, lo: int, hi: int) -> None:
    if not _is_int(v):
        raise SamplingParamError(name, f"{name}={v!r} must be an integer")
    if not lo <= v <= hi:
        raise SamplingParamError(name, f"{name}={v} must be in [{lo}, {hi}]")


def _float(name: str, v: Any, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
        raise SamplingParamError(name, f"{name}={v!r} must be a finite number")
    if not (lo < v if lo_open else lo <= v) or not v <= hi:
        raise SamplingParamError(name, f"{name}={v} must be in {'(' if lo_open else '['}{lo}, {hi}]")


def fold_seed(seed: int) -> int:
    """A seed of any 64-bit value as the int32 the sampler keys its draws with (its low 32 bits)."""
    low = seed & 0xFFFFFFFF
    return low - 2**32 if low > INT32_MAX else low


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Every field is checked for type, width and meaning; SamplingParamError names the bad one.

    `seed` may be any 64-bit integer (as OpenAI's); the sampler uses `fold_seed(seed)`. A `top_k` at or
    above the vocabulary size means no top-k. Token ids are only checked against the vocabulary by
    `check_vocab`, which the scheduler calls (the vocabulary is the model's, not known here)."""

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
        _int("max_new_tokens", self.max_new_tokens, 0, INT32_MAX)
        _float("temperature", self.temperature, 0, 1e6)
        _float("top_p", self.top_p, 0, 1, lo_open=True)
        _int("top_k", self.top_k, -1, INT32_MAX)
        _float("min_p", self.min_p, 0, 1)
        _float("frequency_penalty", self.frequency_penalty, -2, 2)
        _float("presence_penalty", self.presence_penalty, -2, 2)
        _float("repetition_penalty", self.repetition_penalty, 0, 1e6, lo_open=True)
        _int("min_new_tokens", self.min_new_tokens, 0, self.max_new_tokens)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamError(name, f"{name}={getattr(self, name)!r} must be true or false")
        if self.seed is not None:
            _int("seed", self.seed, INT64_MIN, INT64_MAX)
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamError("stop", f"stop must be a string or a list of at most {MAX_STOP_STRINGS} "
                                             "strings")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise SamplingParamError(f"stop[{i}]", f"stop[{i}]={s!r} must be a non-empty string")
        total = sum(len(s) for s in self.stop)
        if total > MAX_STOP_CHARS:
            raise SamplingParamError("stop", f"stop strings total {total} characters; at most "
                                             f"{MAX_STOP_CHARS} are allowed")
        if not isinstance(self.stop_token_ids, tuple) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamError("stop_token_ids", f"stop_token_ids must be a list of at most "
                                                       f"{MAX_STOP_TOKEN_IDS} token ids")
        for i, t in enumerate(self.stop_token_ids):
            _int(f"stop_token_ids[{i}]", t, 0, INT32_MAX)
        if not isinstance(self.logit_bias, tuple):
            raise SamplingParamError("logit_bias", "logit_bias must map token ids to biases")
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise SamplingParamError("logit_bias", f"logit_bias entry {pair!r} is no (id, bias) pair")
            _int("logit_bias", pair[0], 0, INT32_MAX)
            _float(f"logit_bias[{pair[0]}]", pair[1], -100, 100)

    def check_vocab(self, vocab_size: int) -> None:
        """Raises SamplingParamError for a token id (stop_token_ids, logit_bias) outside the vocabulary."""
        for i, t in enumerate(self.stop_token_ids):
            if t >= vocab_size:
                raise SamplingParamError(f"stop_token_ids[{i}]",
                                         f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
        for t, _ in self.logit_bias:
            if t >= vocab_size:
                raise SamplingParamError("logit_bias", f"logit_bias token id {t} is outside the vocabulary "
                                                       f"[0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """From an SGLang-style dict (lists for `stop` and `stop_token_ids`, a {token id: bias} dict for
        `logit_bias`; None means the default). Raises SamplingParamError naming an unknown or bad key."""
        if d is not None and not isinstance(d, dict):
            raise SamplingParamError("sampling_params", f"sampling params must be an object, not {d!r}")
        d = {k: v for k, v in (d or {}).items() if v is not None}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known, key=str)
        if unknown:
            raise SamplingParamError(str(unknown[0]),
                                     f"unknown sampling params {unknown}; known: {sorted(known)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = (d["stop"],)
        for key in ("stop", "stop_token_ids"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        if isinstance(d.get("logit_bias"), dict):
            d["logit_bias"] = tuple((_token_key(k), v) for k, v in d["logit_bias"].items())
        if d.get("top_k") == 0 and _is_int(d["top_k"]):
            d["top_k"] = -1
        return cls(**d)


def _token_key(key: Any) -> int:
    """A logit_bias key: a token id, or one written as a decimal string (JSON object keys are strings)."""
    if _is_int(key):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
        return int(key)
    raise SamplingParamError("logit_bias", f"logit_bias key {key!r} is not a token id")
