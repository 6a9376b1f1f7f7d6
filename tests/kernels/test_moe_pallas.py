"""Fused MoE Pallas kernels (TPU interpreter) against `kernels.moe.reference.experts_ffn`.

Single-device kernel over shapes (idle experts, more experts than tokens, top-1 and top-2, token counts
not a multiple of the token tile, several token blocks, several intermediate tiles), float32, bfloat16,
int8 weights and a shared expert; its weight schedule (idle experts are never fetched); and the
expert-parallel kernel on 4 fake CPU devices, in a subprocess (the device count is fixed when jax starts).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu

from kernels.moe import reference
from kernels.moe.pallas import Tiles, experts_ffn, routed_weight_blocks, tiles_for
from tests.helpers import REPO, assert_allclose_to_scale

# The kernel sums over intermediate tiles and over a token's experts in another order than the reference:
# float32 rounding only. bf16 dots agree closely too, but a bf16 rounding of the activation can flip.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
IDLE = 1  # an expert no token routes to, in the middle of the expert range


def _problem(
    t: int, d: int, f: int, e: int, k: int, dtype, *, quantized=False, shared_f=0, seed=0, idle=(IDLE,)
) -> tuple[tuple, dict]:
    """Random routed inputs for experts_ffn: (x, weights, experts, w_gate_up, w_down), keyword args."""
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.normal(size=(t, e)).astype(np.float32)
    logits[:, list(idle)] = -30.0
    weights, experts = reference.route(jnp.asarray(logits), top_k=k, normalize_topk=k > 1)
    x = jnp.asarray(rng.normal(size=(t, d)), dtype)
    kwargs = {}
    if quantized:  # int8 weights with per-output-channel scales, applied after the dot
        w_gate_up = jnp.asarray(rng.integers(-127, 128, size=(e, d, 2 * f)), jnp.int8)
        w_down = jnp.asarray(rng.integers(-127, 128, size=(e, f, d)), jnp.int8)
        kwargs["gate_up_scale"] = jnp.asarray(rng.uniform(0.5, 1.5, (e, 2 * f)) / (127 * d**0.5), jnp.float32)
        kwargs["down_scale"] = jnp.asarray(rng.uniform(0.5, 1.5, (e, d)) / (127 * f**0.5), jnp.float32)
    else:
        w_gate_up = jnp.asarray(rng.normal(size=(e, d, 2 * f)) / d**0.5, dtype)
        w_down = jnp.asarray(rng.normal(size=(e, f, d)) / f**0.5, dtype)
    if shared_f:
        kwargs["shared_gate_up"] = jnp.asarray(rng.normal(size=(d, 2 * shared_f)) / d**0.5, dtype)
        kwargs["shared_down"] = jnp.asarray(rng.normal(size=(shared_f, d)) / shared_f**0.5, dtype)
    return (x, weights, experts, w_gate_up, w_down), kwargs


# The race detector flags a DMA overlapping a read or write of the same bytes that no semaphore orders.
INTERPRET = pltpu.InterpretParams(detect_races=True)


def _no_races() -> bool:
    # InterpretParams documents `races.races_found` (this module's global) as the detector's verdict.
    return not interpret_pallas_call.races.races_found


@functools.partial(jax.jit, static_argnames=("tiles",))
def _kernel(args, kwargs, tiles):
    return experts_ffn(*args, **kwargs, tiles=tiles, interpret=INTERPRET)


_reference = jax.jit(reference.experts_ffn)  # eager, each jnp op would compile on its own


def _check(args, kwargs, tiles, dtype):
    want = np.asarray(_reference(*args, **kwargs))
    got = _kernel(args, kwargs, tiles)
    assert _no_races()
    assert got.dtype == jnp.float32 and got.shape == want.shape
    assert_allclose_to_scale(got, want, TOL[dtype], rtol=TOL[dtype])


# name: (T, D, F, E, k, dtype, tiles or None for tiles_for's, extra problem options)
CASES = {
    # 13 tokens in token tiles of 8 (a partial tile), F in 3 tiles, one idle expert.
    "f32_top2_partial_tile": (13, 32, 24, 6, 2, jnp.float32, Tiles(16, 8, 8), {}),
    # Two token blocks (the second partial), 2 intermediate tiles, top-1.
    "bf16_top1_two_blocks": (13, 32, 24, 6, 1, jnp.bfloat16, Tiles(8, 8, 12), {}),
    # More experts than tokens (most idle), the default tiles (one block, F whole).
    "f32_more_experts_than_tokens": (5, 32, 16, 16, 2, jnp.float32, None, {}),
    # int8 weights with per-channel scales and bf16 activations.
    "int8_bf16_x": (11, 32, 16, 4, 2, jnp.bfloat16, Tiles(16, 8, 8), dict(quantized=True)),
    # A shared expert whose width (40) is no multiple of tile_f (16): it gets its own tile (8); two blocks.
    "f32_shared_expert": (21, 32, 32, 6, 2, jnp.float32, Tiles(16, 8, 16), dict(shared_f=40)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_kernel_matches_reference(name: str) -> None:
    t, d, f, e, k, dtype, tiles, options = CASES[name]
    args, kwargs = _problem(t, d, f, e, k, dtype, **options)
    used = np.bincount(np.asarray(args[2]).ravel(), minlength=e)
    assert used[IDLE] == 0  # the idle expert the case claims
    if tiles is not None:  # the tilings the case names really happen
        assert t % tiles.tile_tokens and f // tiles.tile_f > 1
    else:
        tiles = tiles_for(t, d, f, e, dtype, dtype)
        assert e > t and (used == 0).sum() > 1 and tiles.tile_f == f
    _check(args, kwargs, tiles, dtype)


@pytest.mark.slow
def test_idle_experts_are_never_fetched_and_nan_there_is_harmless() -> None:
    """Idle experts cost no weight DMA (the pipeline fetches each used tile once per token block) and their
    weights never reach the output: NaN there leaves the result equal to the reference's."""
    t, d, f, e, k = 13, 32, 24, 6, 2
    idle = (1, 4)
    args, kwargs = _problem(t, d, f, e, k, jnp.float32, idle=idle, seed=3)
    tiles = Tiles(8, 8, 8)
    experts = np.asarray(args[2])
    fetched = routed_weight_blocks(args[1], args[2], e, f, tiles)
    per_block = [set(experts[b : b + tiles.block_tokens].ravel()) for b in range(0, t, tiles.block_tokens)]
    assert len(fetched) == sum(len(used) for used in per_block) * (f // tiles.tile_f)
    assert {expert for expert, _ in fetched} == set(experts.ravel()) and not set(idle) & set(experts.ravel())

    want = np.asarray(_reference(*args))
    w_gate_up, w_down = np.array(args[3]), np.array(args[4])
    w_gate_up[list(idle)] = np.nan
    w_down[list(idle)] = np.nan
    got = np.asarray(_kernel((*args[:3], jnp.asarray(w_gate_up), jnp.asarray(w_down)), {}, tiles))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_reference_shared_expert_is_added_unweighted() -> None:
    """The reference's shared expert: the routed output plus a dense gated MLP over every token."""
    args, kwargs = _problem(7, 16, 8, 4, 2, jnp.float32, shared_f=12)
    x = np.asarray(args[0], np.float64)
    gate_up = x @ np.asarray(kwargs["shared_gate_up"], np.float64)
    gate, up = gate_up[:, :12], gate_up[:, 12:]
    dense = (gate / (1 + np.exp(-gate)) * up) @ np.asarray(kwargs["shared_down"], np.float64)
    got = _reference(*args, **kwargs) - _reference(*args)
    np.testing.assert_allclose(np.asarray(got), dense, rtol=1e-5, atol=1e-5)


# ---- expert parallel: 4 fake CPU devices, in a subprocess ----

EP_CASES = {
    # (T, D, F, E, k, dtype, tiles, problem options); T and E split over 4 devices.
    # Experts 2 and 3 idle: device 1 owns no routed token; 2 intermediate tiles; partial token tiles.
    "f32_top2_idle_device": (16, 32, 16, 8, 2, jnp.float32, Tiles(8, 8, 8), dict(idle=(2, 3))),
    # Every token on device 0's experts: its receive buffer full (the dropless worst case), 3 devices idle.
    "f32_all_on_one_device": (16, 32, 16, 8, 2, jnp.float32, Tiles(8, 8, 16), dict(idle=(2, 3, 4, 5, 6, 7))),
    # int8 weights, bf16 activations, top-1, F whole.
    "int8_bf16_top1": (8, 32, 16, 8, 1, jnp.bfloat16, Tiles(8, 8, 16), dict(quantized=True, idle=(5,))),
}


def _ep_main() -> None:
    """Runs in the subprocess: every EP case against the single-device reference, race detector on."""
    from kernels.moe.pallas_ep import experts_ffn_ep

    assert len(jax.devices()) == 4, jax.devices()
    mesh = jax.make_mesh((4,), ("expert",))
    for name, (t, d, f, e, k, dtype, tiles, options) in EP_CASES.items():
        args, kwargs = _problem(t, d, f, e, k, dtype, **options)
        owners = np.asarray(args[2]).ravel() // (e // 4)
        token_device = np.repeat(np.arange(4), t // 4 * k)
        assert (owners != token_device).any()  # rows really cross devices
        want = np.asarray(_reference(*args, **kwargs))
        got = np.asarray(experts_ffn_ep(*args, **kwargs, mesh=mesh, tiles=tiles, interpret=INTERPRET))
        assert _no_races(), name
        assert_allclose_to_scale(got, want, TOL[dtype], rtol=TOL[dtype], err_msg=name)
        print("ok", name, flush=True)


@pytest.mark.slow
def test_expert_parallel_on_four_devices_matches_reference() -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    code = "import tests.kernels.test_moe_pallas as t; t._ep_main()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == len(EP_CASES), proc.stdout
