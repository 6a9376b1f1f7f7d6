"""ModelRunner: owns parameters and pools on device, compiles every bucket once, runs steps."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import sys
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kernels.backend import CPU_OPS
from memory import KVPool, MemoryPools, PenaltyPool, RecurrentStatePool
from models.batch import ForwardBatch
from runtime.batch import SamplingBatch, StepBatch, StepOutput
from runtime.batch_builder import concat_ranks, empty_sampling
from runtime.buckets import StepShape
from runtime.config import RunnerConfig
from runtime.mesh import pool_specs, shard_params, shard_pools
from runtime.step import forward_and_sample, multi_step_decode, per_rank


def _abstract(x, sharding=None):
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding)


class ModelRunner:
    """Device half of the engine. `step` and `multi_step` take NumPy batches and return device outputs.

    Every program is compiled ahead of time per `StepShape`; a shape seen after `precompile` is
    compiled on the spot and counted in `compiles_after_warmup` (it should stay 0).
    """

    def __init__(self, model: nnx.Module, model_cfg, cfg: RunnerConfig, dtype, mesh: Mesh | None = None):
        """`mesh` (runtime/mesh.py): weights and pools are split over it and XLA partitions every step; its
        `data` axis must have `cfg.dp_size` devices."""
        data = 1 if mesh is None else mesh.shape["data"]
        if data != cfg.dp_size:
            raise ValueError(f"dp_size={cfg.dp_size} but the mesh's data axis has {data} devices")
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.mesh = mesh
        dp = cfg.dp_size
        self.graphdef, self.params = nnx.split(model)
        self.weight_bytes = sum(x.nbytes for x in self._params_flat)
        spec = model_cfg.cache_spec
        # Request rows double as recurrent slots; each rank's first row (and first page) is its dummy. A
        # rank's recurrent slots end with its scratch slots for speculative draft rows.
        rows = dp * (cfg.max_running_requests + 1)
        state_slots = dp * (cfg.max_running_requests + 1 + cfg.draft_state_slots)
        kv_dtype = jax.numpy.dtype(cfg.kv_cache_dtype) if cfg.kv_cache_dtype else dtype
        self.pools = MemoryPools(
            KVPool.create(spec.num_kv_layers, dp * cfg.num_pages, cfg.page_size, spec.num_kv_heads,
                          spec.head_dim, kv_dtype, latent=spec.latent_kv)
            if spec.has_kv
            else None,
            PenaltyPool.create(rows, model_cfg.vocab_size),
            RecurrentStatePool.create(spec.recurrent, state_slots, dtype) if spec.recurrent else None,
            RecurrentStatePool.create(spec.recurrent, dp * (cfg.state_snapshots + 1), dtype)
            if spec.recurrent and cfg.state_snapshots else None,
        )
        if mesh is not None:
            self.params = shard_params(mesh, self.params)
            self.pools = shard_pools(mesh, self.pools,
                                     split_heads=spec.recurrent is not None and spec.recurrent.split_heads)
        k = cfg.max_top_logprobs
        kernels = cfg.kernels
        if mesh is not None and mesh.size > 1:
            # Native CPU kernels are custom calls XLA cannot partition: it would gather their operands.
            kernels = dataclasses.replace(
                kernels, overrides=(*kernels.overrides, *((op, "reference") for op in CPU_OPS)))
        step_fn = functools.partial(forward_and_sample, self.graphdef, num_top_logprobs=k, kernels=kernels,
                                    matmul_precision=cfg.matmul_precision)
        multi_fn = functools.partial(multi_step_decode, self.graphdef, num_steps=cfg.multi_step_decode,
                                     num_top_logprobs=k, kernels=kernels,
                                     matmul_precision=cfg.matmul_precision)
        step_fn, multi_fn = (_unflattening(step_fn, self._params_tree),
                             _unflattening(multi_fn, self._params_tree))
        step_out, multi_out = None, None
        if mesh is not None:
            # On a mesh the pools must leave each step laid out as they came in (the next step is compiled
            # for that layout). Outputs come back replicated for the host, or with data parallelism stay in
            # their rank sections (step: rows; multi-step: axis 1, after the step axis) until the host reads.
            # Across hosts they are always replicated: the leader reads them, and a rank section may live
            # on another host.
            pool_shardings = jax.tree.map(lambda x: x.sharding, self.pools)
            split = dp > 1 and jax.process_count() == 1
            step_out = (NamedSharding(mesh, PartitionSpec("data") if split else PartitionSpec()),
                        pool_shardings)
            multi_out = (NamedSharding(mesh, PartitionSpec(None, "data") if split else PartitionSpec()),
                         pool_shardings)
        if dp > 1:
            specs = pool_specs(mesh, self.pools, data_only=True)
            step_fn = per_rank(step_fn, mesh, specs, output_rank_axis=0)
            multi_fn = per_rank(multi_fn, mesh, specs, output_rank_axis=1)
        self._step_jit = jax.jit(step_fn, donate_argnames=("pools",), out_shardings=step_out)
        self._multi_jit = jax.jit(multi_fn, donate_argnames=("pools",), out_shardings=multi_out)
        self._compiled: dict[tuple, object] = {}
        # Multi-host leader (runtime/distributed.py): called with (kind, shape, batch, out_cache_locs) before
        # every step, so that the followers run the same program on the same batch.
        self.on_step = None
        self.warmed_up = False
        self.compiles_after_warmup = 0

    @property
    def params(self):
        """The weights (an nnx.State); None once released."""
        return None if self._params_flat is None else jax.tree.unflatten(self._params_tree, self._params_flat)

    @params.setter
    def params(self, state) -> None:
        # Steps take the weights as a flat list of arrays, which jit flattens in C++; an nnx.State flattens
        # each Variable in Python (measured 0.75 -> 0.57 ms of host time per step with SmolLM2's 182 arrays).
        if state is None:
            self._params_flat = None
        else:
            self._params_flat, self._params_tree = jax.tree.flatten(state)

    # ---- compilation -------------------------------------------------------------------------

    def _compile(self, key: tuple, fn, *example_args):
        if self.warmed_up:
            self.compiles_after_warmup += 1
            print(f"[xlaserve] warning: compiling unseen step shape {key} after warm-up", file=sys.stderr)
        batch, *extra = example_args
        abstract = [jax.tree.map(lambda x: _abstract(x, self._input_sharding(x, 0)), batch)]
        abstract += [_abstract(x, self._input_sharding(x, 1)) for x in extra]
        compiled = fn.lower(self._params_flat, self.pools, *abstract).compile()
        self._compiled[key] = compiled
        return compiled

    def _input_sharding(self, x, rank_axis: int) -> NamedSharding | None:
        """Host inputs are replicated over the mesh (every device reads the whole batch), except that with
        data parallelism each rank's devices get only its section (on `rank_axis`; scalars are shared)."""
        if self.mesh is None:
            return None
        if self.cfg.dp_size == 1 or np.ndim(x) == 0:
            return NamedSharding(self.mesh, PartitionSpec())
        return NamedSharding(self.mesh, PartitionSpec(*([None] * rank_axis), "data"))

    def programs(self) -> list[tuple]:
        """Every (kind, StepShape) precompile covers."""
        keys = [("step", s) for s in self.cfg.buckets.all_shapes()]
        if self.cfg.multi_step_decode > 1:
            keys += [("multi", s) for s in self.cfg.buckets.all_shapes() if s.prefill_blocks == 0]
        return keys

    def precompile(self, progress: bool = True) -> float:
        """Compiles every bucket (with a progress bar on stderr); returns the seconds it took."""
        from tqdm import tqdm

        start = time.perf_counter()

        def compile_one(key):
            kind, shape = key
            batch = self.dummy_batch(shape)
            if kind == "step":
                return self._compile(key, self._step_jit, batch)
            locs = np.zeros((self.cfg.multi_step_decode, self.cfg.dp_size * shape.decode), np.int32)
            return self._compile(key, self._multi_jit, batch, locs, np.zeros((*locs.shape, 2), np.int32))

        keys = self.programs()
        # XLA compiles outside the GIL: one thread per core overlaps the programs' compilations.
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = [pool.submit(compile_one, key) for key in keys]
            bar = tqdm(total=len(keys), desc="precompiling buckets", disable=not progress, file=sys.stderr)
            for future in concurrent.futures.as_completed(futures):
                future.result()
                bar.update()
            bar.close()
        if jax.default_backend() != "cpu":
            self.run_each_once()
        self.warmed_up = True
        return time.perf_counter() - start

    def run_each_once(self) -> None:
        """Runs every compiled program once on an all-padding batch (padding writes only the dummy page, row
        and slot 0). An accelerator's first run of a program carries one-time costs (loading its kernels: on
        an H100 a decode step's first run took 12-17 ms against ~4 ms later) that would otherwise land in
        some request's step. On a CPU it is a few ms a program (a tiny Llama's 24: 0.15 s the first time,
        0.09 s again), less than running the large prefill programs would cost there at startup."""
        for kind, shape in self.programs():  # (in the same order on every host of a multi-host mesh)
            compiled, batch = self._compiled[(kind, shape)], self.dummy_batch(shape)
            if kind == "step":
                out, self.pools = compiled(self._params_flat, self.pools, batch)
            else:
                locs = np.zeros((self.cfg.multi_step_decode, self.cfg.dp_size * shape.decode), np.int32)
                out, self.pools = compiled(self._params_flat, self.pools, batch, locs,
                                           np.zeros((*locs.shape, 2), np.int32))
            jax.block_until_ready(out)

    def dummy_batch(self, shape: StepShape) -> StepBatch:
        """An all-padding batch of `shape` for every rank (for compiling, and for tests)."""
        return concat_ranks([zeros_batch(shape, self.cfg)] * self.cfg.dp_size)

    # ---- running -----------------------------------------------------------------------------

    def step(self, batch: StepBatch, shape: StepShape) -> StepOutput:
        """Runs one step; the pools are donated and replaced. Outputs stay on device until read."""
        key = ("step", shape)
        if self.on_step is not None:
            self.on_step("step", shape, batch)
        compiled = self._compiled.get(key) or self._compile(key, self._step_jit, batch)
        out, self.pools = compiled(self._params_flat, self.pools, batch)
        return out

    def pools_lost(self) -> bool:
        """Whether a step that failed after donating the pools consumed them (nothing can run then)."""
        return any(x.is_deleted() for x in jax.tree.leaves(self.pools))

    def multi_step(self, batch: StepBatch, shape: StepShape, out_cache_locs: np.ndarray,
                   state_saves: np.ndarray | None = None) -> StepOutput:
        """`multi_step_decode` decode steps in one call; outputs carry a leading step axis.

        `out_cache_locs` i32[num_steps, dp_size * decode]: each rank's section of decode columns in turn;
        `state_saves` i32[num_steps, dp_size * decode, 2] (default none): each step's snapshot copies."""
        key = ("multi", shape)
        if state_saves is None:
            state_saves = np.zeros((*np.shape(out_cache_locs), 2), np.int32)
        if self.on_step is not None:
            self.on_step("multi", shape, batch, out_cache_locs, state_saves)
        compiled = self._compiled.get(key) or self._compile(key, self._multi_jit, batch, out_cache_locs,
                                                            state_saves)
        out, self.pools = compiled(self._params_flat, self.pools, batch, out_cache_locs, state_saves)
        return out


def _unflattening(fn, params_tree):
    """`fn(params, pools, *args)` called with the weights as `params_tree`'s flat list of leaves."""

    def run(params, pools, *args):
        return fn(jax.tree.unflatten(params_tree, params), pools, *args)

    return run


def zeros_batch(shape: StepShape, cfg: RunnerConfig) -> StepBatch:
    """One rank's all-padding section of `shape`."""
    t = shape.prefill_blocks * cfg.buckets.prefill_block_size + shape.decode
    b = shape.prefill_blocks + shape.decode
    zeros_t = np.zeros(t, np.int32)
    zeros_blocks, zeros_decode = np.zeros(shape.prefill_blocks, np.int32), np.zeros(shape.decode, np.int32)
    fwd = ForwardBatch(zeros_t, zeros_t, zeros_t, np.zeros((shape.prefill_blocks, shape.pages), np.int32),
                       np.zeros((shape.decode, shape.pages), np.int32), zeros_blocks, zeros_blocks,
                       zeros_decode, zeros_decode if cfg.draft_state_slots else None, np.zeros(4, np.int32))
    sampling = SamplingBatch(**empty_sampling(b, cfg.max_bias, cfg.mask_words, cfg.max_draft_tokens))
    pairs = np.zeros((b, 2), np.int32)
    return StepBatch(fwd, np.zeros(b, np.int32), sampling, zeros_t, zeros_t, zeros_t, np.asarray(False),
                     pairs, pairs, np.zeros((cfg.draft_state_slots, 2), np.int32),
                     np.zeros((cfg.buckets.max_decode if cfg.max_draft_tokens else 0, 2), np.int32))
