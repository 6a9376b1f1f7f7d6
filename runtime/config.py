"""RunnerConfig: the sizes and choices one compiled step is built for (shared by the runner and the batch
builder, which lays batches out to these sizes)."""

from __future__ import annotations

import dataclasses

from kernels.backend import KernelBackends
from runtime.buckets import Buckets


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Sizes of one data-parallel rank: with `dp_size` ranks the pools hold `dp_size` times as many pages and
    request rows, split over the mesh's `data` axis, and every step carries one section per rank."""

    page_size: int
    num_pages: int  # per rank, including the rank's dummy page 0
    max_running_requests: int  # per rank
    buckets: Buckets
    vocab_size: int
    max_top_logprobs: int = 20
    max_bias: int = 64  # logit_bias entries per request
    multi_step_decode: int = 1  # decode steps per host round trip when nothing waits
    kernels: KernelBackends = KernelBackends()  # reference or Pallas implementation of each op
    dp_size: int = 1  # data-parallel ranks (the mesh's `data` axis)
    # Default precision of the step's dots (jax.default_matmul_precision), None: the backend's. GPUs run
    # float32 dots in TF32 and TPUs in bfloat16 passes by default (relative error ~3e-4 on a 1024^3 product,
    # measured on an H100): `--dtype float32` there asks for "highest".
    matmul_precision: str | None = None
    # Prefix-cache snapshots of the recurrent state per rank (a pool of as many slots + the dummy slot 0);
    # 0: no snapshot pool (models without recurrent layers, or the prefix cache off).
    state_snapshots: int = 0
    # The KV (or MLA latent) pool's dtype, "float32" or "bfloat16"; None: the model's dtype.
    kv_cache_dtype: str | None = None
    # Speculative decoding on a recurrent model: scratch state slots per rank (after the request slots) that
    # draft rows leave their states in, i.e. the most draft rows one step verifies; 0: none.
    draft_state_slots: int = 0
    # Speculative decoding: draft tokens per request and step, at most (0: off); sizes the penalty uncounts.
    max_draft_tokens: int = 0

    @property
    def mask_words(self) -> int:
        """int32 words of a packed vocabulary bitmask."""
        return -(-self.vocab_size // 32)

    def __post_init__(self):
        if self.kv_cache_dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be float32, bfloat16 or None")
        if self.multi_step_decode < 1:
            raise ValueError(f"multi_step_decode={self.multi_step_decode} must be >= 1")
        if self.dp_size < 1:
            raise ValueError(f"dp_size={self.dp_size} must be >= 1")
        if self.state_snapshots < 0:
            raise ValueError(f"state_snapshots={self.state_snapshots} must be >= 0")
        if self.draft_state_slots < 0:
            raise ValueError(f"draft_state_slots={self.draft_state_slots} must be >= 0")
