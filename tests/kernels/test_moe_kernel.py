"""Dropless top-k MoE reference vs a dense per-token loop in numpy, and a hand-computed tiny case."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.moe import moe_ffn, route


def _silu(z):
    return z / (1.0 + np.exp(-z))


def _dense_loop(x, logits, w_gate_up, w_down, *, top_k, scoring, normalize_topk):
    """Each token on its own: scores, its top-k experts, their FFNs, the weighted sum (float64)."""
    f = w_down.shape[1]
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        z = logits[t].astype(np.float64)
        scores = (
            np.exp(z - z.max()) / np.exp(z - z.max()).sum() if scoring == "softmax" else 1 / (1 + np.exp(-z))
        )
        chosen = np.argsort(-scores, kind="stable")[:top_k]
        weights = scores[chosen] / (scores[chosen].sum() if normalize_topk else 1.0)
        for e, w in zip(chosen, weights):
            gate_up = x[t] @ w_gate_up[e]
            out[t] += w * ((_silu(gate_up[:f]) * gate_up[f:]) @ w_down[e])
    return out


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("normalize_topk", [True, False])
def test_matches_dense_loop_with_an_idle_expert(top_k: int, scoring: str, normalize_topk: bool) -> None:
    rng = np.random.default_rng(top_k)
    t, d, f, e = 13, 8, 6, 5
    x = rng.normal(size=(t, d)).astype(np.float32)
    logits = (2.0 * rng.normal(size=(t, e))).astype(np.float32)
    logits[:, 1] = -30.0  # expert 1, in the middle of the groups, receives no token
    w_gate_up = rng.normal(size=(e, d, 2 * f)).astype(np.float32)
    w_down = rng.normal(size=(e, f, d)).astype(np.float32)
    kwargs = dict(top_k=top_k, scoring=scoring, normalize_topk=normalize_topk)

    _, experts = route(jnp.asarray(logits), top_k=top_k, scoring=scoring, normalize_topk=normalize_topk)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=e)
    assert counts[1] == 0 and (np.delete(counts, 1) > 0).all(), counts  # the case covers what it claims

    got = jax.jit(lambda *a: moe_ffn(*a, **kwargs))(x, logits, w_gate_up, w_down)
    assert got.dtype == jnp.float32 and got.shape == (t, d)
    np.testing.assert_allclose(
        np.asarray(got), _dense_loop(x, logits, w_gate_up, w_down, **kwargs), rtol=1e-5, atol=1e-5
    )


def test_hand_computed_top2_normalized() -> None:
    # D=2, F=1, E=3: w_gate_up[e][i] = (gate, up) weights of input channel i; w_down[e] = the output row.
    w_gate_up = np.array([[[5, 5], [1, 1]], [[2, 0.5], [0, 0]], [[1, 3], [-1, 2]]], np.float32)
    w_down = np.array([[[9, 9]], [[1, -1]], [[0, 2]]], np.float32)
    x = np.array([[1, 0], [0, 1]], np.float32)
    # Token 0 scores (0.1, 0.3, 0.6): experts 2, 1 renormalized to 2/3, 1/3.
    # Token 1 scores (0.5, 0.2, 0.3): experts 0, 2 renormalized to 5/8, 3/8.
    logits = np.log(np.array([[0.1, 0.3, 0.6], [0.5, 0.2, 0.3]], np.float32))
    s1, s2, sm1 = _silu(1.0), _silu(2.0), _silu(-1.0)
    expected = np.array(
        [
            [s2 / 6, -s2 / 6 + 4 * s1],  # 1/3 * silu(2) * 0.5 * (1, -1) + 2/3 * silu(1) * 3 * (0, 2)
            [
                45 / 8 * s1,
                45 / 8 * s1 + 1.5 * sm1,
            ],  # 5/8 * silu(1) * 1 * (9, 9) + 3/8 * silu(-1) * 2 * (0, 2)
        ]
    )
    got = moe_ffn(x, logits, w_gate_up, w_down, top_k=2, normalize_topk=True)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)


def test_bfloat16_weights_accumulate_in_float32() -> None:
    rng = np.random.default_rng(3)
    t, d, f, e = 16, 32, 16, 4
    x = rng.normal(size=(t, d)).astype(np.float32)
    logits = rng.normal(size=(t, e)).astype(np.float32)
    w_gate_up = (rng.normal(size=(e, d, 2 * f)) / np.sqrt(d)).astype(np.float32)
    w_down = (rng.normal(size=(e, f, d)) / np.sqrt(f)).astype(np.float32)
    kwargs = dict(top_k=2, normalize_topk=True)
    exact = moe_ffn(x, logits, w_gate_up, w_down, **kwargs)
    bf16 = [jnp.asarray(a, jnp.bfloat16) for a in (x, w_gate_up, w_down)]
    got = moe_ffn(bf16[0], logits, bf16[1], bf16[2], **kwargs)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(exact), atol=3e-2, rtol=0)


def _grouped_choice(scores, bias, num_groups, topk_groups, top_k):
    """DeepSeek-V3's noaux_tc choice for one token, written as a loop over groups (float64)."""
    choice = scores + bias
    size = len(scores) // num_groups
    group_scores = [np.sort(choice[g * size : (g + 1) * size])[-2:].sum() for g in range(num_groups)]
    groups = np.argsort(-np.array(group_scores), kind="stable")[:topk_groups]
    allowed = [e for e in range(len(scores)) if e // size in groups]
    return sorted(allowed, key=lambda e: -choice[e])[:top_k]


def test_grouped_biased_sigmoid_routing_matches_a_loop() -> None:
    rng = np.random.default_rng(5)
    t, d, f, e, groups, topk_groups, top_k, scale = 17, 8, 6, 8, 4, 2, 3, 2.5
    x = rng.normal(size=(t, d)).astype(np.float32)
    logits = (2.0 * rng.normal(size=(t, e))).astype(np.float32)
    bias = (0.5 * rng.normal(size=e)).astype(np.float32)
    w_gate_up = rng.normal(size=(e, d, 2 * f)).astype(np.float32)
    w_down = rng.normal(size=(e, f, d)).astype(np.float32)
    routing = dict(scoring="sigmoid", normalize_topk=True, correction_bias=jnp.asarray(bias),
                   num_groups=groups, topk_groups=topk_groups, routed_scaling_factor=scale)

    weights, experts = route(jnp.asarray(logits), top_k=top_k, **routing)
    expected = np.zeros((t, d))
    differs = 0
    for i in range(t):
        scores = 1 / (1 + np.exp(-logits[i].astype(np.float64)))
        chosen = _grouped_choice(scores, bias, groups, topk_groups, top_k)
        differs += set(chosen) != set(np.argsort(-scores)[:top_k])  # bias and groups change the choice
        assert set(np.asarray(experts[i]).tolist()) == set(chosen)
        w = scores[chosen] / scores[chosen].sum() * scale
        np.testing.assert_allclose(np.sort(np.asarray(weights[i])), np.sort(w), rtol=1e-5)
        for ex, wt in zip(chosen, w):
            gate_up = x[i] @ w_gate_up[ex]
            expected[i] += wt * ((_silu(gate_up[:f]) * gate_up[f:]) @ w_down[ex])
    assert differs >= 3, differs
    got = moe_ffn(x, logits, w_gate_up, w_down, top_k=top_k, **routing)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_few_tokens_gather_their_experts_and_match_the_loop(num_tokens: int) -> None:
    # T * k <= E: on CPU the grouped matmul gathers each row's expert weights instead of a ragged_dot.
    rng = np.random.default_rng(num_tokens)
    d, f, e = 8, 6, 8
    x = rng.normal(size=(num_tokens, d)).astype(np.float32)
    logits = (2.0 * rng.normal(size=(num_tokens, e))).astype(np.float32)
    w_gate_up = rng.normal(size=(e, d, 2 * f)).astype(np.float32)
    w_down = rng.normal(size=(e, f, d)).astype(np.float32)
    kwargs = dict(top_k=2, scoring="softmax", normalize_topk=True)
    got = jax.jit(lambda *a: moe_ffn(*a, **kwargs))(x, logits, w_gate_up, w_down)
    np.testing.assert_allclose(
        np.asarray(got), _dense_loop(x, logits, w_gate_up, w_down, **kwargs), rtol=1e-5, atol=1e-5
    )
