"""Messages between the server's processes (pickled over ZMQ): small typed dataclasses."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class TokenizedGenerateReq:
    """TokenizerManager -> scheduler: one request, already tokenized and validated."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    response_format: dict[str, Any] | None = None


@dataclasses.dataclass
class AbortReq:
    rid: str


@dataclasses.dataclass
class ControlReq:
    """A question for the scheduler ("server_info", "flush_cache"), answered by a ControlResp."""

    kind: str
    req_id: str


@dataclasses.dataclass
class ControlResp:
    req_id: str
    payload: dict[str, Any]


def spec_meta(verify_steps: int, draft_tokens: int, accepted_tokens: int) -> dict[str, Any]:
    """A request's speculative decoding figures for its meta_info (none when it verified no draft)."""
    if not verify_steps:
        return {}
    return {"spec_verify_ct": verify_steps, "spec_draft_tokens": draft_tokens,
            "spec_accepted_tokens": accepted_tokens,
            # tokens gained per verifying step: its accepted drafts and the token sampled after them
            "spec_accept_length": 1 + accepted_tokens / verify_steps}


@dataclasses.dataclass
class TokenOut:
    """Scheduler -> detokenizer -> TokenizerManager: what one step produced for one request."""

    rid: str
    new_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # Speculative decoding so far: steps that verified a draft, draft tokens proposed, drafts accepted
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    new_token_logprobs: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    new_top_logprobs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    input_token_logprobs: list | None = None  # with the request's first output only
    input_top_logprobs: list | None = None
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    error: str | None = None  # the request was refused: message for the client
    error_status: int = 400
    # Filled by the detokenizer:
    text_delta: str = ""


@dataclasses.dataclass
class BatchTokenOut:
    outs: list[TokenOut]
