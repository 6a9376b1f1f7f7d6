"""Per-channel int8 / fp8 expert weights: the quantizer's error bound, scale-after-dot == dequantized
weights, and a served Qwen3-MoE model's logprob drift against the unquantized one (int8 and fp8 also quantize
its other weights in groups: tests/models/test_grouped_quantization.py)."""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.moe import moe_ffn
from models.quantization import KINDS, quantize_weight
from serve import Engine
from tests.helpers import greedy
from tests.models.test_moe_parity import CASES, ENGINE_ARGS, save_checkpoint


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantizer_error_is_bounded_per_channel(kind):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 16, 10)).astype(np.float32) * rng.uniform(0.1, 10, size=(3, 1, 10))
    w[1, :, 4] = 0.0  # an all-zero channel must not divide by zero
    q, scale = quantize_weight(w, kind)
    assert q.dtype == KINDS[kind][0] and scale.shape == (3, 10)
    deq = q.astype(np.float32) * scale[:, None, :]
    assert np.all(deq[1, :, 4] == 0)
    # Each channel's largest magnitude maps to the format's largest value, exactly.
    np.testing.assert_allclose(np.abs(deq).max(axis=1), np.abs(w).max(axis=1), rtol=1e-6)
    if kind == "int8":  # round to nearest: half a step
        assert np.all(np.abs(deq - w) <= scale[:, None, :] / 2 + 1e-6)
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 for normal numbers
        normal = np.abs(w) >= scale[:, None, :] * 2.0**-6
        assert np.all(np.abs(deq - w)[normal] <= np.abs(w)[normal] * 2.0**-4 + 1e-7)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_scales_after_the_dot_equal_dequantized_weights(kind):
    rng = np.random.default_rng(1)
    t, d, f, e = 9, 8, 6, 4
    x = rng.standard_normal((t, d)).astype(np.float32)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[:, 2] = -30.0  # an expert no token chooses
    q_gu, s_gu = quantize_weight(rng.standard_normal((e, d, 2 * f)), kind)
    q_dn, s_dn = quantize_weight(rng.standard_normal((e, f, d)), kind)
    routing = dict(top_k=2, scoring="softmax", normalize_topk=True)
    deq_gu = q_gu.astype(np.float32) * s_gu[:, None, :]
    deq_dn = q_dn.astype(np.float32) * s_dn[:, None, :]
    # float32 arithmetic, as the engine traces a float32 model on an accelerator (serve/setup.py
    # matmul_precision): the GPU's default TF32 dots would round the two weight layouts differently.
    with jax.default_matmul_precision("highest"):
        got = moe_ffn(
            x, logits, jnp.asarray(q_gu), jnp.asarray(q_dn), gate_up_scale=s_gu, down_scale=s_dn, **routing
        )
        expected = moe_ffn(x, logits, deq_gu, deq_dn, **routing)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Prompt logprobs and greedy tokens of one tiny Qwen3-MoE served unquantized, int8, fp8 and int4."""
    path = str(tmp_path_factory.mktemp("qwen3_moe_q"))
    save_checkpoint(path, CASES["qwen3_moe"])
    prompts = [np.random.default_rng(0).integers(3, 300, size=n).tolist() for n in (37, 70)]
    out = {}
    for kind in (None, "int8", "fp8", "int4"):
        startup = io.StringIO()
        with contextlib.redirect_stderr(startup):
            engine = Engine(model=path, quantization=kind, **ENGINE_ARGS)
        try:
            dtypes = {leaf.dtype.name for leaf in jax.tree.leaves(engine.runner.params)}
            res = engine.generate(
                input_ids=prompts,
                sampling_params=greedy(16),
                return_logprob=True,
                logprob_start_len=0,
            )
        finally:
            engine.shutdown()
        lps = np.array([lp for r in res for lp, _ in r["meta_info"]["input_token_logprobs"][1:]])
        out[kind] = (lps, [r["output_ids"] for r in res], dtypes, startup.getvalue())
    return out


# This random tiny model is more sensitive than a trained one (large weights, sharp logits). Measured:
# int8 (the experts per channel, every other Linear, the embedding and the LM head in groups of 32) max 0.33
# / mean 0.017; fp8 (the same weights, e4m3: 3 mantissa bits) max 0.41 / mean 0.079 (experts only, as it
# was: max 0.37 / mean 0.027); garbage scales give nats.
@pytest.mark.parametrize("kind,max_bound,mean_bound", [("int8", 1.0, 0.05), ("fp8", 1.5, 0.15)])
@pytest.mark.slow
def test_served_logprob_drift_is_small(served, kind, max_bound, mean_bound, capsys):
    base, quant = served[None], served[kind]
    assert KINDS[kind][0].name in quant[2] and KINDS[kind][0].name not in base[2]
    drift = np.abs(quant[0] - base[0])
    with capsys.disabled():
        print(
            f"\n{kind}: prompt logprob drift max {drift.max():.4f} mean {drift.mean():.5f}; "
            f"greedy tokens equal: "
            f"{sum(a == b for x, y in zip(quant[1], base[1]) for a, b in zip(x, y))}/{sum(map(len, base[1]))}"
        )
    assert 0 < drift.max() < max_bound and drift.mean() < mean_bound


@pytest.mark.slow
def test_int4_stores_experts_in_int8(served):
    """`int4`: the Linear layers in grouped 4-bit (packed uint8), the experts per channel in int8 (what the
    fused MoE kernels take), and the startup line says so."""
    assert {"uint8", "int8"} <= served["int4"][2]
    assert re.search(r"quantization int4: expert weights [\d.]+ MiB -> [\d.]+ MiB", served["int4"][3])
    drift = np.abs(served["int4"][0] - served[None][0])
    assert drift.mean() > np.abs(served["int8"][0] - served[None][0]).mean()  # 4-bit everywhere else


@pytest.mark.slow
def test_int8_drifts_less_than_fp8(served):
    # int8 keeps 8 bits per channel-scaled weight, e4m3 only 4 significant bits: int8 must be closer.
    assert (
        np.abs(served["int8"][0] - served[None][0]).mean() < np.abs(served["fp8"][0] - served[None][0]).mean()
    )


@pytest.mark.slow
def test_startup_reports_the_memory_saving(served):
    # 2 sparse layers x 8 experts x (64 x 64 + 32 x 64) weights = 98304 numbers: 384 KiB in float32.
    line = re.search(r"quantization int8: expert weights ([\d.]+) MiB -> ([\d.]+) MiB", served["int8"][3])
    assert line, served["int8"][3]
    before, after = map(float, line.groups())
    assert before == pytest.approx(98304 * 4 / 2**20, abs=0.05)
    assert after == pytest.approx(
        (98304 + 2 * 8 * (64 + 64)) * 4 / 4 / 2**20 + 2 * 8 * 64 * 3 / 2**20, abs=0.05
    )
    assert "quantization" not in served[None][3]
