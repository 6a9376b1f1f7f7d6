"""Reference answers from Hugging Face transformers (torch, fp32) and the parity checks against them."""

from __future__ import annotations

import numpy as np
import torch

from tests.helpers import LOGPROB_ATOL, MIN_GREEDY_GAP, greedy


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int, cache: str = "past_key_values") -> list[int]:
    """Greedy continuation with HF's cache (`cache`: the output field and forward argument that carry it);
    no eos check, so exactly `num_tokens` come back."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    while True:
        tokens.append(int(out.logits[0, -1].argmax()))
        if len(tokens) == num_tokens:
            return tokens
        out = model(torch.tensor([[tokens[-1]]]), **{cache: getattr(out, cache)}, use_cache=True)


@torch.no_grad()
def hf_greedy_with_positions(model, prompt: list[int], num_tokens: int) -> list[int]:
    """`hf_greedy` passing positions: Bamba's forward otherwise restarts RoPE at 0 each step."""
    out = model(torch.tensor([prompt]), position_ids=torch.arange(len(prompt))[None], use_cache=True)
    tokens: list[int] = []
    while True:
        tokens.append(int(out.logits[0, -1].argmax()))
        if len(tokens) == num_tokens:
            return tokens
        pos = torch.tensor([[len(prompt) + len(tokens) - 1]])
        out = model(
            torch.tensor([[tokens[-1]]]),
            position_ids=pos,
            past_key_values=out.past_key_values,
            use_cache=True,
        )


def hf_greedy_recurrent(model, prompt: list[int], num_tokens: int) -> list[int]:
    """`hf_greedy` through a Mamba model's recurrent cache (`cache_params`: its one-token decode path)."""
    return hf_greedy(model, prompt, num_tokens, cache="cache_params")


@torch.no_grad()
def hf_greedy_recomputed(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy without a cache: the whole sequence again for each token (where HF's cache is its own API, or
    its cached path differs from its prefill)."""
    tokens: list[int] = []
    while len(tokens) < num_tokens:
        out = model(torch.tensor([prompt + tokens]), use_cache=False)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@torch.no_grad()
def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """f32[len(ids), vocab]: row i is log p(. | ids[:i+1]) from one forward pass over `ids`."""
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


@torch.no_grad()
def hf_router_scores(model, ids: list[int]) -> np.ndarray:
    """f32[sparse layers, len(ids), experts]: a sparse MoE model's router softmax scores."""
    logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    return np.stack([torch.softmax(r.float(), dim=-1).numpy() for r in logits])


def serve_and_compare(path: str, hf_model, prompts: list[list[int]], engine_args: dict, num_new_tokens: int,
                      hf_greedy_fn=None, inspect=None) -> dict:
    """Our Engine's greedy run over `prompts` batched (prompt and output logprobs, top 5), HF's greedy tokens
    for each prompt (`hf_greedy_fn(model, prompt, n)`, default `hf_greedy`), and HF's logprobs teacher-forced
    on our tokens (comparable even if the greedy paths were to part): {"path", "prompts", "outs", "hf_tokens",
    "hf_lps", "inspected"}, the last `inspect(engine)` after the run (None without `inspect`)."""
    from serve import Engine

    engine = Engine(model=path, **engine_args)
    try:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params=greedy(num_new_tokens),
            return_logprob=True, logprob_start_len=0, top_logprobs_num=5,
        )
        inspected = inspect(engine) if inspect else None
    finally:
        engine.shutdown()
    hf_greedy_fn = hf_greedy_fn or hf_greedy
    return {
        "path": path, "prompts": prompts, "outs": outs,
        "hf_tokens": [hf_greedy_fn(hf_model, p, num_new_tokens) for p in prompts],
        "hf_lps": [hf_logprobs(hf_model, p + o["output_ids"]) for p, o in zip(prompts, outs, strict=True)],
        "inspected": inspected,
    }


def serve_case(tmp_path_factory, name: str, save, prompts: list[list[int]], engine_args: dict,
               num_new_tokens: int, **compare_kwargs) -> dict:
    """A parity module's `run` fixture: `save(path)` writes the case's checkpoint to a fresh directory and
    returns the HF model; then `serve_and_compare` on it. Its dict, plus "name" and "hf_model"."""
    path = str(tmp_path_factory.mktemp(name))
    hf_model = save(path)
    res = serve_and_compare(path, hf_model, prompts, engine_args, num_new_tokens, **compare_kwargs)
    return {"name": name, "hf_model": hf_model, **res}


def check_top(ours: list[tuple[float, int]], hf_row: np.ndarray, where: str,
              atol: float = LOGPROB_ATOL) -> None:
    """Our top logprobs (logprob, id) equal HF's row: same ids in order, logprobs within `atol`."""
    k = len(ours)
    top_ids = np.argsort(-hf_row, kind="stable")[:k]
    assert [t for _, t in ours] == top_ids.tolist(), where
    np.testing.assert_allclose([lp for lp, _ in ours], hf_row[top_ids], atol=atol, rtol=0, err_msg=where)


def check_prompt_logprobs(where: str, prompt: list[int], out: dict, lps: np.ndarray,
                          atol: float = LOGPROB_ATOL) -> None:
    """Our prompt logprobs (from logprob_start_len=0) and top-k equal HF's `lps` (hf_logprobs of the
    sequence)."""
    meta = out["meta_info"]
    got = meta["input_token_logprobs"]
    assert [t for _, t in got] == prompt and got[0][0] is None, where
    expected = [lps[i - 1, prompt[i]] for i in range(1, len(prompt))]
    np.testing.assert_allclose([lp for lp, _ in got[1:]], expected, atol=atol, rtol=0,
                               err_msg=f"{where}: prompt of {len(prompt)}")
    assert meta["input_top_logprobs"][0] is None, where
    for i in range(1, len(prompt)):
        check_top(meta["input_top_logprobs"][i], lps[i - 1], f"{where}: prompt position {i}", atol)


def check_greedy_tokens(where: str, out: dict, hf_tokens: list[int]) -> None:
    assert out["output_ids"] == hf_tokens, where
    # Random weights that collapse to one repeated token would make this comparison weak.
    assert len(set(hf_tokens)) >= 4, f"{where}: degenerate model {hf_tokens}"


def check_output_logprobs(where: str, prompt: list[int], out: dict, lps: np.ndarray,
                          atol: float = LOGPROB_ATOL) -> None:
    """Output logprobs and top-k equal HF's teacher-forced `lps` over prompt + our output."""
    meta = out["meta_info"]
    got = meta["output_token_logprobs"]
    assert [t for _, t in got] == out["output_ids"], where
    rows = [len(prompt) - 1 + j for j in range(len(got))]
    expected = [lps[r, t] for r, t in zip(rows, out["output_ids"])]
    np.testing.assert_allclose([lp for lp, _ in got], expected, atol=atol, rtol=0,
                               err_msg=f"{where}: prompt of {len(prompt)}")
    for j, r in enumerate(rows):
        check_top(meta["output_top_logprobs"][j], lps[r], f"{where}: output {j}", atol)


def parity_tests(atol: float, num_new_tokens: int):
    """The three parity tests of a module whose `run` fixture gives `serve_and_compare`'s dict plus "name":
    prompt logprobs (and top-k), greedy tokens, output logprobs (and top-k) against HF. Assign them to
    module-level `test_*` names so pytest collects them."""

    def test_prompt_logprobs_match_hf(run) -> None:
        for prompt, out, lps in zip(run["prompts"], run["outs"], run["hf_lps"]):
            check_prompt_logprobs(run["name"], prompt, out, lps, atol)

    def test_greedy_tokens_match_hf(run) -> None:
        for prompt, out, hf_tokens in zip(run["prompts"], run["outs"], run["hf_tokens"]):
            check_greedy_tokens(f"{run['name']} prompt of {len(prompt)}", out, hf_tokens)

    def test_output_logprobs_match_hf(run) -> None:
        for prompt, out, lps in zip(run["prompts"], run["outs"], run["hf_lps"]):
            assert len(out["output_ids"]) == num_new_tokens
            check_output_logprobs(run["name"], prompt, out, lps, atol)

    return test_prompt_logprobs_match_hf, test_greedy_tokens_match_hf, test_output_logprobs_match_hf


def check_no_near_tie(where: str, prompt: list[int], lps: np.ndarray,
                      min_gap: float = MIN_GREEDY_GAP) -> None:
    """Every greedy step's top-2 gap is far above a correct fp32 run's ~1e-5 error: otherwise "tokens
    identical" would hinge on rounding order, not on correctness (pick another seed)."""
    top2 = np.sort(lps[len(prompt) - 1 : -1], axis=-1)[:, -2:]
    gap = (top2[:, 1] - top2[:, 0]).min()
    assert gap > min_gap, f"{where}: a greedy step is a near-tie ({gap=:.2g}); pick another seed"


def check_no_near_ties_and_lengths(run: dict, num_new_tokens: int) -> None:
    """`check_no_near_tie` for each prompt of `run` (`serve_and_compare`'s dict plus "name"), and each output
    counts its prompt's tokens and `num_new_tokens` completion tokens."""
    for out, prompt, lps in zip(run["outs"], run["prompts"], run["hf_lps"], strict=True):
        check_no_near_tie(run["name"], prompt, lps)
        meta = out["meta_info"]
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), num_new_tokens)
