"""Shared by the test modules: the repository root, tolerances, greedy runs on an Engine and their checks."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- tolerances -----------------------------------------------------------------------------------------

# Logprobs (absolute; also logits and hidden states where a test compares those) of two fp32 computations of
# the same model in a different order: ours against Hugging Face or a golden file, absorbed against expanded
# MLA, split over devices or hosts against one, native CPU kernels against the jnp references. A correct run
# is off by ~1e-6 (4e-6 at most in the parity cases).
LOGPROB_ATOL = 1e-4
# Logprobs (absolute) of one engine computed by two routes through the same ops: cached decode against one
# prefill over the whole sequence, stacked against per-layer weights.
RECOMPUTE_ATOL = 1e-5
# Every greedy step's top-2 logprob gap must exceed this, far above a correct fp32 run's error: otherwise
# "tokens identical" would hinge on rounding order, not on correctness (pick another seed).
MIN_GREEDY_GAP = 1e-3
# Chunked-scan Pallas kernels (SSD, GLA) against their references, times the output's largest magnitude.
SCAN_KERNEL_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def assert_allclose_to_scale(got, want, tol: float, *, rtol: float = 0.0, err_msg: str = "") -> None:
    """`got` equals `want` within `tol` times `want`'s largest magnitude (and `rtol`)."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=tol * np.abs(want).max(),
                               err_msg=err_msg)


# ---- requests ---------------------------------------------------------------------------------------------

# Prompt lengths of the engine invariance tests (16-token pages, 64-token chunks): inside a page, one token
# past one and two pages, exactly a chunk, past a chunk, whole pages, and 120 of a 256-token context.
INVARIANCE_PROMPT_LENS = (5, 17, 33, 64, 90, 3, 48, 120)


def greedy(max_new_tokens: int) -> dict[str, Any]:
    """Sampling params of a greedy run of exactly `max_new_tokens` tokens (eos ignored)."""
    return {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


def random_prompts(seed: int, vocab: int, lengths: Sequence[int]) -> list[list[int]]:
    """Prompts of `lengths` ids drawn from one generator seeded `seed`, in [3, vocab) (0-2: pad, bos, eos)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


# ---- engine checks ----------------------------------------------------------------------------------------


def assert_idle_and_consistent(engine) -> None:
    """Nothing runs or waits, every page is free again or held, unlocked, by the prefix cache, every request
    row (recurrent-state slot) is free, the scheduler's bookkeeping (the tree's and the snapshot slots'
    included) checks out, and no step program was compiled after warmup."""
    s = engine.scheduler
    s.check_integrity()
    assert not s.running and not s.waiting and not s.live
    trees = [c.tree for c in s.rank_caches if c is not None]
    assert all(t.num_locks == 0 for t in trees), "a cache lock outlived its request"
    cached_pages = sum(t.num_cached_pages for t in trees)
    assert s.num_free_tokens + cached_pages * s.page_size == s.capacity_tokens, "pages leaked"
    assert s.req_to_token.num_free_rows == s.req_to_token.max_requests, "request rows (state slots) leaked"
    assert engine.runner.compiles_after_warmup == 0


def outputs_of(engine, prompts: list[list[int]], sampling: dict[str, Any]) -> list[list[int]]:
    """The output ids of `prompts` generated as one batch."""
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=sampling)]


def alone_and_batched(engine, prompts: list[list[int]], sampling: dict[str, Any]) -> tuple[list, list]:
    """The output ids of each prompt run alone, then of all of them as one batch; checks that the outputs
    depend on the prompt (a degenerate random model would make every invariance trivial)."""
    alone = [engine.generate(input_ids=p, sampling_params=sampling)["output_ids"] for p in prompts]
    batched = outputs_of(engine, prompts, sampling)
    assert len(set(map(tuple, alone))) > 4, "random model is degenerate: outputs do not depend on the prompt"
    return alone, batched


def recompute(engine, prompt: list[int], decoded: dict) -> dict:
    """`prompt` + the tokens of `decoded` (its greedy output) but the last, prefilled in one step: its prompt
    logprobs from the last prompt token on score those tokens without the decode cache."""
    return engine.generate(input_ids=prompt + decoded["output_ids"][:-1], sampling_params=greedy(1),
                           return_logprob=True, logprob_start_len=len(prompt) - 1)


def decode_and_recompute(engine, prompt: list[int], sampling: dict[str, Any]) -> tuple[dict, dict]:
    """`prompt` decoded with output logprobs, and `recompute` of it."""
    decoded = engine.generate(input_ids=prompt, sampling_params=sampling, return_logprob=True)
    return decoded, recompute(engine, prompt, decoded)


def assert_decode_equals_recompute(decoded: dict, recomputed: dict, atol: float, err_msg: str = "") -> None:
    """The cached decode's tokens and output logprobs (all but the last) equal those of `recompute`."""
    dec = decoded["meta_info"]["output_token_logprobs"][:-1]
    rec = recomputed["meta_info"]["input_token_logprobs"][1:]
    assert [t for _, t in rec] == [t for _, t in dec], err_msg
    np.testing.assert_allclose([lp for lp, _ in rec], [lp for lp, _ in dec], atol=atol, rtol=0,
                               err_msg=err_msg)


# ---- one forward without an engine ------------------------------------------------------------------------


def prefill_batch(prompt: list[int], block_size: int, page_size: int):
    """A ForwardBatch prefilling `prompt` alone in slot 1, its pages 1, 2, ... (page 0 is the dummy)."""
    import jax.numpy as jnp

    from models.batch import ForwardBatch

    n = len(prompt)
    num_blocks = -(-n // block_size)
    t = num_blocks * block_size
    pages = np.arange(1, -(-t // page_size) + 1, dtype=np.int32)
    real = np.arange(t) < n
    positions = np.where(real, np.arange(t), 0).astype(np.int32)
    locs = np.where(real, pages[np.arange(t) // page_size] * page_size + np.arange(t) % page_size, 0)
    lens = np.clip(n - block_size * np.arange(num_blocks), 0, block_size)
    return ForwardBatch(
        input_ids=jnp.asarray(np.where(real, np.pad(prompt, (0, t - n)), 0), jnp.int32),
        positions=jnp.asarray(positions),
        out_cache_loc=jnp.asarray(locs, jnp.int32),
        prefill_pages=jnp.asarray(np.tile(pages, (num_blocks, 1))),
        decode_pages=jnp.zeros((0, len(pages)), jnp.int32),
        prefill_slots=jnp.ones((num_blocks,), jnp.int32),
        prefill_lens=jnp.asarray(lens, jnp.int32),
        decode_slots=jnp.zeros((0,), jnp.int32),
    )


def prefill_pools(cfg, num_pages: int, *, latent: bool = False):
    """fp32 pools of `num_pages` 16-token pages (a latent KV pool with `latent`) and two request slots (the
    dummy and slot 1) for `prefill_batch`."""
    import jax.numpy as jnp

    from memory import KVPool, MemoryPools, PenaltyPool, RecurrentStatePool

    spec = cfg.cache_spec
    num_kv_heads = 1 if latent else spec.num_kv_heads
    return MemoryPools(
        KVPool.create(spec.num_kv_layers, num_pages, 16, num_kv_heads, spec.head_dim, jnp.float32,
                      latent=latent),
        PenaltyPool.create(2, cfg.vocab_size),
        RecurrentStatePool.create(spec.recurrent, 2, jnp.float32),
    )


def prefill_logits(cfg, model, prompt: list[int]) -> np.ndarray:
    """f32[len(prompt), vocab]: a loaded hybrid model's (`models.loader.load_model`) logits over `prompt`,
    prefilled alone in 16-token blocks and pages by one jitted forward (a single small compile, no engine)."""
    import jax
    from flax import nnx

    pools = prefill_pools(cfg, num_pages=8)
    graphdef, params = nnx.split(model)

    @jax.jit  # one compile is faster than running the ops eagerly
    def forward_logits(params, batch, pools):
        model = nnx.merge(graphdef, params)
        hidden, _ = model(batch, pools)
        return model.logits(hidden)

    logits = forward_logits(params, prefill_batch(prompt, block_size=16, page_size=16), pools)
    return np.asarray(logits)[: len(prompt)]
