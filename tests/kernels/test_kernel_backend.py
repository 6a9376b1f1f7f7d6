"""Kernel selection: `--kernel-backend` parsing, what `auto` picks per platform, dispatch at trace time."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels import backend
from kernels.backend import KernelBackends, use_kernels
from serve.server_args import ServerArgs


def test_auto_picks_native_kernels_only():
    auto = KernelBackends()
    assert auto.choice("ssd_prefill", "cpu") == ("reference", False)
    # Portable kernels lower through Triton too, but measured slower than the references on an H100.
    assert auto.choice("ssd_prefill", "gpu") == ("reference", False)
    assert auto.choice("experts_ffn", "gpu") == ("reference", False)  # TPU-only kernel
    assert all(auto.choice(op, "tpu") == ("pallas", False) for op in backend.PALLAS_OPS)


def test_pallas_interprets_where_not_native_and_overrides_win():
    b = KernelBackends.parse("pallas, experts_ffn=reference")
    assert b.choice("gla_prefill", "cpu") == ("pallas", True)
    assert b.choice("gla_prefill", "tpu") == ("pallas", False)
    assert b.choice("experts_ffn", "cpu") == ("reference", False)
    assert "gla_prefill=pallas (interpret)" in b.describe("cpu")


@pytest.mark.parametrize("spec,match", [("fast", "'fast'"),
                                        ("auto,flash=pallas", "unknown kernel op 'flash'"),
                                        ("auto,ssd_prefill=gpu", "'gpu' for ssd_prefill")])
def test_bad_specs_are_refused_naming_the_problem(spec, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(kernel_backend=spec)


def test_dispatch_happens_at_trace_time(monkeypatch):
    calls = []
    monkeypatch.setitem(backend.PALLAS_OPS, "ssd_prefill", ("tests.kernels.test_kernel_backend:_fake_kernel",
                                                             frozenset({"tpu"})))
    backend._load.cache_clear()
    from kernels.ssd import ssd_prefill

    globals()["_fake_kernel"] = lambda *a, interpret, **k: calls.append(interpret) or "kernel"
    with use_kernels(KernelBackends("pallas")):
        assert ssd_prefill(1, 2, 3, 4, 5, 6, 7) == "kernel"
    assert calls == [True]  # not native on CPU: interpreted
    x = jnp.zeros((1, 4, 2, 3))
    # default backends on CPU: reference
    y, final = ssd_prefill(x, jnp.zeros((1, 4, 2)), -jnp.ones(2), jnp.zeros((1, 4, 1, 5)),
                           jnp.zeros((1, 4, 1, 5)), jnp.zeros((1, 2, 3, 5)), np.array([True]))
    assert y.shape == (1, 4, 2, 3) and final.shape == (1, 2, 3, 5) and calls == [True]
    backend._load.cache_clear()
