"""Plain-jnp dropless top-k mixture of experts: route, sort by expert, grouped matmuls, weighted combine."""

from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def route(
    router_logits: jax.Array,  # f32[T, E]
    *,
    top_k: int,
    scoring: str = "softmax",
    normalize_topk: bool,
) -> tuple[jax.Array, jax.Array]:
    """Each token's `top_k` experts by score: (weights f32[T, k], experts i32[T, k]), best first.

    Scores are softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3 style) of the logits in float32;
    `normalize_topk` rescales the chosen weights to sum to one (Mixtral always, Qwen `norm_topk_prob`).
    """
    logits = router_logits.astype(jnp.float32)
    if scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"unknown {scoring=}; known: softmax, sigmoid")
    weights, experts = jax.lax.top_k(scores, top_k)
    if normalize_topk:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, experts


def moe_ffn(
    x: jax.Array,  # f[T, D]
    router_logits: jax.Array,  # f32[T, E]
    w_gate_up: jax.Array,  # f[E, D, 2F]: each expert's gate then up projection
    w_down: jax.Array,  # f[E, F, D]
    *,
    top_k: int,
    scoring: str = "softmax",
    normalize_topk: bool,
    act: str = "silu",
) -> jax.Array:
    """sum over each token's chosen experts e of weight_e * down_e(act(gate_e(x)) * up_e(x)); f32[T, D].

    Dropless: every (token, expert) assignment is computed, whatever the load (no capacity factor), and
    an expert that no token chose costs nothing but its empty group. Matmuls run in the weights' dtype
    with float32 accumulation; the combine is float32.
    """
    num_tokens, hidden = x.shape
    num_experts, _, two_f = w_gate_up.shape
    if router_logits.shape != (num_tokens, num_experts):
        raise ValueError(f"router_logits shape {router_logits.shape} != ({num_tokens}, {num_experts})")
    if w_down.shape != (num_experts, two_f // 2, hidden):
        raise ValueError(f"w_down shape {w_down.shape} != ({num_experts}, {two_f // 2}, {hidden})")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{top_k=} must be in [1, {num_experts=}]")
    weights, experts = route(router_logits, top_k=top_k, scoring=scoring, normalize_topk=normalize_topk)

    # Sort the T*k assignments by expert so each expert's rows are one contiguous group of the ragged dot.
    flat_experts = experts.reshape(-1)  # i32[T*k]
    order = jnp.argsort(flat_experts, stable=True)  # i32[T*k] assignment index of each sorted row
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # i32[E]
    xs = x.astype(w_gate_up.dtype)[order // top_k]  # f[T*k, D]
    gate_up = jax.lax.ragged_dot(
        xs, w_gate_up, group_sizes, preferred_element_type=jnp.float32
    )  # f32[T*k, 2F]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    h = (ACTIVATIONS[act](gate) * up).astype(w_down.dtype)  # f[T*k, F]
    ys = jax.lax.ragged_dot(h, w_down, group_sizes, preferred_element_type=jnp.float32)  # f32[T*k, D]

    y = jnp.zeros_like(ys).at[order].set(ys).reshape(num_tokens, top_k, hidden)  # back to token order
    # Multiply-and-sum rather than a contraction: an f32 dot may run at reduced precision on accelerators.
    return (weights[:, :, None] * y).sum(axis=1)
