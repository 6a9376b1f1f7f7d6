"""bench.quant_accuracy: the fixed text, the agreement measures, and a whole run on a tiny random Llama with
the default model's tokenizer."""

from __future__ import annotations

import json
import math

import pytest

from bench import quant_accuracy as qa
from bench.random_checkpoint import write_checkpoint
from serve.tokenizer import load_tokenizer, tokenizer_dir


def test_agreement_and_perplexity():
    assert qa.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert qa.common_prefix([], [1]) == 0
    same, frac = qa.agreement([[1, 2, 3, 4], [5, 6], [7]], [[1, 2, 3, 4], [5, 9, 9, 9], [8]])
    assert same == 1 and frac == pytest.approx((1 + 1 / 4 + 0) / 3)
    assert qa.agreement([[1, 2]], [[1, 2, 3]]) == (0, pytest.approx(2 / 3))  # one went on: not identical
    assert qa.perplexity([math.log(0.5)] * 3) == pytest.approx(2.0)


def test_fixed_text_is_exactly_the_asked_tokens_and_the_same_every_time(smollm2_gguf, cache_dir):
    tok = load_tokenizer(smollm2_gguf, cache_dir)
    ids, used, total = qa.fixed_text_ids(tok, 4096)
    assert len(ids) == 4096 and 1 < used < total
    assert qa.fixed_text_ids(tok, 4096)[0] == ids
    assert qa.fixed_text_ids(tok, 100)[0] == ids[:100]  # the same text, cut shorter
    chats = qa.chat_prompt_ids(tok, qa.CHAT_PROMPTS)
    assert len(chats) == 20 == len(set(map(tuple, chats)))
    assert tok.decode(chats[0], skip_special_tokens=False).rstrip().endswith("assistant")


@pytest.mark.slow
def test_a_tiny_model_runs_every_kind_of_mode(tmp_path, smollm2_gguf, cache_dir, capsys):
    """fp32, int4 (requantized) and q4_1 (`auto`, which on a safetensors checkpoint quantizes nothing, so it
    must equal fp32 exactly) on a 2-layer Llama: one JSON row each and the Markdown table."""
    shape = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 initializer_range=0.2, tie_word_embeddings=True)
    path = write_checkpoint(str(tmp_path / "model"), shape, tokenizer_dir(smollm2_gguf, cache_dir))
    out = tmp_path / "rows.jsonl"
    qa.main(["--model", path, "--modes", "fp32,int4,q4_1", "--tokens", "64", "--new-tokens", "4",
             "--num-prompts", "3", "--output-file", str(out)])
    rows = {r["mode"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == ["fp32", "int4", "q4_1"]
    assert all(r["scored_tokens"] == 63 and r["num_prompts"] == 3 for r in rows.values())
    assert "delta_ppl" not in rows["fp32"] and math.isfinite(rows["fp32"]["perplexity"])
    q = rows["q4_1"]
    assert q["delta_ppl"] == 0 and q["mean_abs_dlogprob"] == 0 and q["greedy_identical"] == 3
    assert q["prefix_fraction"] == 1 and q["weight_mib"] == rows["fp32"]["weight_mib"]
    int4 = rows["int4"]
    assert int4["mean_abs_dlogprob"] > 0 and int4["weight_mib"] < rows["fp32"]["weight_mib"] / 4
    printed = capsys.readouterr().out
    assert "| q4_1 | `--dtype float32 --quantization auto` |" in printed
    assert "command: python -m bench.quant_accuracy --model" in printed
