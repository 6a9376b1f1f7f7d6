"""Tiny Mamba-2, MiniMax and Qwen3-MoE models served with `--kernel-backend pallas` (every Pallas kernel
run in the CPU interpreter) give the same greedy tokens as with the jnp references."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from serve import Engine
from tests.helpers import greedy

# Each model is served twice, once with every Pallas kernel interpreted (3-60 s).
pytestmark = pytest.mark.slow

GREEDY = greedy(8)
ARGS = dict(in_process=True, dtype="float32", max_running_requests=2, chunked_prefill_size=32,
            prefill_block_size=16, context_length=128, page_size=16, max_total_tokens=1024,
            skip_tokenizer_init=True)


def _mamba2(path):
    from tests.tiny_models import save_tiny_mamba2

    return save_tiny_mamba2(path)


def _minimax(path):
    from tests.models.test_minimax_parity import save_checkpoint

    save_checkpoint(path)
    return path


def _qwen3_moe(path):
    from tests.models.test_moe_parity import CASES, save_checkpoint

    save_checkpoint(path, CASES["qwen3_moe"])
    return path


def _qwen3_next(path):
    from tests.models.test_qwen3_next_parity import save_checkpoint

    save_checkpoint(path)
    return path


def _kimi_linear(path):
    from tests.models.test_kimi_linear_parity import save_checkpoint

    save_checkpoint(path)
    return path


# model -> the ops its layers call through the dispatcher
MODELS = {
    "mamba2": (_mamba2, {"ssd_prefill", "ssd_decode_rows"}),
    "minimax": (_minimax, {"gla_prefill", "paged_attention", "write_kv", "experts_ffn"}),
    "qwen3_moe": (_qwen3_moe, {"paged_attention", "write_kv", "experts_ffn"}),
    "qwen3_next": (_qwen3_next, {"gated_delta_prefill", "gated_delta_decode_rows", "paged_attention",
                                 "write_kv", "experts_ffn"}),
    "kimi_linear": (_kimi_linear, {"kda_prefill", "kda_decode_rows", "experts_ffn"}),
}


def _greedy(path, prompts, backend, capsys) -> list[list[int]]:
    engine = Engine(model=path, kernel_backend=backend, **ARGS)
    try:
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", list(MODELS))
def test_pallas_backend_gives_the_reference_tokens(name, tmp_path, monkeypatch):
    from kernels import backend

    make, ops = MODELS[name]
    path = make(str(tmp_path / name))
    prompts = [np.random.default_rng(0).integers(3, 300, size=n).tolist() for n in (5, 37)]
    reference = _greedy(path, prompts, "reference", None)
    # Count the kernel calls made while tracing, so the case cannot pass by never reaching a kernel.
    called = set()
    real = backend._load

    def spy(target):
        fn = real(target)
        pallas = {t: op for op, (t, _) in backend.PALLAS_OPS.items()}
        if target not in pallas:  # a native CPU kernel (kernels/cpu), not interpreted
            return fn
        op = pallas[target]
        native = jax.default_backend() in backend.PALLAS_OPS[op][1]

        def wrapped(*a, **k):
            called.add(op)
            assert k["interpret"] is not native  # interpreted where the kernel is not native (CPU)
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(backend, "_load", spy)
    assert _greedy(path, prompts, "pallas", None) == reference
    assert called == ops
    assert len({tuple(r) for r in reference}) == 2
