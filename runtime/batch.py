"""The host-built description of one step, as the compiled program reads it."""

from __future__ import annotations

from typing import NamedTuple

import jax

from models.batch import ForwardBatch


class SamplingBatch(NamedTuple):
    """Per-sequence sampling controls, one row per sequence slot of the step (padding rows greedy)."""

    temperature: jax.Array  # f32[B]; 0 means greedy
    top_k: jax.Array  # i32[B]; 0 means off
    top_p: jax.Array  # f32[B]; 1 means off
    min_p: jax.Array  # f32[B]; 0 means off
    seed: jax.Array  # i32[B]; with the position, it fixes the random draw
    frequency_penalty: jax.Array  # f32[B]
    presence_penalty: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]; 1 means off
    penalty_row: jax.Array  # i32[B] row of the PenaltyPool (0 = none)
    reset_row: jax.Array  # bool[B] clear the row before this step (first chunk after admission)
    bias_ids: jax.Array  # i32[B, max_bias] logit_bias token ids
    bias_values: jax.Array  # f32[B, max_bias] added to those logits
    want_top_logprobs: jax.Array  # bool[B]
    allowed_mask: jax.Array  # i32[B, ceil(vocab / 32)] packed bitmask of allowed tokens (structured output)
    use_mask: jax.Array  # bool[B] apply allowed_mask to this row
    # i32[B, RunnerConfig.max_draft_tokens] tokens counted into the row's penalty counts this step that the
    # row must not see (a speculative draft row's later draft tokens); -1: none
    uncount_ids: jax.Array


class StepBatch(NamedTuple):
    forward: ForwardBatch
    logits_indices: jax.Array  # i32[B] flat token whose logits sample sequence row b
    sampling: SamplingBatch
    token_penalty_row: jax.Array  # i32[T] PenaltyPool row each input token is counted in (0 = none)
    token_kind: jax.Array  # i32[T] 0: not counted, 1: prompt token, 2: generated token
    input_logprob_targets: jax.Array  # i32[T] next prompt token after each position (for prompt logprobs)
    want_input_logprobs: jax.Array  # bool[] compute prompt logprobs this step
    # Prefix-cache snapshots (memory.copy_state_slots pairs, real ones first, then zeros): (snapshot, state
    # slot) copied before the model runs (a request starting from a cached prefix), (state slot, snapshot)
    # after it (a request's state at a page boundary). i32[B, 2] each; unused without a snapshot pool.
    state_loads: jax.Array
    state_saves: jax.Array
    # Speculative decoding on a recurrent model (same pair form): (scratch slot, state slot) copied before
    # the model, so a request whose draft was accepted continues from the state after its last accepted
    # draft row (runtime/batch_builder.py). i32[RunnerConfig.draft_state_slots, 2].
    state_fixes: jax.Array
    # Speculative decoding with penalties: (penalty row, token) pairs subtracted from the output counts before
    # this step (draft tokens the previous step counted and then rejected), real ones first, then zeros.
    # i32[buckets.max_decode, 2] with speculation (RunnerConfig.max_draft_tokens > 0), else [0, 2].
    penalty_uncount: jax.Array

    @property
    def num_seqs(self) -> int:
        return self.logits_indices.shape[0]


class StepOutput(NamedTuple):
    next_ids: jax.Array  # i32[B]
    next_logprobs: jax.Array  # f32[B] logprob of next_ids under the model's (unpenalised) distribution
    top_ids: jax.Array  # i32[B, K]
    top_logprobs: jax.Array  # f32[B, K]
    input_logprobs: jax.Array  # f32[T] logprob of input_logprob_targets[t] after token t
    input_top_ids: jax.Array  # i32[T, K]
    input_top_logprobs: jax.Array  # f32[T, K]
