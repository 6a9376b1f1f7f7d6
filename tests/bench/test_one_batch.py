"""bench.one_batch on a tiny model: the synchronous decode steps, then the same steps as the overlap schedule
runs them (placeholders for the tokens in flight), which must sample the same tokens (it raises if not)."""

from __future__ import annotations

import json

import pytest

from bench import one_batch
from tests.tiny_models import save_tiny_llama


@pytest.mark.slow
def test_one_batch_reports_synchronous_and_overlapped_steps(tmp_path):
    path = save_tiny_llama(str(tmp_path / "llama"))
    out = tmp_path / "one_batch.jsonl"
    one_batch.main(["--model", path, "--batch-sizes", "1,3", "--input-len", "20", "--output-len", "6",
                    "--output-file", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["decode_step_ms_median"] > 0 and r["overlap_step_ms_median"] > 0
        assert r["overlap_tok_s"] == pytest.approx(r["batch"] / r["overlap_step_ms_median"] * 1e3)
        assert r["overlap_x_bw_roofline"] > 0


@pytest.mark.slow
def test_overlapped_steps_that_sample_other_tokens_are_caught(tmp_path, monkeypatch):
    """A placeholder that pointed at the wrong row would feed another request's token: the run refuses."""
    path = save_tiny_llama(str(tmp_path / "llama"))
    real = one_batch.decode_works

    def wrong_rows(rows, tokens, pos, input_len):
        if tokens.min() < 0:  # placeholders: each row's points at the next row's token
            tokens = tokens[::-1].copy()
        return real(rows, tokens, pos, input_len)

    monkeypatch.setattr(one_batch, "decode_works", wrong_rows)
    with pytest.raises(RuntimeError, match="other tokens"):
        one_batch.main(["--model", path, "--batch-sizes", "3", "--input-len", "20", "--output-len", "6"])
