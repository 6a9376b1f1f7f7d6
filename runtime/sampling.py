"""Sampling on device: penalties, logit bias, temperature, top-k/top-p/min-p, seeded draws, logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.sampling import argmax_first, logsumexp
from memory import PenaltyPool
from runtime.batch import SamplingBatch


def update_penalty_pool(
    pool: PenaltyPool,
    s: SamplingBatch,
    input_ids: jax.Array,  # i32[T]
    token_row: jax.Array,  # i32[T]
    token_kind: jax.Array,  # i32[T]
    uncount: jax.Array | None = None,  # i32[N, 2] (row, token) counts to take back first (row 0: none)
) -> PenaltyPool:
    """Takes back `uncount` (draft tokens counted by the previous step and rejected), clears rows being
    (re)admitted, then counts this step's input tokens; skipped when unused."""
    uncount = jnp.zeros((0, 2), jnp.int32) if uncount is None else uncount

    def update(pool: PenaltyPool) -> PenaltyPool:
        taken_back = -(uncount[:, 0] > 0).astype(jnp.int32)
        counts = pool.output_counts.at[uncount[:, 0], uncount[:, 1]].add(taken_back)
        reset_rows = jnp.where(s.reset_row, s.penalty_row, 0)  # row 0 is a dummy: clearing it is harmless
        counts = counts.at[reset_rows].set(0)
        seen = pool.prompt_seen.at[reset_rows].set(False)
        counts = counts.at[token_row, input_ids].add((token_kind == 2).astype(jnp.int32))
        seen = seen.at[token_row, input_ids].max(token_kind == 1)
        return PenaltyPool(counts, seen, pool.last_ids)

    active = jnp.any(token_kind > 0) | jnp.any(s.reset_row & (s.penalty_row > 0)) | jnp.any(uncount[:, 0] > 0)
    return jax.lax.cond(active, update, lambda p: p, pool)


def _apply_penalties(logits: jax.Array, s: SamplingBatch, pool: PenaltyPool) -> jax.Array:
    def apply(logits):
        counts = pool.output_counts[s.penalty_row]  # i32[B, V]
        if s.uncount_ids.shape[1]:  # a draft row does not see the draft tokens after it (counted already)
            rows = jnp.arange(counts.shape[0])[:, None]
            later = s.uncount_ids >= 0
            counts = counts.at[rows, jnp.where(later, s.uncount_ids, 0)].add(-later.astype(jnp.int32))
        generated = counts > 0
        seen = pool.prompt_seen[s.penalty_row] | generated
        rep = s.repetition_penalty[:, None]
        # As in HF/vLLM: divide positive logits, multiply negative ones, for every token seen so far.
        logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - s.frequency_penalty[:, None] * counts
        return logits - s.presence_penalty[:, None] * generated

    return jax.lax.cond(jnp.any(_penalized(s)), apply, lambda x: x, logits)


def _penalized(s: SamplingBatch) -> jax.Array:
    """bool[B]: the rows with a frequency, presence or repetition penalty."""
    used = (s.frequency_penalty != 0) | (s.presence_penalty != 0) | (s.repetition_penalty != 1)
    return (s.penalty_row > 0) & used


def _apply_allowed_mask(logits: jax.Array, s: SamplingBatch) -> jax.Array:
    """Grammar-constrained rows keep only the tokens whose bit is set (skipped when no row is constrained)."""

    def apply(logits):
        vocab = jnp.arange(logits.shape[-1])
        words = s.allowed_mask[:, vocab >> 5]  # i32[B, V]
        allowed = ((words >> (vocab & 31)) & 1).astype(jnp.bool_)  # `& 1` also undoes the sign extension
        return jnp.where(s.use_mask[:, None] & ~allowed, -jnp.inf, logits)

    return jax.lax.cond(jnp.any(s.use_mask), apply, lambda x: x, logits)


def _filter(scaled: jax.Array, s: SamplingBatch) -> jax.Array:
    """Masks tokens outside top-k / top-p / min-p to -inf (a full sort only when some row asks)."""

    def apply(scaled):
        vocab = scaled.shape[-1]
        sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        rank = jnp.arange(vocab)[None, :]
        keep = rank < jnp.where(s.top_k > 0, s.top_k, vocab)[:, None]
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep &= mass_before < s.top_p[:, None]
        keep &= probs >= s.min_p[:, None] * probs[:, :1]
        keep = keep.at[:, 0].set(True)  # the most likely token always survives
        num_kept = jnp.sum(keep, axis=-1)
        cutoff = jnp.take_along_axis(sorted_logits, (num_kept - 1)[:, None], axis=-1)
        return jnp.where(scaled >= cutoff, scaled, -jnp.inf)

    used = (s.top_k > 0) | (s.top_p < 1) | (s.min_p > 0)
    return jax.lax.cond(jnp.any(used & (s.temperature > 0)), apply, lambda x: x, scaled)


def top_logprobs(logits: jax.Array, lse: jax.Array, k: int, wanted: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(ids i32[N, k], logprobs f32[N, k]) of the k most likely tokens of `logits` f32[N, V], whose rows'
    logsumexp is `lse` f32[N]; computed only if any row wants them."""

    def compute(logits):
        values, ids = jax.lax.top_k(logits, min(k, logits.shape[-1]))
        pad = k - values.shape[-1]  # vocabulary < k: the rest is id 0 at -inf (dropped on the host)
        values = jnp.pad(values - lse[:, None], ((0, 0), (0, pad)), constant_values=-jnp.inf)
        return jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, pad))), values

    def skip(logits):
        return jnp.zeros((logits.shape[0], k), jnp.int32), jnp.zeros((logits.shape[0], k), jnp.float32)

    return jax.lax.cond(jnp.any(wanted), compute, skip, logits)


def sample(
    logits: jax.Array,  # f32[B, V]
    s: SamplingBatch,
    pool: PenaltyPool,
    positions: jax.Array,  # i32[B] position of the token being sampled from (varies the random draw)
    num_top_logprobs: int,
):
    """Returns (next_ids i32[B], next_logprobs f32[B], top_ids i32[B, K], top_logprobs f32[B, K])."""
    lse = logsumexp(logits)
    rows = jnp.arange(logits.shape[0])[:, None]

    def adjust(logits):  # penalties, logit bias, grammar mask: each skipped when no row uses it
        adjusted = _apply_penalties(logits, s, pool)
        adjusted = adjusted.at[rows, s.bias_ids].add(s.bias_values)
        return _apply_allowed_mask(adjusted, s)

    # Every branch below returns [B] ids, never a [B, V] array: a cond whose untaken branch passes
    # the logits through copies them (6 MB at 32 rows of a 49152-token vocabulary).
    adjusting = jnp.any(_penalized(s)) | jnp.any(s.bias_values != 0) | jnp.any(s.use_mask)
    # Branches are fresh functions: JAX caches a cond branch's trace by the function object, and a kernel
    # dispatcher (argmax_first) passed itself would keep the first engine's kernel choice for every later one.
    greedy_ids = jax.lax.cond(adjusting, lambda x: argmax_first(adjust(x)), lambda x: argmax_first(x), logits)
    temperature = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]

    def noise(seed, position):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.gumbel(key, logits.shape[-1:], jnp.float32)

    def sampled(logits):  # the Gumbel-max draw: argmax of logits + Gumbel noise samples softmax(logits)
        scaled = _filter(adjust(logits) / temperature, s)
        return argmax_first(scaled + jax.vmap(noise)(s.seed, positions))

    any_random = jnp.any(s.temperature > 0)
    random_ids = jax.lax.cond(any_random, sampled, lambda x: greedy_ids, logits)
    next_ids = jnp.where(s.temperature > 0, random_ids, greedy_ids).astype(jnp.int32)
    next_logprobs = jnp.take_along_axis(logits, next_ids[:, None], axis=-1)[:, 0] - lse
    top_ids, top_lps = top_logprobs(logits, lse, num_top_logprobs, s.want_top_logprobs)
    return next_ids, next_logprobs, top_ids, top_lps
