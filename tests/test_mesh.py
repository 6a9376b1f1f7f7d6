"""Tensor and expert parallelism on 8 fake CPU devices: the same greedy tokens and prompt logprobs (within
1e-4) as one device, weights and KV really split, per-device pool bytes as reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from serve.server_args import ServerArgs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_worker(model: str, prompts, configs: dict) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.mesh_worker", json.dumps(
        {"model": model, "prompts": prompts, "configs": configs})], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _check_same(results: dict, base: str = "single") -> None:
    for name, res in results.items():
        assert res["compiles_after_warmup"] == 0, name
        assert res["output_ids"] == results[base]["output_ids"], name
        for ours, ref in zip(res["input_logprobs"], results[base]["input_logprobs"]):
            np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0, err_msg=name)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 300, size=n).tolist() for n in (5, 37, 70)]


def test_tensor_parallel_dense_model(tmp_path_factory, prompts):
    from tests.test_hf_parity import CASES, _save_checkpoint

    path = str(tmp_path_factory.mktemp("qwen2_tp"))
    _save_checkpoint(path, CASES["qwen2_tied_bias"])  # 4 heads, 2 KV heads, qkv bias, tied embeddings
    results = _run_worker(path, prompts, {"single": {}, "tp2": {"tp_size": 2}, "tp4": {"tp_size": 4}})
    _check_same(results)
    tp2, tp4 = results["tp2"], results["tp4"]
    assert tp2["num_devices"] == 2 and tp4["num_devices"] == 4
    for res in (tp2, tp4):  # heads (and the fused q/k/v columns) split over the TP devices
        assert res["specs"]["layers.attn.qkv.kernel"] == "P(None, None, 'tensor')"
        assert res["specs"]["layers.attn.o.kernel"] == "P(None, 'tensor', None)"
    # Two KV heads: split over 2 devices, replicated over 4 (fewer heads than devices).
    assert tp2["kv_bytes_per_device"] * 2 == tp2["kv_bytes"]
    assert tp4["kv_bytes_per_device"] == tp4["kv_bytes"]


def test_expert_parallel_moe_model(tmp_path_factory, prompts):
    from tests.test_moe_parity import CASES, _save_checkpoint

    path = str(tmp_path_factory.mktemp("qwen3_moe_ep"))
    _save_checkpoint(path, CASES["qwen3_moe"])  # 8 experts, top-2
    results = _run_worker(path, prompts, {"single": {}, "ep4": {"tp_size": 4, "ep_size": 4},
                                          "tp4_ep2": {"tp_size": 4, "ep_size": 2}})
    _check_same(results)
    assert results["ep4"]["specs"]["layers.mlp.experts.gate_up"] == "P(None, 'expert', None, None)"
    assert results["tp4_ep2"]["specs"]["layers.mlp.experts.gate_up"] == (
        "P(None, 'expert', None, 'tensor')")


@pytest.mark.parametrize("kwargs,match", [({"ep_size": 3, "tp_size": 4}, "ep_size=3 must divide"),
                                          ({"dp_size": 2}, "not implemented")])
def test_bad_parallel_sizes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)
