"""Stop conditions: EOS and stop token ids, stop strings, length limits."""

from __future__ import annotations

from typing import Callable

from scheduler.request import FinishReason, Req


def check_finished(req: Req, eos_ids: frozenset[int], max_context_len: int,
                   decode: Callable[[list[int]], str] | None) -> FinishReason | None:
    """The reason `req` must stop after its latest token, or None. Call after appending each token."""
    p = req.params
    n = len(req.output_ids)
    if n == 0:
        return FinishReason("length", length=0) if p.max_new_tokens == 0 else None
    last = req.output_ids[-1]
    if n >= p.min_new_tokens:
        if last in p.stop_token_ids or (not p.ignore_eos and last in eos_ids):
            return FinishReason("stop", matched=last)
        if p.stop and decode is not None:
            # Only the tail can hold a stop string that the newest token completed.
            longest = max(len(s) for s in p.stop)
            tail = decode(req.output_ids[-(longest + 8):])
            for s in p.stop:
                if s in tail:
                    return FinishReason("stop", matched=s)
    if n >= p.max_new_tokens or len(req.prompt_ids) + n >= max_context_len:
        return FinishReason("length", length=n)
    return None


def trim_stop_string(text: str, reason: FinishReason | None) -> str:
    """Cuts `text` at the stop string that finished it (the stop string is not returned)."""
    if reason is not None and reason.type == "stop" and isinstance(reason.matched, str):
        cut = text.find(reason.matched)
        if cut >= 0:
            return text[:cut]
    return text
