"""Turns a step's device outputs into request progress: tokens, logprobs, finishes."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from runtime.batch import StepOutput
from runtime.batch_builder import SeqWork
from scheduler.request import Req, ReqOutput


def _pairs(lps: np.ndarray, ids: np.ndarray, k: int) -> list[tuple[float, int]]:
    """The top k (logprob, id) pairs; fewer when the vocabulary is smaller (padding at -inf)."""
    return [(float(lp), int(i)) for lp, i in zip(lps[:k], ids[:k]) if lp > -np.inf]


def fetch_outputs(works: list[SeqWork], reqs: list[Req], out: StepOutput, multi: int | None) -> dict:
    """The step outputs `reqs` need, on the host (this waits for the step, so device errors surface here)."""
    want_top = any(r.top_logprobs_num > 0 for r in reqs)
    want_input = any(r.wants_input_logprobs and not w.is_decode for w, r in zip(works, reqs))
    fetch = {"next_ids": out.next_ids, "next_logprobs": out.next_logprobs}
    if want_top:
        fetch.update(top_ids=out.top_ids, top_logprobs=out.top_logprobs)
    if want_input:
        fetch.update(input_logprobs=out.input_logprobs, input_top_ids=out.input_top_ids,
                     input_top_logprobs=out.input_top_logprobs)
    host = jax.device_get(fetch)
    if multi is None:  # give single-step outputs the same leading step axis as multi-step ones
        host = {k: (v[None] if k.startswith("next") or k.startswith("top") else v) for k, v in host.items()}
    return host


def append_tokens(req: Req, w: SeqWork, row: int, start: int, host: dict, multi: int | None,
                  finish_token: Callable[[Req], None]) -> ReqOutput | None:
    """Records one request's share of a step (`host` from `fetch_outputs`; `row` and `start` where its work
    landed): input logprobs, then each sampled token (all `multi` steps of a multi-step run; a draft's
    verified tokens, scheduler/speculative.py) followed by `finish_token(req)`, which checks stops. Returns
    what it produced; None for a prefill chunk that sampled nothing."""
    n = len(w.token_ids)
    if "input_logprobs" in host and req.wants_input_logprobs and not w.is_decode:
        _record_input_logprobs(req, w, host, start, n)
    req.num_computed = max(req.num_computed, w.start_pos + n)  # (more while its next step is in flight)
    if req.num_computed < req.seq_len:
        return None  # a prefill chunk that is not the last: nothing sampled
    # The sampled tokens in order, as (step, row): one per step of a multi-step run, or a draft's rows (each
    # kept only while the token before it equals the draft token fed at its position)
    draft = () if w.draft is None else w.draft.tolist()
    picks = ([(0, row + i) for i in range(len(draft) + 1)] if draft
             else [(s, row) for s in range(multi or 1)])
    result = ReqOutput(req.rid, [], None)
    if req.params.max_new_tokens == 0:  # prompt scoring only: the sampled token is not wanted
        finish_token(req)
        picks = []
    if draft:
        req.spec_verify_steps += 1
        req.spec_draft_tokens += len(draft)
    accepted = 0
    for i, (s, r) in enumerate(picks):
        if req.finished:
            break  # surplus tokens of a multi-step run (or accepted drafts) past a stop are dropped
        if draft and i > 0:
            if req.output_ids[-1] != draft[i - 1]:
                req.spec_rejections += 1
                break  # draft token i - 1 rejected: the rows after it saw a wrong token
            req.spec_accepted_tokens += 1
            accepted += 1
        if i > 0:
            req.num_computed += 1
        token = int(host["next_ids"][s, r])
        req.output_ids.append(token)
        result.new_ids.append(token)
        if req.return_logprob:
            pair = (float(host["next_logprobs"][s, r]), token)
            req.output_token_logprobs.append(pair)
            result.new_token_logprobs.append(pair)
            if req.top_logprobs_num > 0:
                top = _pairs(host["top_logprobs"][s, r], host["top_ids"][s, r], req.top_logprobs_num)
                req.output_top_logprobs.append(top)
                result.new_top_logprobs.append(top)
        finish_token(req)
    if draft:  # a draft wholly rejected: this request drafts less often for a while
        req.spec_backoff = 0 if accepted else min(2 * req.spec_backoff + 1, 15)
        req.spec_skip = req.spec_backoff
    result.finish_reason = req.finish_reason
    return result


def _record_input_logprobs(req: Req, w: SeqWork, host: dict, start: int, n: int) -> None:
    """Prompt token i's logprob comes from position i-1; token 0 has none (as in SGLang)."""
    k = req.top_logprobs_num
    num_prompt = len(req.prompt_ids)
    if req.logprob_start_len == 0 and w.start_pos == 0:
        req.input_token_logprobs.setdefault(0, (None, req.prompt_ids[0]))
        if k:
            req.input_top_logprobs.setdefault(0, None)
    for j in range(n):
        target = w.start_pos + j + 1
        if (target < max(req.logprob_start_len, 1) or target >= num_prompt
                or target in req.input_token_logprobs):
            continue
        req.input_token_logprobs[target] = (float(host["input_logprobs"][start + j]), req.prompt_ids[target])
        if k:
            req.input_top_logprobs[target] = _pairs(
                host["input_top_logprobs"][start + j], host["input_top_ids"][start + j], k
            )
