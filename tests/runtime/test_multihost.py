"""Multi-host serving on one machine: two processes with one CPU device each, joined by `jax.distributed`
(gloo collectives), serve through node 0's HTTP endpoint (tp_size=2, or dp_size=2) while node 1 replays
every step; greedy requests give the same tokens and prompt logprobs (within 1e-4) as a single process."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from serve.server_args import ServerArgs
from tests.helpers import LOGPROB_ATOL, REPO, greedy, random_prompts
from tests.live_server import LiveServer

# Both nodes get the same flags (the leader checks that they planned the same programs).
FLAGS = ("--dtype", "float32", "--max-running-requests", "2", "--chunked-prefill-size", "32",
         "--prefill-block-size", "16", "--context-length", "256", "--max-total-tokens", "1024",
         "--page-size", "16")
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
SAMPLING = greedy(16)


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (the coordinator and the step channel)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from tests.models.test_hf_parity import CASES, save_checkpoint

    path = str(tmp_path_factory.mktemp("qwen2_multihost"))
    save_checkpoint(path, CASES["qwen2_tied_bias"])  # 4 heads, 2 KV heads: both split over the two nodes
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(0, 300, (37, 21))  # several prefill blocks each


@pytest.fixture(scope="module")
def single_process(model_path, prompts) -> list[dict]:
    from serve import Engine

    engine = Engine(model=model_path, in_process=True, dtype="float32", max_running_requests=2,
                    chunked_prefill_size=32, prefill_block_size=16, context_length=256, max_total_tokens=1024,
                    page_size=16)
    try:
        return engine.generate(input_ids=prompts, sampling_params=SAMPLING, return_logprob=True,
                               logprob_start_len=0)
    finally:
        engine.shutdown()


def _serve_on_two_nodes(model_path: str, parallel: tuple[str, ...], prompts) -> tuple[list[dict], dict, str]:
    """Starts node 1 (follower) and node 0 (HTTP server), sends one batched /generate to node 0, stops both;
    returns (results, node 0's server info, node 1's log). Both processes are gone when it returns."""
    port = _free_port_pair()
    flags = ("--model", model_path, *FLAGS, *parallel, "--nnodes", "2",
             "--dist-init-addr", f"127.0.0.1:{port}")
    fd, follower_log = tempfile.mkstemp(prefix="xlaserve-follower-", suffix=".log")
    follower = subprocess.Popen([sys.executable, "-m", "serve", "serve", *flags, "--node-rank", "1"],
                                cwd=REPO, env={**os.environ, **ENV}, stdout=fd, stderr=subprocess.STDOUT)
    os.close(fd)
    try:
        leader = LiveServer.start(*flags, "--node-rank", "0", env=ENV)
        try:
            body = {"input_ids": prompts, "sampling_params": SAMPLING, "return_logprob": True,
                    "logprob_start_len": 0}
            r = leader.post("/generate", body, timeout=60)
            assert r.status_code == 200, r.text
            info = leader.info()
        finally:
            leader.stop()  # node 0 tells node 1 to stop on its way out
        follower.wait(timeout=30)
        with open(follower_log, errors="replace") as f:
            log = f.read()
        assert follower.returncode == 0, log[-4000:]
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    os.remove(follower_log)
    return r.json(), info, log


@pytest.mark.parametrize("parallel", [("--tp-size", "2"), ("--dp-size", "2")], ids=["tp2", "dp2"])
@pytest.mark.server
@pytest.mark.slow
def test_two_nodes_serve_like_one_process(model_path, prompts, single_process, parallel):
    """tp2: every weight and the KV heads split over the two hosts. dp2: round robin puts the second request
    on rank 1, whose pages and rows live on node 1's device; its tokens come back through node 0."""
    outs, info, log = _serve_on_two_nodes(model_path, parallel, prompts)
    steps = re.search(r"node 0 stopped after (\d+) steps", log)
    assert steps and int(steps.group(1)) >= 2, log[-4000:]  # node 1 really ran the prefill and decode steps
    assert info["device"].endswith("x2") and info["compiles_after_warmup"] == 0, info
    # Node 1 read only its own devices' shards from the checkpoint: half of every split weight (tp2), or
    # everything (dp2: weights replicated on every rank).
    read = re.search(r"read ([\d.]+) MiB of the checkpoint's ([\d.]+) MiB", log)
    assert read, log[-4000:]
    ratio = float(read.group(1)) / float(read.group(2))
    assert (ratio < 0.6) if parallel[0] == "--tp-size" else (ratio == 1.0), read.group(0)
    if parallel[0] == "--dp-size":
        assert info["num_admitted_per_rank"] == [1, 1], info
    for out, ref, prompt in zip(outs, single_process, prompts):
        assert out["output_ids"] == ref["output_ids"]
        ours = [lp[0] for lp in out["meta_info"]["input_token_logprobs"][1:]]
        theirs = [lp[0] for lp in ref["meta_info"]["input_token_logprobs"][1:]]
        assert len(ours) == len(prompt) - 1
        np.testing.assert_allclose(ours, theirs, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("kwargs,match", [
    ({"nnodes": 2}, "nnodes=2 needs dist_init_addr"),
    ({"nnodes": 2, "dist_init_addr": "10.0.0.1"}, "must be HOST:PORT"),
    ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "10.0.0.1:5000"}, r"node_rank=2 in \[0, nnodes\)"),
])
def test_bad_multi_host_flags_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)
