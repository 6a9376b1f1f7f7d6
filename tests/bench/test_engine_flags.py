"""bench.engine_flags: the benchmarks' engine flags become Engine keyword arguments."""

from __future__ import annotations

import argparse

from bench.engine_flags import add_engine_flags, engine_kwargs


def _parse(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    return engine_kwargs(p.parse_args(argv))


def test_defaults_leave_the_model_to_the_engine():
    assert _parse() == dict(dtype="auto", quantization=None, activation_quantization="none",
                            kv_cache_dtype="auto")


def test_flags_are_passed_as_the_server_names_them():
    got = _parse("--model", "m.gguf", "--quantization", "auto", "--activation-quantization", "int8",
                 "--kv-cache-dtype", "bfloat16", "--dtype", "float32")
    assert got == dict(model="m.gguf", dtype="float32", quantization="auto", activation_quantization="int8",
                       kv_cache_dtype="bfloat16")
