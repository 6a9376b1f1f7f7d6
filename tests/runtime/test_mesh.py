"""Tensor, expert and data parallelism on 8 fake CPU devices: the same greedy tokens and prompt logprobs
(within 1e-4) as one device, weights and KV really split, per-device pool bytes as reported, every
data-parallel rank's pages and slots consistent and all free at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from memory import MemoryPools
from serve.server_args import ServerArgs
from tests.helpers import LOGPROB_ATOL, REPO, random_prompts


def _run_worker(model: str, prompts, configs: dict) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.mesh_worker", json.dumps(
        {"model": model, "prompts": prompts, "configs": configs})], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _check_same(results: dict, base: str = "single") -> None:
    for name, res in results.items():
        _check_read_by_shard(name, res)
        # The native CPU matmul runs on one device only (a custom call XLA cannot split); the single-device
        # run uses it, so its outputs check it against the split runs' XLA dots.
        assert (res["native_matmuls"] > 0) == (res["num_devices"] == 1), (name, res["native_matmuls"])
        assert res["compiles_after_warmup"] == 0, name
        assert res["idle_and_free"], f"{name}: pages or request slots still held after every request finished"
        assert res["output_ids"] == results[base]["output_ids"], name
        assert res["again_ids"] == res["output_ids"], f"{name}: the prefix cache changed the outputs"
        # Each prompt again finds all but its last token's whole pages, on its rank (round robin may send it
        # to the other one: then nothing).
        full = [(len(p) - 1) // 16 * 16 for p in res["prompts"]]
        if len(res["admitted_per_rank"]) == 1:
            assert res["again_cached"] == full, name
        else:
            assert all(c in (0, f) for c, f in zip(res["again_cached"], full)), name
        for ours, ref in zip(res["input_logprobs"], results[base]["input_logprobs"]):
            np.testing.assert_allclose(ours, ref, atol=LOGPROB_ATOL, rtol=0, err_msg=name)


def _check_read_by_shard(name: str, res: dict) -> None:
    """The loader read each device's shard of each parameter on its own (models/weights/lazy.py): no shard
    read more than its own bytes, no region was read twice, nothing fell back to a whole-tensor read."""
    load = res["load"]
    assert not load["fallbacks"], (name, load["fallbacks"])
    assert load["bytes_read"] == load["bytes_of_sources"], (name, load)
    over = [s for s in load["shards"] if s[2] > s[1]]  # [param, shard bytes, bytes read for it]
    assert not over, (name, over[:5])
    if res["num_devices"] > 1 and len(res["admitted_per_rank"]) == 1:  # split weights: shards smaller
        sizes: dict[str, list[int]] = {}
        for param, nbytes, _ in load["shards"]:
            sizes.setdefault(param, []).append(nbytes)
        split = {p for p, s in sizes.items() if len(s) > 1}
        for suffix in ("embed", "attn.qkv.kernel", "attn.o.kernel"):
            assert any(p.endswith(suffix) for p in split), (name, suffix, sorted(split))
        for p in split:
            assert max(sizes[p]) * len(sizes[p]) == sum(sizes[p]), (name, p, sizes[p])


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(0, 300, (5, 37, 70))


@pytest.mark.slow
def test_tensor_parallel_dense_model(tmp_path_factory, prompts):
    from tests.models.test_hf_parity import CASES, save_checkpoint

    path = str(tmp_path_factory.mktemp("qwen2_tp"))
    save_checkpoint(path, CASES["qwen2_tied_bias"])  # 4 heads, 2 KV heads, qkv bias, tied embeddings
    spec = {"speculative_algorithm": "ngram", "speculative_ngram_min_match_window_size": 1,
            "speculative_fixed_drafts": True}
    results = _run_worker(path, prompts, {"single": {}, "tp2": {"tp_size": 2}, "tp4": {"tp_size": 4},
                                          "tp2_dp2": {"tp_size": 2, "dp_size": 2},
                                          "tp2_dp2_spec": {"tp_size": 2, "dp_size": 2, **spec}})
    _check_same(results)
    _check_data_parallel(results["tp2_dp2"], kv_split=4)
    # the overlap schedule on a mesh and on each data-parallel rank (placeholders read the rank's own rows)
    assert results["tp2"]["num_overlapped_steps"] > 0 and results["tp2_dp2"]["num_overlapped_steps"] > 0
    # speculative decoding on each data-parallel rank: drafts verified there, the same greedy tokens
    assert results["tp2_dp2_spec"]["speculative"]["verify_steps"] > 0
    tp2, tp4 = results["tp2"], results["tp4"]
    # Fused q|k|v and gate|up split into whole GQA groups and channel pairs (models/fused.py): with as many
    # KV heads as devices no activation moves between devices inside the layers of a decode step (sampling's
    # sort over the split vocabulary still moves logits). With fewer KV heads (tp4) a group spans devices.
    assert all("sampling" in op for op in tp2["decode_moves"]), tp2["decode_moves"]
    assert tp2["num_devices"] == 2 and tp4["num_devices"] == 4
    # heads (and the fused q/k/v columns) split over the TP devices; per-layer weights on CPU
    for res in (tp2, tp4):
        assert res["specs"]["layers.0.attn.qkv.kernel"] == "P(None, 'tensor')"
        assert res["specs"]["layers.1.attn.o.kernel"] == "P('tensor', None)"
    # Two KV heads: split over 2 devices, replicated over 4 (fewer heads than devices).
    assert tp2["kv_bytes_per_device"] * 2 == tp2["kv_bytes"]
    assert tp4["kv_bytes_per_device"] == tp4["kv_bytes"]


@pytest.mark.slow
def test_expert_parallel_moe_model(tmp_path_factory, prompts):
    from tests.models.test_moe_parity import CASES, save_checkpoint

    path = str(tmp_path_factory.mktemp("qwen3_moe_ep"))
    save_checkpoint(path, CASES["qwen3_moe"])  # 8 experts, top-2
    results = _run_worker(path, prompts, {"single": {}, "ep4": {"tp_size": 4, "ep_size": 4},
                                          "tp4_ep2": {"tp_size": 4, "ep_size": 2}})
    _check_same(results)
    assert results["ep4"]["specs"]["layers.mlp.experts.gate_up"] == "P(None, 'expert', None, None)"
    assert results["tp4_ep2"]["specs"]["layers.mlp.experts.gate_up"] == (
        "P(None, 'expert', None, 'tensor')")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3_next", "bailing_hybrid"])
def test_tensor_parallel_delta_rule_hybrid(tmp_path_factory, prompts, case):
    """Qwen3-Next (Gated DeltaNet + gated attention) and Ling 3 (KDA + MLA) under tp 2: the delta-rule layers
    split over heads (projections grouped by head, models/fused.py), their recurrent states and prefix-cache
    snapshots with them, and no activation moves between devices inside the layers of a decode step."""
    if case == "qwen3_next":
        from tests.models.test_qwen3_next_parity import save_checkpoint
    else:
        from tests.models.test_kimi_linear_parity import save_checkpoint

    path = str(tmp_path_factory.mktemp(f"{case}_tp"))
    save_checkpoint(path, case)
    configs = {"single": {}, "tp2": {"tp_size": 2}}
    if case == "qwen3_next":  # and two data-parallel ranks, each with its own state slots
        configs["dp2"] = {"dp_size": 2, "num_continuous_decode_steps": 4}
    results = _run_worker(path, prompts, configs)
    _check_same(results)
    if case == "qwen3_next":
        _check_data_parallel(results["dp2"], kv_split=2)
    tp2 = results["tp2"]
    specs, split = tp2["specs"], "P(None, 'tensor')"
    if case == "qwen3_next":  # layers 0, 1, 3: Gated DeltaNet; 2: attention
        assert specs["layers.2.attn.qkv.kernel"] == specs["layers.2.attn.gate.kernel"] == split
        assert specs["layers.0.attn.qkvz.kernel"] == specs["layers.0.attn.ba.kernel"] == split
    else:  # layers 0, 1, 3: KDA; 2: MLA
        assert specs["layers.2.attn.g.kernel"] == split
        for name in ("qkv", "b", "f", "g"):
            assert specs[f"layers.0.attn.{name}.kernel"] == split, name
    assert specs["layers.0.attn.o.kernel"] == "P('tensor', None)"
    # the last pool leaves: ssm and conv states of the slots, then of the snapshots: heads over the devices
    ssm, conv = "P(None, None, 'tensor', None, None)", "P(None, None, 'tensor', None)"
    assert tp2["pool_specs"][-4:] == [ssm, conv, ssm, conv], tp2["pool_specs"]
    # Moves only in sampling and the MoE (its experts' gate|up halves split over devices: gate on one, up on
    # the other), none in the attention or delta-rule layers.
    assert all(op.split("/")[1] in ("sampling", "mlp") for op in tp2["decode_moves"]), tp2["decode_moves"]


def _check_data_parallel(res: dict, kv_split: int) -> None:
    """Both ranks got requests; every pool's slot axis is split over `data` (KV pages also over heads)."""
    assert len(res["admitted_per_rank"]) == 2 and min(res["admitted_per_rank"]) > 0, res["admitted_per_rank"]
    assert all("'data'" in spec for spec in res["pool_specs"]), res["pool_specs"]
    assert res["kv_bytes_per_device"] * kv_split == res["kv_bytes"]


@pytest.mark.slow
def test_data_parallel_hybrid_recurrent_model(tmp_path_factory, prompts):
    """Two ranks, each with its own KV pages and recurrent-state slots, requests placed by shortest queue,
    decode steps fused (multi-step) once prefills are done; and with speculative decoding."""
    from tests.models.test_hybrid_parity import CASES, save_checkpoint

    path = str(tmp_path_factory.mktemp("nemotron_h_dp"))
    save_checkpoint(path, CASES["nemotron_h"])  # Mamba-2 + attention + MLP layers
    spec = {"speculative_algorithm": "ngram", "speculative_ngram_min_match_window_size": 1,
            "speculative_fixed_drafts": True}
    results = _run_worker(path, prompts, {"single": {}, "dp2": {
        "dp_size": 2, "load_balance_method": "shortest_queue", "num_continuous_decode_steps": 4},
        "dp2_spec": {"dp_size": 2, **spec}})
    _check_same(results)
    _check_data_parallel(results["dp2"], kv_split=2)
    # speculative decoding on each rank: draft rows chained on the rank's recurrent state and scratch slots
    assert results["dp2_spec"]["speculative"]["verify_steps"] > 0
    # KV k/v, penalty counts/seen/last ids, SSM and conv state, and their prefix-cache snapshots.
    assert len(results["dp2"]["pool_specs"]) == 9


@pytest.mark.parametrize("kwargs,match", [
    ({"ep_size": 3, "tp_size": 4}, "ep_size=3 must divide"),
    ({"load_balance_method": "random"}, "round_robin, shortest_queue or cache_aware"),
])
def test_bad_parallel_sizes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)


class _HostRunner:
    """Stands in for ModelRunner (no device): checks that each rank's section of a step names only rows the
    scheduler runs on that rank and that rank's (local) pages; every sequence samples token 7."""

    def __init__(self, cfg):
        self.cfg, self.scheduler, self.on_step = cfg, None, None
        self.pools = MemoryPools(kv=None, penalty=None, recurrent=None)  # no recurrent state: prefix cache on

    def step(self, batch, shape):
        from runtime.batch import StepOutput

        dp, bs, k = self.cfg.dp_size, self.cfg.buckets.prefill_block_size, self.cfg.max_top_logprobs
        b, t = shape.prefill_blocks + shape.decode, shape.prefill_blocks * bs + shape.decode
        fwd = batch.forward
        assert fwd.input_ids.shape == (dp * t,) and batch.logits_indices.shape == (dp * b,)
        for rank in range(dp):
            rows = {r.row for r in self.scheduler.running if r.dp_rank == rank} | {0}
            slots = np.concatenate([fwd.prefill_slots.reshape(dp, -1)[rank],
                                    fwd.decode_slots.reshape(dp, -1)[rank]])
            assert set(slots.tolist()) <= rows, (rank, slots, rows)
        assert fwd.out_cache_loc.max() < self.cfg.num_pages * self.cfg.page_size  # local slot ids
        z = np.zeros
        return StepOutput(np.full(dp * b, 7, np.int32), z(dp * b, np.float32), z((dp * b, k), np.int32),
                          z((dp * b, k), np.float32), z(dp * t, np.float32), z((dp * t, k), np.int32),
                          z((dp * t, k), np.float32))


def _host_scheduler(method: str, num_pages: int = 9):
    from runtime.buckets import Buckets
    from runtime.runner import RunnerConfig
    from scheduler import Scheduler, SchedulerConfig

    buckets = Buckets.make(max_running_requests=3, chunked_prefill_size=16, prefill_block_size=4,
                           max_context_len=32, page_size=4)
    runner = _HostRunner(RunnerConfig(page_size=4, num_pages=num_pages, max_running_requests=3,
                                      buckets=buckets, vocab_size=16, max_top_logprobs=2, dp_size=2))
    cfg = SchedulerConfig(max_running_requests=3, chunked_prefill_size=16, max_context_len=32,
                          load_balance_method=method)
    sched = Scheduler(runner, cfg, eos_ids=frozenset())
    runner.scheduler = sched
    return sched


def _req(rid: str, prompt_len: int, max_new_tokens: int):
    from runtime.sampling_params import SamplingParams
    from scheduler import Req

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return Req(rid, list(range(1, prompt_len + 1)), params, seed=0)


def _drain(sched) -> None:
    for _ in range(200):
        if not sched.has_work():
            break
        sched.step()
        sched.check_integrity()
    assert not sched.has_work()
    assert sched.num_available_tokens == sched.capacity_tokens, "pages leaked"
    assert all(t.num_free_rows == t.max_requests for t in sched.rank_tables), "rows leaked"


@pytest.mark.parametrize("method,rank_of_d", [("round_robin", 1), ("shortest_queue", 0)])
def test_load_balance_policy_picks_the_rank(method, rank_of_d):
    """A, B, C go to ranks 0, 1, 0 under both policies; once A finishes each rank runs one request, so D
    goes to the rank in turn (1) under round_robin and to the lowest of the equally loaded ones (0) under
    shortest_queue."""
    sched = _host_scheduler(method)
    reqs = [_req("A", 3, 1), _req("B", 3, 8), _req("C", 3, 8)]
    for r in reqs:
        sched.add_request(r)
    sched.step()
    assert [r.dp_rank for r in reqs] == [0, 1, 0] and reqs[0].finished
    d = _req("D", 3, 4)
    sched.add_request(d)
    sched.step()
    assert d.dp_rank == rank_of_d
    _drain(sched)


@pytest.mark.parametrize("method,rank_of_c", [("shortest_queue", 0), ("cache_aware", 1)])
def test_cache_aware_sends_a_request_to_the_rank_holding_its_prefix(method, rank_of_c):
    """B (prompt P) runs and finishes on rank 1, so rank 1 caches P; then with ranks 0 and 1 equally busy
    (A and D), C (P and two more tokens) goes to the lowest rank under shortest_queue but to rank 1, where it
    finds P's two pages, under cache_aware."""
    sched = _host_scheduler(method)
    prompt_p = list(range(1, 9))
    a, b = _req("A", 5, 10), _req("B", 8, 1)
    a.prompt_ids, b.prompt_ids = [15, 14, 13, 12, 11], list(prompt_p)  # A shares nothing with P
    for r in (a, b):
        sched.add_request(r)
    sched.step()
    assert (a.dp_rank, b.dp_rank) == (0, 1) and b.finished
    d, c = _req("D", 3, 4), _req("C", 10, 2)
    c.prompt_ids = prompt_p + [9, 10]
    for r in (d, c):
        sched.add_request(r)
    sched.step()
    assert d.dp_rank == 1 and c.dp_rank == rank_of_c
    assert c.cached_tokens == (8 if method == "cache_aware" else 0)
    _drain(sched)


def test_data_parallel_ranks_retract_and_free_on_their_own():
    """Eight requests on two ranks of 8 pages each (every request outgrows its share): ranks run out of pages
    and retract independently; every step passes the per-rank checks and everything finishes and is freed."""
    sched = _host_scheduler("round_robin")
    reqs = [_req(str(i), n, 14) for i, n in enumerate((10, 3, 12, 5, 8, 6, 2, 9))]
    for r in reqs:
        sched.add_request(r)
    _drain(sched)
    assert all(len(r.output_ids) == 14 for r in reqs)
    assert sched.num_retractions > 0 and min(sched.num_admitted_per_rank) >= 4


def test_the_memory_plan_sees_one_devices_share_of_the_pools():
    """Under tensor parallelism the memory plan sizes the pools for one device: its KV heads and (delta-rule
    layers, `split_heads`) its recurrent-state heads, as `pool_specs` splits them; what does not divide, and
    an MLA latent or a Mamba state, stays whole."""
    import types

    from memory import CacheSpec, RecurrentSpec
    from runtime.mesh import per_device_cache_spec

    tp2 = types.SimpleNamespace(shape={"data": 1, "expert": 1, "tensor": 2})
    delta = CacheSpec(2, 4, 16, RecurrentSpec(3, (8, 16, 16), (96, 3), split_heads=True))
    one = per_device_cache_spec(tp2, delta)
    assert (one.num_kv_heads, one.recurrent.ssm_shape, one.recurrent.conv_shape) == (2, (4, 16, 16), (48, 3))
    assert one.kv_bytes_per_token("float32") * 2 == delta.kv_bytes_per_token("float32")
    assert one.recurrent.bytes_per_slot("float32") * 2 == delta.recurrent.bytes_per_slot("float32")
    mamba = CacheSpec(2, 3, 16, RecurrentSpec(3, (8, 16, 16), (96, 3)))  # 3 KV heads: not split over 2
    assert per_device_cache_spec(tp2, mamba) == mamba
    latent = CacheSpec(2, 1, 64, None, latent_kv=True)
    assert per_device_cache_spec(tp2, latent) == latent
    assert per_device_cache_spec(None, delta) == delta
