"""bench.random_checkpoint: a random checkpoint of a real shape with the default model's tokenizer serves."""

from __future__ import annotations

import pytest

from bench.random_checkpoint import SHAPES, write_checkpoint
from serve import Engine
from serve.tokenizer import tokenizer_dir

pytestmark = pytest.mark.slow


def test_a_shrunk_mamba2_checkpoint_serves_text(tmp_path, smollm2_gguf, cache_dir):
    shape = {**SHAPES["mamba2-130m"], "hidden_size": 64, "num_hidden_layers": 2, "state_size": 16,
             "head_dim": 16, "num_heads": 8}
    path = write_checkpoint(str(tmp_path), shape, tokenizer_dir(smollm2_gguf, cache_dir))
    engine = Engine(model=path, in_process=True, dtype="float32", max_running_requests=2, context_length=128,
                    chunked_prefill_size=64)
    try:
        assert engine.tokenizer.backend.get_vocab_size() == 49152
        out = engine.generate(prompt="The capital of France is", sampling_params={"temperature": 0,
                                                                                  "max_new_tokens": 4,
                                                                                  "ignore_eos": True})
        assert len(out["output_ids"]) == 4 and isinstance(out["text"], str)
        assert engine.scheduler.prefix_cache_info()["enabled"]
    finally:
        engine.shutdown()
