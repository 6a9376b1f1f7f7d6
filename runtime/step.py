"""The step: one compiled program = forward + sampling (+ prompt logprobs), pools donated."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from kernels.backend import KernelBackends, use_kernels
from kernels.cpu import live_rows
from kernels.sampling import logsumexp
from memory import MemoryPools, copy_state_slots
from runtime.batch import StepBatch, StepOutput
from runtime.sampling import sample, top_logprobs, update_penalty_pool


def _input_logprobs(model, hidden, batch: StepBatch, k: int):
    """Logprob of each next prompt token (and the top k) at every position, only when asked for."""

    def compute(hidden):
        logits = model.logits(hidden)
        lse = logsumexp(logits)
        targets = jnp.take_along_axis(logits, batch.input_logprob_targets[:, None], axis=-1)[:, 0] - lse
        top_ids, top_lps = top_logprobs(logits, lse, k, jnp.ones((1,), bool))
        return targets, top_ids, top_lps

    def skip(hidden):
        t = hidden.shape[0]
        return jnp.zeros((t,), jnp.float32), jnp.zeros((t, k), jnp.int32), jnp.zeros((t, k), jnp.float32)

    return jax.lax.cond(batch.want_input_logprobs, compute, skip, hidden)


def forward_and_sample(graphdef, params, pools: MemoryPools, batch: StepBatch, *, num_top_logprobs: int,
                       kernels: KernelBackends = KernelBackends(), matmul_precision: str | None = None):
    """Runs the model on `batch`, samples one token per sequence row; returns (StepOutput, pools).

    Pure: reads only its arguments (`kernels`, static, picks each op's implementation at trace time;
    `matmul_precision`, static, is the default precision of its dots, e.g. "highest": see RunnerConfig).
    `pools` is donated by the caller, so XLA updates KV pages and penalty counts in place; the caller
    must use the returned pools from then on.
    """
    precision = (contextlib.nullcontext() if matmul_precision is None
                 else jax.default_matmul_precision(matmul_precision))
    with use_kernels(kernels), precision:
        return _forward_and_sample(graphdef, params, pools, batch, num_top_logprobs)


def _forward_and_sample(graphdef, params, pools: MemoryPools, batch: StepBatch, num_top_logprobs: int):
    model = nnx.merge(graphdef, params)
    fwd = batch.forward
    # A placeholder input id -1 - r stands for the token request row r sampled last (a step the host built
    # before the previous step's tokens came back: the overlap schedule, scheduler/stepping.py). Real ids are
    # never negative: Scheduler.validate refuses them at the edge.
    last_ids = pools.penalty.last_ids
    placeholder = fwd.input_ids < 0
    fwd = fwd._replace(input_ids=jnp.where(
        placeholder, last_ids[jnp.clip(-1 - fwd.input_ids, 0, last_ids.shape[0] - 1)], fwd.input_ids))
    batch = batch._replace(forward=fwd)
    penalty = update_penalty_pool(pools.penalty, batch.sampling, fwd.input_ids, batch.token_penalty_row,
                                  batch.token_kind, batch.penalty_uncount)
    pools = pools._replace(penalty=penalty)
    rec = pools.recurrent
    if rec is not None and batch.state_fixes.shape[0]:  # an accepted draft row's state becomes the slot's
        pools = pools._replace(recurrent=copy_state_slots(rec, None, batch.state_fixes))
    snapshots = pools.snapshots
    if snapshots is not None:  # a prefix-cache hit starts from its snapshot
        pools = pools._replace(recurrent=copy_state_slots(pools.recurrent, snapshots, batch.state_loads))
    # a bucket's padding rows are not multiplied (where the products' kernel takes it: kernels/cpu)
    live = (contextlib.nullcontext() if fwd.live_rows is None
            else live_rows(fwd.input_ids.shape[0], fwd.live_rows))
    with live:
        hidden, pools = model(fwd, pools)
    if snapshots is not None:
        pools = pools._replace(snapshots=copy_state_slots(snapshots, pools.recurrent, batch.state_saves))
    with jax.named_scope("sampling"):
        logits = model.logits(hidden[batch.logits_indices])
        positions = fwd.positions[batch.logits_indices]
        next_ids, next_lps, top_ids, top_lps = sample(logits, batch.sampling, penalty, positions,
                                                      num_top_logprobs)
        # each decode row's token, kept for the next step's placeholders (padding rows write the dummy row
        # 0; draft rows' scratch slots lie past the rows and are dropped)
        decode_ids = next_ids[next_ids.shape[0] - fwd.num_decode:]
        last_ids = pools.penalty.last_ids.at[fwd.decode_slots].set(decode_ids, mode="drop")
        pools = pools._replace(penalty=pools.penalty._replace(last_ids=last_ids))
    with jax.named_scope("input_logprobs"):
        in_lps, in_top_ids, in_top_lps = _input_logprobs(model, hidden, batch, num_top_logprobs)
    out = StepOutput(next_ids, next_lps, top_ids, top_lps, in_lps, in_top_ids, in_top_lps)
    return out, pools


def multi_step_decode(graphdef, params, pools: MemoryPools, batch: StepBatch, out_cache_locs, state_saves, *,
                      num_steps: int, num_top_logprobs: int, kernels: KernelBackends = KernelBackends(),
                      matmul_precision: str | None = None):
    """`num_steps` decode steps in one program (no host round trip between tokens).

    `batch` is a decode-only batch for the first step; `out_cache_locs` i32[num_steps, B] holds the
    KV slot of each later token (pages reserved by the host beforehand) and `state_saves` i32[num_steps, B, 2]
    each step's `StepBatch.state_saves` (the batch's own is not used). Each step feeds the token
    sampled by the previous one. Returns (StepOutput with a leading [num_steps] axis, pools).
    """

    def body(carry, xs):
        pools, batch = carry
        locs, saves = xs
        out, pools = forward_and_sample(graphdef, params, pools, batch._replace(state_saves=saves),
                                        num_top_logprobs=num_top_logprobs, kernels=kernels,
                                        matmul_precision=matmul_precision)
        fwd = batch.forward._replace(
            input_ids=out.next_ids, positions=batch.forward.positions + 1, out_cache_loc=locs
        )
        # Every fed token after the first is a generated one: count it for penalties.
        kind = jnp.where(batch.token_penalty_row > 0, 2, 0).astype(jnp.int32)
        sampling = batch.sampling._replace(reset_row=jnp.zeros_like(batch.sampling.reset_row))
        return (pools, batch._replace(forward=fwd, sampling=sampling, token_kind=kind,
                                      state_fixes=jnp.zeros_like(batch.state_fixes),
                                      penalty_uncount=jnp.zeros_like(batch.penalty_uncount))), out

    (pools, _), outs = jax.lax.scan(body, (pools, batch), (out_cache_locs, state_saves))
    return outs, pools


def per_rank(fn, mesh: Mesh, pool_specs: MemoryPools, *, output_rank_axis: int):
    """Wraps a step `fn(params, pools, batch, *extra) -> (StepOutput, pools)` to run once per data rank.

    Manual over `data` only (`tensor`/`expert` stay automatic inside, so the model is unchanged): each rank
    gets its own section of the batch (every non-scalar batch array is the concatenation of the ranks'
    equally shaped sections), its own shard of the pools (`pool_specs`, addressed with local page and row
    ids) and the replicated weights, so attention, norms and recurrent state never mix ranks. Each
    `extra` array (multi-step cache slots) and every output carry the rank sections on `output_rank_axis`.
    """
    ranked = PartitionSpec(*([None] * output_rank_axis), "data")

    def run(params, pools, batch, *extra):
        batch_specs = jax.tree.map(lambda x: PartitionSpec() if x.ndim == 0 else PartitionSpec("data"), batch)
        return jax.shard_map(
            fn, mesh=mesh, in_specs=(PartitionSpec(), pool_specs, batch_specs, *(ranked,) * len(extra)),
            out_specs=(ranked, pool_specs), axis_names=frozenset({"data"}), check_vma=False,
        )(params, pools, batch, *extra)

    return run
