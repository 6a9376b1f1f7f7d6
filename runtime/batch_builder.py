"""Lays out one step's sequences into the padded NumPy arrays of a `StepBatch`."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from models.batch import ForwardBatch
from runtime.batch import SamplingBatch, StepBatch
from runtime.buckets import StepShape
from runtime.config import RunnerConfig
from runtime.sampling_params import SamplingParams, fold_seed


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
    # i32[mask_words] the tokens allowed next: a grammar's (structured output), or all but the stop and EOS
    # ids while min_new_tokens holds them back (a mask, not logit_bias slots, so any number of stop ids fit)
    allowed_mask: np.ndarray | None = None
    # Prefix-cache snapshot slots (0: none): copied into the row's state before this work runs, and the row's
    # state after it copied into (a recurrent model's prefix cache, scheduler/prefix_cache.py).
    load_snapshot: int = 0
    save_snapshot: int = 0
    # A decode work's draft tokens (speculative decoding, scheduler/speculative.py): fed after token_ids in
    # decode rows of their own (positions start_pos + 1 ..), each row sampling as a decode row there.
    draft: np.ndarray | None = None
    # i32[len(draft), mask_words]: the tokens allowed after each draft token (a grammar's state after the
    # drafts up to it, or stop suppression while min_new_tokens holds); None: no mask on the draft rows
    draft_masks: np.ndarray | None = None
    # Recurrent models: the scratch state slot of the draft's first row (set by the builder; draft row i
    # leaves its final state in draft_state_slot + i - 1), and a scratch slot whose state becomes this
    # row's before the step runs (the state after the drafts the previous step accepted; 0: none).
    draft_state_slot: int = 0
    state_fix: int = 0
    # Penalties: draft tokens the previous step counted and rejected, subtracted before this step runs
    penalty_uncount: tuple[int, ...] = ()

    @property
    def num_rows(self) -> int:
        """Decode rows (sampling rows) the work takes: 1, plus one per draft token."""
        return 1 + (0 if self.draft is None else len(self.draft))


@dataclasses.dataclass
class Layout:
    """Where each work landed: its sequence row and the flat index of its first token (with data
    parallelism, in the concatenation of the ranks' sections: the step's outputs have the same layout). A
    decode work with a draft also takes the `len(draft)` rows (and tokens) after its own."""

    shape: StepShape
    seq_rows: list[int]
    token_starts: list[int]


def _counts(works: list[SeqWork], block_size: int, page_size: int) -> tuple[int, int, int]:
    """(prefill blocks, decode tokens, widest page table) `works` need."""
    blocks = sum(-(-len(w.token_ids) // block_size) for w in works if not w.is_decode)
    decode = sum(w.num_rows for w in works if w.is_decode)
    pages = max((-(-(w.start_pos + len(w.token_ids) + w.num_rows - 1) // page_size) for w in works),
                default=1)
    return blocks, decode, pages


def build_step_batch(
    works: list[SeqWork],
    cfg: RunnerConfig,
    page_table: np.ndarray,  # i32[rows, max_pages] from ReqToTokenPool
    want_input_logprobs: bool,
    shape: StepShape | None = None,
) -> tuple[StepBatch, Layout]:
    """Prefill works go first as whole query blocks, decode works after; everything else is padding.

    `shape` (default: the smallest bucket that holds `works`) must hold them."""
    buckets, page_size, max_bias = cfg.buckets, cfg.page_size, cfg.max_bias
    bs = buckets.prefill_block_size
    prefill = [w for w in works if not w.is_decode]
    decode = [w for w in works if w.is_decode]
    shape = shape or buckets.pick(*_counts(works, bs, page_size))
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
    # draft rows continue the state of the row before them, from and into scratch slots (kernels/chains.py)
    decode_writes = np.zeros(shape.decode, np.int32) if cfg.draft_state_slots else None
    logits_indices = np.zeros(b, np.int32)
    s = empty_sampling(b, max_bias, cfg.mask_words, cfg.max_draft_tokens)
    loads, saves = np.zeros((b, 2), np.int32), np.zeros((b, 2), np.int32)
    fixes = np.zeros((cfg.draft_state_slots, 2), np.int32)
    uncounts = np.zeros((buckets.max_decode if cfg.max_draft_tokens else 0, 2), np.int32)
    pending = [(w.row, t) for w in decode for t in w.penalty_uncount]  # (dummy row 0 ends the list)
    if pending:  # at most one per draft row of the previous step, and every request decodes again
        uncounts[: len(pending)] = pending

    seq_rows, token_starts = [], []
    block = 0  # prefill blocks used so far
    ordered = prefill + decode
    for pairs, copies in ((loads, [(w.load_snapshot, w.row) for w in ordered if w.load_snapshot]),
                          (saves, [(w.row, w.save_snapshot) for w in ordered if w.save_snapshot]),
                          (fixes, [(w.state_fix, w.row) for w in ordered if w.state_fix])):
        pairs[: len(copies)] = np.asarray(copies, np.int32).reshape(-1, 2)
    for i, w in enumerate(prefill):
        n = len(w.token_ids)
        start = block * bs
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
        num_blocks = -(-n // bs)
        prefill_pages[block : block + num_blocks] = pages_row[: shape.pages]
        prefill_slots[block : block + num_blocks] = w.row
        prefill_lens[block : block + num_blocks] = np.minimum(bs, n - bs * np.arange(num_blocks))
        block += num_blocks
        logits_indices[i] = start + n - 1
        seq_rows.append(i)
        token_starts.append(start)
    if prefill:  # one sampling row per prefill work
        _fill_sampling(s, prefill, np.arange(len(prefill)), np.ones(len(prefill), np.int64), max_bias)
    if decode:
        first = _fill_decode(decode, page_table, page_size, shape, num_prefill_tokens, max_bias, s,
                             input_ids, positions, out_loc, token_row, token_kind, targets, decode_pages,
                             decode_slots, logits_indices)
        if decode_writes is not None:
            _chain_draft_rows(decode, first, decode_slots, decode_writes, cfg)
        seq_rows += (shape.prefill_blocks + first).tolist()
        token_starts += (num_prefill_tokens + first).tolist()

    used_decode = sum(w.num_rows for w in decode)
    live = np.asarray([0, block * bs, num_prefill_tokens, num_prefill_tokens + used_decode], np.int32)
    forward = ForwardBatch(
        input_ids, positions, out_loc, prefill_pages, decode_pages, prefill_slots, prefill_lens, decode_slots,
        decode_writes, live,
    )
    batch = StepBatch(
        forward=forward,
        logits_indices=logits_indices,
        sampling=SamplingBatch(**s),
        token_penalty_row=token_row,
        token_kind=token_kind,
        input_logprob_targets=targets,
        want_input_logprobs=np.asarray(want_input_logprobs),
        state_loads=loads,
        state_saves=saves,
        state_fixes=fixes,
        penalty_uncount=uncounts,
    )
    order = {id(w): k for k, w in enumerate(ordered)}
    layout = Layout(shape, [seq_rows[order[id(w)]] for w in works],
                    [token_starts[order[id(w)]] for w in works])
    return batch, layout


def build_dp_step_batch(
    works: list[SeqWork],
    ranks: list[int],  # data-parallel rank of each work
    cfg: RunnerConfig,
    page_tables: list[np.ndarray],  # per rank: i32[rows, max_pages] of its ReqToTokenPool (local page ids)
    want_input_logprobs: bool,
) -> tuple[StepBatch, Layout]:
    """One section per rank, all of the smallest bucket that holds the busiest rank, concatenated.

    Each section is what `build_step_batch` makes of that rank's works (local rows and pages; a rank
    without work gets all padding); the Layout indexes the concatenation, in the order of `works`.
    One rank is exactly `build_step_batch`.
    """
    if len(page_tables) == 1:
        return build_step_batch(works, cfg, page_tables[0], want_input_logprobs)
    by_rank = [[w for w, r in zip(works, ranks) if r == k] for k in range(len(page_tables))]
    counts = [_counts(ws, cfg.buckets.prefill_block_size, cfg.page_size) for ws in by_rank]
    shape = cfg.buckets.pick(*(max(c[i] for c in counts) for i in range(3)))
    sections = [build_step_batch(ws, cfg, table, want_input_logprobs, shape)
                for ws, table in zip(by_rank, page_tables)]
    rows = shape.prefill_blocks + shape.decode
    tokens = shape.prefill_blocks * cfg.buckets.prefill_block_size + shape.decode
    where = {}
    for k, (ws, (_, layout)) in enumerate(zip(by_rank, sections)):
        for w, row, start in zip(ws, layout.seq_rows, layout.token_starts):
            where[id(w)] = (k * rows + row, k * tokens + start)
    layout = Layout(shape, [where[id(w)][0] for w in works], [where[id(w)][1] for w in works])
    return concat_ranks([batch for batch, _ in sections]), layout


def concat_ranks(sections: list[StepBatch]) -> StepBatch:
    """The ranks' equally shaped sections end to end along every array's first axis (scalars are shared)."""
    if len(sections) == 1:
        return sections[0]
    return jax.tree.map(lambda *xs: xs[0] if np.ndim(xs[0]) == 0 else np.concatenate(xs), *sections)


def _fill_decode(decode: list[SeqWork], page_table: np.ndarray, page_size: int, shape: StepShape,
                 num_prefill_tokens: int, max_bias: int, s: dict[str, np.ndarray], input_ids, positions,
                 out_loc, token_row, token_kind, targets, decode_pages, decode_slots, logits_indices
                 ) -> np.ndarray:
    """The decode section: each work's rows (one, plus one per draft token) in order, filled a whole array at
    a time (the host builds a step of 128 decode requests in well under a millisecond this way, against
    several with a loop of small NumPy calls per request). Returns each work's first row in the section."""
    counts = np.fromiter((w.num_rows for w in decode), np.int64, len(decode))
    total = int(counts.sum())
    first = np.cumsum(counts) - counts
    rows = np.repeat(np.fromiter((w.row for w in decode), np.int64, len(decode)), counts)
    pos = (np.repeat(np.fromiter((w.start_pos for w in decode), np.int64, len(decode)), counts)
           + np.arange(total) - np.repeat(first, counts))
    tokens = [int(t) for w in decode for t in (w.token_ids if w.draft is None else (*w.token_ids, *w.draft))]
    sl = slice(num_prefill_tokens, num_prefill_tokens + total)
    input_ids[sl] = tokens
    positions[sl] = pos
    out_loc[sl] = page_table[rows, pos // page_size] * page_size + pos % page_size
    decode_pages[:total] = page_table[rows, : shape.pages]
    decode_slots[:total] = rows
    b0 = shape.prefill_blocks
    logits_indices[b0 : b0 + total] = num_prefill_tokens + np.arange(total)
    _fill_sampling(s, decode, b0 + first, counts, max_bias)
    pen = np.repeat([w.params.uses_penalties for w in decode], counts)
    if pen.any():  # the fed tokens counted for penalties (prompt or generated)
        token_row[sl] = np.where(pen, rows, 0)
        prompt = np.repeat([w.num_prompt_tokens for w in decode], counts)
        token_kind[sl] = np.where(pen, np.where(pos < prompt, 1, 2), 0)
    for w, f in zip(decode, first.tolist()):
        if w.logprob_targets is not None:
            at = num_prefill_tokens + f
            targets[at : at + len(w.logprob_targets)] = w.logprob_targets
        if w.draft_masks is not None:  # draft rows' own masks (without: unmasked)
            row = b0 + f
            s["allowed_mask"][row + 1 : row + w.num_rows] = w.draft_masks
            s["use_mask"][row + 1 : row + w.num_rows] = True
        if w.draft is not None and w.params.uses_penalties:  # row i must not count drafts i + 1 .. k yet
            for i in range(len(w.draft)):
                s["uncount_ids"][b0 + f + i, : len(w.draft) - i] = w.draft[i:]
    return first


def _chain_draft_rows(decode: list[SeqWork], first: np.ndarray, read: np.ndarray, write: np.ndarray,
                      cfg: RunnerConfig) -> None:
    """Read and write state slots of the decode rows (`read` holds each row's request slot): a request's
    first row reads and writes its slot; draft row i (1 ..) reads the slot row i - 1 writes and writes scratch
    slot `w.draft_state_slot + i - 1`, numbered after the rank's request slots (RunnerConfig.draft_state_slots
    of them). Sets each drafting work's `draft_state_slot`."""
    total = int(first[-1]) + decode[-1].num_rows
    write[:total] = read[:total]
    scratch = cfg.max_running_requests + 1  # the next free scratch slot
    for w, f in zip(decode, first.tolist()):
        if w.draft is None:
            continue
        k = len(w.draft)
        if scratch + k > cfg.max_running_requests + 1 + cfg.draft_state_slots:
            raise ValueError(f"draft rows exceed the {cfg.draft_state_slots} scratch state slots")
        w.draft_state_slot = scratch
        write[f + 1 : f + 1 + k] = np.arange(scratch, scratch + k)
        read[f + 2 : f + 1 + k] = np.arange(scratch, scratch + k - 1)
        scratch += k


def empty_sampling(b: int, max_bias: int, mask_words: int,
                   max_draft_tokens: int = 0) -> dict[str, np.ndarray]:
    return dict(
        uncount_ids=np.full((b, max_draft_tokens), -1, np.int32),
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


def _fill_sampling(s: dict[str, np.ndarray], works: list[SeqWork], first: np.ndarray, counts: np.ndarray,
                   max_bias: int) -> None:
    """The sampling controls of `works`, work k on rows first[k] .. first[k] + counts[k] (a decode work's
    draft rows sample as its own row does), a whole array at a time. A work's `allowed_mask` goes on its
    first row only (a draft's rows carry their own: `SeqWork.draft_masks`)."""
    rows = np.repeat(first, counts) + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    params = [w.params for w in works]
    each = lambda values: np.repeat(np.asarray(values), counts)  # noqa: E731  (per work -> per row)
    s["temperature"][rows] = each([0.0 if p.greedy else p.temperature for p in params])
    s["top_k"][rows] = each([max(p.top_k, 0) for p in params])
    s["top_p"][rows] = each([p.top_p for p in params])
    s["min_p"][rows] = each([p.min_p for p in params])
    s["seed"][rows] = each([fold_seed(w.seed) for w in works])
    s["want_top_logprobs"][rows] = each([w.want_top_logprobs for w in works])
    pen = [p.uses_penalties for p in params]
    if any(pen):
        off = lambda name, default: each([getattr(p, name) if u else default  # noqa: E731
                                          for p, u in zip(params, pen)])
        s["frequency_penalty"][rows] = off("frequency_penalty", 0.0)
        s["presence_penalty"][rows] = off("presence_penalty", 0.0)
        s["repetition_penalty"][rows] = off("repetition_penalty", 1.0)
        s["penalty_row"][rows] = each([w.row if u else 0 for w, u in zip(works, pen)])
        s["reset_row"][rows] = each([w.reset_penalties and u for w, u in zip(works, pen)])
    for w, row, n in zip(works, first.tolist(), counts.tolist()):  # the rarer per-work fields
        bias = w.params.logit_bias
        if len(bias) > max_bias:
            raise ValueError(f"{len(bias)} logit_bias entries exceed max_bias={max_bias}")
        if bias:
            ids, values = zip(*bias)
            s["bias_ids"][row : row + n, : len(ids)] = ids
            s["bias_values"][row : row + n, : len(ids)] = values
        if w.allowed_mask is not None:
            s["allowed_mask"][row] = w.allowed_mask
            s["use_mask"][row] = True
