"""`--kv-cache-dtype bfloat16` under a float32 model: the KV (or MLA latent) pool holds bf16, twice the tokens
in the same memory, and attention (native kernels and references alike) widens what it reads to float32.
Checked against the same engine with a float32 cache on tiny random models: the only difference is the bf16
rounding of each cached key and value, so the logprobs drift by a bounded amount and greedy tokens mostly
agree."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serve.server_args import ServerArgs
from tests.helpers import assert_idle_and_consistent, greedy, random_prompts


def _save(tmp_path, family: str) -> None:
    if family == "qwen3":
        from tests.models.test_hf_parity import CASES, save_checkpoint

        save_checkpoint(str(tmp_path), CASES["qwen3_qk_norm_head_dim"])
    else:
        from tests.models.test_deepseek_parity import CASES, save_checkpoint

        save_checkpoint(str(tmp_path), CASES["lora_yarn_grouped"])


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
@pytest.mark.slow
def test_bf16_cache_drifts_by_its_rounding_only(tmp_path, family, capsys):
    from serve import Engine

    _save(tmp_path, family)
    prompts = random_prompts(3, 200, [37, 5, 70])  # tokens past a 32-token prefill chunk: cached keys read
    results, pools = {}, {}
    for kv in ("float32", "bfloat16"):
        engine = Engine(model=str(tmp_path), in_process=True, dtype="float32", kv_cache_dtype=kv,
                        max_running_requests=3, chunked_prefill_size=32, context_length=128, page_size=16,
                        skip_tokenizer_init=True, max_total_tokens=1024)
        try:
            results[kv] = engine.generate(input_ids=prompts, sampling_params=greedy(12), return_logprob=True,
                                          logprob_start_len=0)
            k = engine.runner.pools.kv.k
            pools[kv] = (k.dtype, k.nbytes)
            # The pool is written and read in place: no program copies the whole of it, and where attention
            # reads it natively (qwen3) none converts it either (XLA:CPU runs a bf16 scatter by converting
            # the pool to f32 and back; the native write_rows does not). MLA's reference gathers through a
            # fusion whose text shows a pool-sized convert of its operand, computed only where gathered.
            dims = ",".join(map(str, k.shape))
            programs = [c.as_text() for key, c in engine.runner._compiled.items() if key[0] == "step"]
            assert programs
            if jax.default_backend() == "cpu":  # the native pool write is a CPU kernel
                assert all("xlaserve_cpu_write_rows" in hlo for hlo in programs)
            ops = "copy|convert" if family == "qwen3" else "copy"
            for hlo in programs:
                assert not re.search(rf"= (f32|bf16)\[{dims}\]\S* ({ops})\(", hlo), kv
            assert_idle_and_consistent(engine)
        finally:
            engine.shutdown()
    assert pools["float32"][0] == jnp.float32 and pools["bfloat16"][0] == jnp.bfloat16
    assert pools["bfloat16"][1] * 2 == pools["float32"][1]  # the same tokens in half the bytes
    assert "KV cache in bfloat16" in capsys.readouterr().err
    prompt_drift, same_tokens, total = [], 0, 0
    for f, b in zip(results["float32"], results["bfloat16"]):
        lf = np.array([lp for lp, _ in f["meta_info"]["input_token_logprobs"][1:]])
        lb = np.array([lp for lp, _ in b["meta_info"]["input_token_logprobs"][1:]])
        prompt_drift.append(np.abs(lf - lb))
        tf, tb = f["output_ids"], b["output_ids"]
        common = next((i for i, (x, y) in enumerate(zip(tf, tb)) if x != y), len(tf))
        same_tokens += common
        total += len(tf)
        # while the tokens agree, their logprobs differ by the rounding only
        of = np.array([lp for lp, _ in f["meta_info"]["output_token_logprobs"][:common]])
        ob = np.array([lp for lp, _ in b["meta_info"]["output_token_logprobs"][:common]])
        np.testing.assert_allclose(ob, of, atol=0.05)
    drift = np.concatenate(prompt_drift)
    # bf16 keeps 8 bits of each cached number: a relative error of at most 2^-9 per key and value. Measured:
    # qwen3 max 0.03; the random DeepSeek-V3 (YaRN-scaled MLA scores) mean 0.019 but 1.47 at one of 108
    # positions, whose softmax is that sensitive (the same with any chunk size, so not a boundary effect).
    assert drift.max() > 0 and drift.mean() < 0.03 and np.quantile(drift, 0.95) < 0.1, (
        drift.max(), drift.mean(), np.quantile(drift, 0.95))
    assert same_tokens >= 0.8 * total, (same_tokens, total)


def test_kv_cache_dtype_is_checked_at_startup():
    for choice in ("auto", "float32", "bfloat16"):
        ServerArgs(kv_cache_dtype=choice)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' must be auto, float32 or bfloat16"):
        ServerArgs(kv_cache_dtype="fp8")
