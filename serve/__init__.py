"""HTTP/OpenAI serving, tokenizer, CLI, and the in-process `Engine`."""

from __future__ import annotations


def __getattr__(name: str):
    # Lazy: `import serve` stays cheap (no jax) for the CLI's --help.
    if name == "Engine":
        from serve.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
