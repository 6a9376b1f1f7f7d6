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

from kernels.backend import KernelBackends
from memory import KVPool, MemoryPools, PenaltyPool, RecurrentStatePool
from models.batch import ForwardBatch
from runtime.batch import SamplingBatch, StepBatch, StepOutput
from runtime.batch_builder import empty_sampling
from runtime.buckets import Buckets, StepShape
from runtime.mesh import shard_params, shard_pools
from runtime.step import forward_and_sample, multi_step_decode


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    page_size: int
    num_pages: int  # including the dummy page 0
    max_running_requests: int
    buckets: Buckets
    vocab_size: int
    max_top_logprobs: int = 20
    max_bias: int = 64  # logit_bias entries (plus min_new_tokens suppressions) per request
    multi_step_decode: int = 1  # decode steps per host round trip when nothing waits
    kernels: KernelBackends = KernelBackends()  # reference or Pallas implementation of each op

    @property
    def mask_words(self) -> int:
        """int32 words of a packed vocabulary bitmask."""
        return -(-self.vocab_size // 32)

    def __post_init__(self):
        if self.multi_step_decode < 1:
            raise ValueError(f"multi_step_decode={self.multi_step_decode} must be >= 1")


def _abstract(x, sharding=None):
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding)


class ModelRunner:
    """Device half of the engine. `step` and `multi_step` take NumPy batches and return device outputs.

    Every program is compiled ahead of time per `StepShape`; a shape seen after `precompile` is
    compiled on the spot and counted in `compiles_after_warmup` (it should stay 0).
    """

    def __init__(self, model: nnx.Module, model_cfg, cfg: RunnerConfig, dtype, mesh: Mesh | None = None):
        """`mesh` (runtime/mesh.py): weights and pools are split over it and XLA partitions every step."""
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.mesh = mesh
        self.graphdef, self.params = nnx.split(model)
        self.weight_bytes = sum(x.nbytes for x in jax.tree.leaves(self.params))
        spec = model_cfg.cache_spec
        rows = cfg.max_running_requests + 1  # request rows double as recurrent slots; 0 is the dummy
        self.pools = MemoryPools(
            KVPool.create(spec.num_kv_layers, cfg.num_pages, cfg.page_size, spec.num_kv_heads, spec.head_dim, dtype,
                          latent=spec.latent_kv)
            if spec.has_kv
            else None,
            PenaltyPool.create(rows, model_cfg.vocab_size),
            RecurrentStatePool.create(spec.recurrent, rows, dtype) if spec.recurrent else None,
        )
        if mesh is not None:
            self.params = shard_params(mesh, self.params)
            self.pools = shard_pools(mesh, self.pools)
        k = cfg.max_top_logprobs
        # On a mesh the pools must leave each step laid out as they came in (the next step is compiled for
        # that layout), and outputs come back replicated for the host.
        out_shardings = None
        if mesh is not None:
            out_shardings = (NamedSharding(mesh, PartitionSpec()), jax.tree.map(lambda x: x.sharding, self.pools))
        self._step_jit = jax.jit(
            functools.partial(forward_and_sample, self.graphdef, num_top_logprobs=k, kernels=cfg.kernels),
            donate_argnames=("pools",), out_shardings=out_shardings,
        )
        self._multi_jit = jax.jit(
            functools.partial(multi_step_decode, self.graphdef, num_steps=cfg.multi_step_decode, num_top_logprobs=k,
                              kernels=cfg.kernels),
            donate_argnames=("pools",), out_shardings=out_shardings,
        )
        self._compiled: dict[tuple, object] = {}
        self.warmed_up = False
        self.compiles_after_warmup = 0

    # ---- compilation -------------------------------------------------------------------------

    def _compile(self, key: tuple, fn, *example_args):
        if self.warmed_up:
            self.compiles_after_warmup += 1
            print(f"[xlaserve] warning: compiling unseen step shape {key} after warm-up", file=sys.stderr)
        # Host inputs are replicated over the mesh (every device reads the whole batch).
        replicated = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        abstract = jax.tree.map(lambda x: _abstract(x, replicated), example_args)
        compiled = fn.lower(self.params, self.pools, *abstract).compile()
        self._compiled[key] = compiled
        return compiled

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
            locs = np.zeros((self.cfg.multi_step_decode, shape.decode), np.int32)
            return self._compile(key, self._multi_jit, batch, locs)

        keys = self.programs()
        # XLA compiles outside the GIL: one thread per core overlaps the programs' compilations.
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = [pool.submit(compile_one, key) for key in keys]
            bar = tqdm(total=len(keys), desc="precompiling buckets", disable=not progress, file=sys.stderr)
            for future in concurrent.futures.as_completed(futures):
                future.result()
                bar.update()
            bar.close()
        self.warmed_up = True
        return time.perf_counter() - start

    def dummy_batch(self, shape: StepShape) -> StepBatch:
        """An all-padding batch of `shape` (for compiling, and for tests)."""
        return zeros_batch(shape, self.cfg)

    # ---- running -----------------------------------------------------------------------------

    def step(self, batch: StepBatch, shape: StepShape) -> StepOutput:
        """Runs one step; the pools are donated and replaced. Outputs stay on device until read."""
        key = ("step", shape)
        compiled = self._compiled.get(key) or self._compile(key, self._step_jit, batch)
        out, self.pools = compiled(self.params, self.pools, batch)
        return out

    def multi_step(self, batch: StepBatch, shape: StepShape, out_cache_locs: np.ndarray) -> StepOutput:
        """`multi_step_decode` decode steps in one call; outputs carry a leading step axis."""
        key = ("multi", shape)
        compiled = self._compiled.get(key) or self._compile(key, self._multi_jit, batch, out_cache_locs)
        out, self.pools = compiled(self.params, self.pools, batch, out_cache_locs)
        return out


def zeros_batch(shape: StepShape, cfg: RunnerConfig) -> StepBatch:
    t = shape.prefill_blocks * cfg.buckets.prefill_block_size + shape.decode
    b = shape.prefill_blocks + shape.decode
    zeros_t = np.zeros(t, np.int32)
    zeros_blocks, zeros_decode = np.zeros(shape.prefill_blocks, np.int32), np.zeros(shape.decode, np.int32)
    fwd = ForwardBatch(zeros_t, zeros_t, zeros_t, np.zeros((shape.prefill_blocks, shape.pages), np.int32),
                       np.zeros((shape.decode, shape.pages), np.int32), zeros_blocks, zeros_blocks, zeros_decode)
    sampling = SamplingBatch(**empty_sampling(b, cfg.max_bias, cfg.mask_words))
    return StepBatch(fwd, np.zeros(b, np.int32), sampling, zeros_t, zeros_t, zeros_t, np.asarray(False))
