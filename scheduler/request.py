"""A request's life on the host: its tokens, progress through prefill, outputs and logprobs."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from scheduler.speculative import NgramIndex


@dataclasses.dataclass(frozen=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the EOS/stop token id or stop string (type "stop")
    length: int | None = None  # completion tokens (type "length")
    message: str | None = None  # why (type "abort")
    status: int | None = None  # type "abort" for a server-side failure: the HTTP status (500); None otherwise

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            d["matched"] = self.matched
        elif self.type == "length":
            d["length"] = self.length
        else:
            if self.message:
                d["message"] = self.message
            if self.status is not None:
                d["status"] = self.status
        return d


@dataclasses.dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position that gets a logprob; -1: none
    top_logprobs_num: int = 0
    grammar: Any = None  # scheduler.grammar.GrammarMatcher constraining the output (structured output)
    # Progress.
    output_ids: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None  # ReqToTokenPool row while admitted
    dp_rank: int | None = None  # data-parallel rank holding its pages and row (chosen at each admission)
    num_computed: int = 0  # tokens whose K/V is in the pool (or being computed by a step in flight)
    # Decode tokens dispatched whose values have not reached the host yet (the overlap schedule,
    # scheduler/stepping.py): they count in seq_len, and a step feeding one feeds a placeholder
    inflight: int = 0
    # Prefix cache (scheduler/prefix_cache.py): the locked tree node its borrowed pages end at, and the
    # prompt tokens its first admission found cached.
    prefix_node: Any = None
    prefix_pinned: bool = False  # the lock on prefix_node also pins its snapshot (until the state is loaded)
    cached_tokens: int = 0
    # Recurrent models' snapshots (see scheduler/prefix_cache.py): the matched snapshot its first chunk loads
    # (0: none), where its prefill pauses to save one, and its own slot holding the state after track_pos
    # tokens (None: no slot yet).
    state_load: int = 0
    save_points: tuple[int, ...] = ()
    track_slot: int | None = None
    track_pos: int = 0
    admitted_at: int = -1  # step counter at (re)admission; retraction picks the largest
    # Speculative decoding: steps that verified a draft, draft tokens proposed, and those accepted.
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_rejections: int = 0  # verify steps that ended at a rejected draft token
    spec_skip: int = 0  # decode steps left before it drafts again (after a draft wholly rejected)
    ngram_index: NgramIndex | None = None  # ngram drafting: its tokens' n-grams (scheduler/speculative.py)
    # Recurrent models: the scratch slot holding the state after the drafts its last step accepted, copied
    # into its own slot before its next step runs (0: none; runtime/batch_builder.py SeqWork.state_fix)
    state_fix: int = 0
    # Penalties: draft tokens its last verify step counted and rejected, taken back before its next step
    penalty_uncount: tuple[int, ...] = ()
    # Standalone drafter: leading positions whose K/V in the draft model's pool is right (draft_model.py)
    draft_computed: int = 0
    spec_backoff: int = 0  # the last skip
    num_retractions: int = 0
    finish_reason: FinishReason | None = None
    # Logprobs, as (logprob, token_id) pairs; input ones indexed by prompt position.
    input_token_logprobs: dict[int, tuple[float | None, int]] = dataclasses.field(default_factory=dict)
    input_top_logprobs: dict[int, list[tuple[float, int]] | None] = dataclasses.field(default_factory=dict)
    output_token_logprobs: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
    # Timing (perf_counter seconds).
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode step needs only the last token); a token
        still in flight is the placeholder -1 - row, which the step replaces by the row's last sampled
        token on device (runtime/step.py)."""
        num_prompt = len(self.prompt_ids)
        known = num_prompt + len(self.output_ids)
        if end > known:
            return self.tokens(start, known) + [-1 - self.row] * (end - max(start, known))
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - num_prompt]

    @property
    def seq_len(self) -> int:
        """Tokens so far: the prompt, the outputs, and the tokens in flight."""
        return len(self.prompt_ids) + len(self.output_ids) + self.inflight

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        """More than one token still to feed (a decode step feeds exactly one: the last)."""
        return self.seq_len - self.num_computed > 1

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.prompt_ids)


@dataclasses.dataclass
class ReqOutput:
    """What one step produced for one request (streamed to the caller)."""

    rid: str
    new_ids: list[int]
    finish_reason: FinishReason | None
    new_token_logprobs: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    new_top_logprobs: list[list[tuple[float, int]]] = dataclasses.field(default_factory=list)
