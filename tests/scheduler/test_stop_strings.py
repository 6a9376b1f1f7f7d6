"""Stop strings on the real model: the text ends right before the stop string, which is reported."""

from __future__ import annotations

import pytest

# The session's SmolLM2 engine (~10 s to start) and 48-token generations.
pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Write three short sentences about the sea."}]


def test_stop_string_is_honoured_and_trimmed(smollm2_engine):
    base = smollm2_engine.chat(CHAT, sampling_params={"temperature": 0, "max_new_tokens": 48})
    text = base["text"]
    words = text.split()
    assert len(words) > 6, text
    stop = " " + words[4]  # a stop string that greedy decoding reaches after a few tokens
    out = smollm2_engine.chat(CHAT, sampling_params={"temperature": 0, "max_new_tokens": 48,
                                                     "stop": [stop, "zzzz"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    assert out["meta_info"]["completion_tokens"] < base["meta_info"]["completion_tokens"]
    smollm2_engine.scheduler.check_integrity()


def test_stop_token_ids_and_eos(smollm2_engine):
    base = smollm2_engine.chat(CHAT, sampling_params={"temperature": 0, "max_new_tokens": 48})
    third = base["output_ids"][2]
    out = smollm2_engine.chat(CHAT, sampling_params={"temperature": 0, "max_new_tokens": 48,
                                                     "stop_token_ids": [third]})
    assert out["output_ids"][-1] == third
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
