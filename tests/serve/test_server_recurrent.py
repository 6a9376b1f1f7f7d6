"""A Mamba-2 model served through the OpenAI API: greedy completions (plain, streamed) match transformers."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.hf_reference import hf_greedy_recomputed
from tests.live_server import LiveServer
from tests.tiny_models import save_tiny_mamba2, write_word_tokenizer

# A server of its own (10-20 s to start).
pytestmark = [pytest.mark.server, pytest.mark.slow]

VOCAB = 512


@pytest.fixture(scope="module")
def mamba_server(tmp_path_factory):
    path = save_tiny_mamba2(str(tmp_path_factory.mktemp("served_mamba2")))
    write_word_tokenizer(path, VOCAB)
    srv = LiveServer.start("--model", path, "--max-running-requests", "4", "--context-length", "256",
                           "--chunked-prefill-size", "64", "--served-model-name", "tiny-mamba2")
    yield srv, path
    srv.stop()


def _hf_greedy_text(path: str, prompt_ids: list[int], n: int) -> str:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return " ".join(f"t{i}" for i in hf_greedy_recomputed(model, prompt_ids, n))


def test_completions_match_hf_and_stream_the_same(mamba_server):
    srv, path = mamba_server
    prompt_ids = [7, 300, 41, 9, 123, 77, 5, 250, 18, 64, 33, 200, 11, 90, 150, 3, 44, 60, 8]
    prompt = " ".join(f"t{i}" for i in prompt_ids)
    client = srv.client()
    out = client.completions.create(model="tiny-mamba2", prompt=prompt, max_tokens=12, temperature=0)
    expected = _hf_greedy_text(path, prompt_ids, 12)
    assert out.choices[0].text.split() == expected.split()
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 12
    assert out.choices[0].finish_reason == "length"
    stream = client.completions.create(model="tiny-mamba2", prompt=prompt, max_tokens=12, temperature=0,
                                       stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert streamed.split() == expected.split()
    info = srv.wait_idle()
    assert info["recurrent_state_slots"] == 4
