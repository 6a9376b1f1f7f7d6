"""Lays out one step's sequences into the padded NumPy arrays of a `StepBatch`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from models.batch import ForwardBatch
from runtime.batch import SamplingBatch, StepBatch
from runtime.buckets import Buckets, StepShape
from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.runner import RunnerConfig


@dataclasses.dataclass
class SeqWork:
    """One sequence's share of a step."""

    row: int  # ReqToTokenPool row: page table row and PenaltyPool row
    token_ids: np.ndarray  # i32[n] tokens fed this step
    start_pos: int  # position of token_ids[0]
    is_decode: bool
    params: SamplingParams
    seed: int
    reset_penalties: bool = False  # first chunk after (re)admission
    num_prompt_tokens: int = 0  # tokens at positions < this are prompt tokens (for penalties)
    want_top_logprobs: bool = False
    logprob_targets: np.ndarray | None = None  # i32[n] next token after each fed token (prompt logprobs)
    suppress_ids: tuple[int, ...] = ()  # token ids masked out this step (min_new_tokens)
    allowed_mask: np.ndarray | None = None  # i32[mask_words] tokens a grammar allows next (structured output)


@dataclasses.dataclass
class Layout:
    """Where each work landed: its sequence row and the flat index of its first token."""

    shape: StepShape
    seq_rows: list[int]
    token_starts: list[int]


def pick_shape(buckets: Buckets, works: list[SeqWork], page_table_widths: list[int]) -> StepShape:
    bs = buckets.prefill_block_size
    blocks = sum(-(-len(w.token_ids) // bs) for w in works if not w.is_decode)
    decode = sum(1 for w in works if w.is_decode)
    return buckets.pick(blocks, decode, max(page_table_widths, default=1))


def build_step_batch(
    works: list[SeqWork],
    cfg: RunnerConfig,
    page_table: np.ndarray,  # i32[rows, max_pages] from ReqToTokenPool
    want_input_logprobs: bool,
) -> tuple[StepBatch, Layout]:
    """Prefill works go first as whole query blocks, decode works after; everything else is padding."""
    buckets, page_size, max_bias = cfg.buckets, cfg.page_size, cfg.max_bias
    bs = buckets.prefill_block_size
    prefill = [w for w in works if not w.is_decode]
    decode = [w for w in works if w.is_decode]
    widths = [-(-(w.start_pos + len(w.token_ids)) // page_size) for w in works]
    shape = pick_shape(buckets, works, widths)
    num_prefill_tokens = shape.prefill_blocks * bs
    t = num_prefill_tokens + shape.decode
    b = shape.prefill_blocks + shape.decode

    input_ids = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    out_loc = np.zeros(t, np.int32)  # slot 0 of dummy page 0
    token_row = np.zeros(t, np.int32)
    token_kind = np.zeros(t, np.int32)
    targets = np.zeros(t, np.int32)
    prefill_pages = np.zeros((shape.prefill_blocks, shape.pages), np.int32)
    decode_pages = np.zeros((shape.decode, shape.pages), np.int32)
    prefill_slots = np.zeros(shape.prefill_blocks, np.int32)
    prefill_lens = np.zeros(shape.prefill_blocks, np.int32)
    decode_slots = np.zeros(shape.decode, np.int32)
    logits_indices = np.zeros(b, np.int32)
    s = empty_sampling(b, max_bias, cfg.mask_words)

    seq_rows, token_starts = [], []
    block = 0
    ordered = prefill + decode
    for i, w in enumerate(ordered):
        n = len(w.token_ids)
        start = block * bs if not w.is_decode else num_prefill_tokens + (i - len(prefill))
        pos = w.start_pos + np.arange(n, dtype=np.int32)
        sl = slice(start, start + n)
        input_ids[sl] = w.token_ids
        positions[sl] = pos
        pages_row = page_table[w.row]
        out_loc[sl] = pages_row[pos // page_size] * page_size + pos % page_size
        if w.params.uses_penalties:
            token_row[sl] = w.row
            token_kind[sl] = np.where(pos < w.num_prompt_tokens, 1, 2)
        if w.logprob_targets is not None:
            targets[sl] = w.logprob_targets
        if w.is_decode:
            decode_pages[i - len(prefill)] = pages_row[: shape.pages]
            decode_slots[i - len(prefill)] = w.row
        else:
            num_blocks = -(-n // bs)
            prefill_pages[block : block + num_blocks] = pages_row[: shape.pages]
            prefill_slots[block : block + num_blocks] = w.row
            prefill_lens[block : block + num_blocks] = np.minimum(bs, n - bs * np.arange(num_blocks))
            block += num_blocks
        row = i if not w.is_decode else shape.prefill_blocks + (i - len(prefill))
        logits_indices[row] = start + n - 1
        _fill_sampling(s, row, w, max_bias)
        seq_rows.append(row)
        token_starts.append(start)

    forward = ForwardBatch(
        input_ids, positions, out_loc, prefill_pages, decode_pages, prefill_slots, prefill_lens, decode_slots
    )
    batch = StepBatch(
        forward=forward,
        logits_indices=logits_indices,
        sampling=SamplingBatch(**s),
        token_penalty_row=token_row,
        token_kind=token_kind,
        input_logprob_targets=targets,
        want_input_logprobs=np.asarray(want_input_logprobs),
    )
    order = {id(w): k for k, w in enumerate(ordered)}
    layout = Layout(shape, [seq_rows[order[id(w)]] for w in works], [token_starts[order[id(w)]] for w in works])
    return batch, layout


def empty_sampling(b: int, max_bias: int, mask_words: int) -> dict[str, np.ndarray]:
    return dict(
        temperature=np.zeros(b, np.float32),
        top_k=np.zeros(b, np.int32),
        top_p=np.ones(b, np.float32),
        min_p=np.zeros(b, np.float32),
        seed=np.zeros(b, np.int32),
        frequency_penalty=np.zeros(b, np.float32),
        presence_penalty=np.zeros(b, np.float32),
        repetition_penalty=np.ones(b, np.float32),
        penalty_row=np.zeros(b, np.int32),
        reset_row=np.zeros(b, np.bool_),
        bias_ids=np.zeros((b, max_bias), np.int32),
        bias_values=np.zeros((b, max_bias), np.float32),
        want_top_logprobs=np.zeros(b, np.bool_),
        allowed_mask=np.zeros((b, mask_words), np.int32),
        use_mask=np.zeros(b, np.bool_),
    )


def _fill_sampling(s: dict[str, np.ndarray], row: int, w: SeqWork, max_bias: int) -> None:
    p = w.params
    s["temperature"][row] = 0.0 if p.greedy else p.temperature
    s["top_k"][row] = max(p.top_k, 0)
    s["top_p"][row] = p.top_p
    s["min_p"][row] = p.min_p
    s["seed"][row] = w.seed
    if p.uses_penalties:
        s["frequency_penalty"][row] = p.frequency_penalty
        s["presence_penalty"][row] = p.presence_penalty
        s["repetition_penalty"][row] = p.repetition_penalty
        s["penalty_row"][row] = w.row
        s["reset_row"][row] = w.reset_penalties
    entries = list(p.logit_bias) + [(tok, -np.inf) for tok in w.suppress_ids]
    if len(entries) > max_bias:
        raise ValueError(f"{len(entries)} logit_bias/stop-suppression entries exceed max_bias={max_bias}")
    for k, (tok, value) in enumerate(entries):
        s["bias_ids"][row, k] = tok
        s["bias_values"][row, k] = value
    s["want_top_logprobs"][row] = w.want_top_logprobs
    if w.allowed_mask is not None:
        s["allowed_mask"][row] = w.allowed_mask
        s["use_mask"][row] = True
