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
    correction_bias: jax.Array | None = None,  # f32[E] added to the scores for the choice only
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Each token's `top_k` experts: (weights f32[T, k], experts i32[T, k]).

    Scores are softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3, Ling) of the logits in float32.
    DeepSeek-V3's `noaux_tc` choice: experts are chosen on score + `correction_bias`, only among the
    `topk_groups` best of `num_groups` equal expert groups (a group scores the sum of its two best
    experts); the weights are the unbiased scores of the chosen experts. `normalize_topk` rescales them
    to sum to one; then they are multiplied by `routed_scaling_factor`.
    """
    logits = router_logits.astype(jnp.float32)
    if scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"unknown {scoring=}; known: softmax, sigmoid")
    num_tokens, num_experts = scores.shape
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if num_groups > 1:
        if num_experts % num_groups or not 0 < topk_groups <= num_groups:
            raise ValueError(
                f"{num_experts=} must split into {num_groups=}, with {topk_groups=} in [1, groups]"
            )
        grouped = choice.reshape(num_tokens, num_groups, num_experts // num_groups)
        group_scores = jax.lax.top_k(grouped, min(2, num_experts // num_groups))[0].sum(axis=-1)  # [T, G]
        _, best_groups = jax.lax.top_k(group_scores, topk_groups)
        allowed = (
            jnp.zeros((num_tokens, num_groups), bool)
            .at[jnp.arange(num_tokens)[:, None], best_groups]
            .set(True)
        )
        choice = jnp.where(allowed[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize_topk:
        # DeepSeek's epsilon; it cannot change a softmax's sum.
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, experts


def _grouped_dot(rows: jax.Array, w: jax.Array, group_sizes: jax.Array, row_experts: jax.Array) -> jax.Array:
    """rows f[A, D] sorted by expert (`group_sizes` i32[E] rows each) times their expert's w f[E, D, N]:
    f32[A, N].

    On TPU/GPU `ragged_dot` is a real grouped matmul. XLA:CPU has none: it lowers `ragged_dot` densely,
    every row against every expert (E times the work), plus a transposed copy of all weights per call
    (bench/moe.py: 29 ms for one token through 16 experts of 1024 x 512, against 1.4 ms reading only its
    two experts). So on CPU: with at most one row per expert (decode at small batch) each row gathers its
    expert's weights; with more, `_tiled_grouped_dot`.
    """
    if jax.default_backend() != "cpu":
        return jax.lax.ragged_dot(rows, w, group_sizes, preferred_element_type=jnp.float32)
    if rows.shape[0] <= w.shape[0]:
        return jnp.einsum("ad,adn->an", rows, w[row_experts], preferred_element_type=jnp.float32)
    return _tiled_grouped_dot(rows, w, group_sizes, row_experts)


def _tiled_grouped_dot(rows: jax.Array, w: jax.Array, group_sizes: jax.Array,
                       row_experts: jax.Array) -> jax.Array:
    """The grouped matmul as a loop over fixed-size row tiles, each tile from one expert's group.

    Each group is padded to whole tiles (at most `num_experts` extra tiles in all), so every tile reads one
    expert's weights once and multiplies only real rows (plus padding): the useful FLOPs, not E times them.
    """
    w = jnp.asarray(w)
    num_rows, hidden = rows.shape
    num_experts = w.shape[0]
    tile = int(min(128, max(8, 1 << (max(1, num_rows // num_experts) - 1).bit_length())))  # ~rows per expert
    num_tiles = -(-num_rows // tile) + num_experts  # static bound on the padded tiles
    tiles_per_group = (group_sizes + tile - 1) // tile  # i32[E]
    tile_starts = jnp.cumsum(tiles_per_group) - tiles_per_group  # first tile of each group
    row_starts = jnp.cumsum(group_sizes) - group_sizes  # first sorted row of each group
    dest = tile_starts[row_experts] * tile + jnp.arange(num_rows) - row_starts[row_experts]  # i32[A]
    padded = jnp.zeros((num_tiles * tile, hidden), rows.dtype).at[dest].set(rows)
    # Expert of each tile (tiles past the last group compute zeros with the last expert's weights).
    tile_experts = jnp.searchsorted(jnp.cumsum(tiles_per_group), jnp.arange(num_tiles), side="right")
    tile_experts = jnp.minimum(tile_experts, num_experts - 1).astype(jnp.int32)

    def one_tile(args):
        x, e = args
        return jnp.dot(x, w[e], preferred_element_type=jnp.float32)

    # f32[tiles, tile, N]
    out = jax.lax.map(one_tile, (padded.reshape(num_tiles, tile, hidden), tile_experts))
    return out.reshape(num_tiles * tile, -1)[dest]


def moe_ffn(
    x: jax.Array,  # f[T, D]
    router_logits: jax.Array,  # f32[T, E]
    # [E, D, 2F]: each expert's gate then up projection (float, or int8/fp8 with scales)
    w_gate_up: jax.Array,
    w_down: jax.Array,  # [E, F, D]
    *,
    top_k: int,
    act: str = "silu",
    gate_up_scale: jax.Array | None = None,  # f32[E, 2F] per-output-channel scales of a quantized w_gate_up
    down_scale: jax.Array | None = None,  # f32[E, D]
    experts_impl=None,  # an implementation of `experts_ffn` (the package passes the dispatched one)
    **routing,
) -> jax.Array:
    """Routes each token to `top_k` experts (`route`, with `routing` its options) and runs them: f32[T, D]."""
    num_experts = w_gate_up.shape[0]
    if router_logits.shape != (x.shape[0], num_experts):
        raise ValueError(f"router_logits shape {router_logits.shape} != ({x.shape[0]}, {num_experts})")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{top_k=} must be in [1, {num_experts=}]")
    weights, experts = route(router_logits, top_k=top_k, **routing)
    return (experts_impl or experts_ffn)(
        x, weights, experts, w_gate_up, w_down, act=act, gate_up_scale=gate_up_scale, down_scale=down_scale
    )


def experts_ffn(
    x: jax.Array,  # f[T, D]
    weights: jax.Array,  # f32[T, k] each token's weight for each of its experts
    experts: jax.Array,  # i32[T, k] each token's chosen experts
    w_gate_up: jax.Array,  # [E, D, 2F]: each expert's gate then up projection
    w_down: jax.Array,  # [E, F, D]
    *,
    act: str = "silu",
    gate_up_scale: jax.Array | None = None,  # f32[E, 2F]
    down_scale: jax.Array | None = None,  # f32[E, D]
    shared_gate_up: jax.Array | None = None,  # [D, 2Fs]: an always-on shared expert's gate then up (float)
    shared_down: jax.Array | None = None,  # [Fs, D]
) -> jax.Array:
    """sum over each token's chosen experts e of weight_e * down_e(act(gate_e(x)) * up_e(x)); f32[T, D].

    Dropless: every (token, expert) assignment is computed, whatever the load (no capacity factor), and
    an expert that no token chose costs nothing but its empty group. Float weights: matmuls run in the
    weights' dtype with float32 accumulation. Quantized weights (int8 / fp8 with per-output-channel
    scales): they are widened to x's dtype for the dot and each row's result is multiplied by its expert's
    channel scales after the dot, so the scales never touch the weights. The combine is float32. With
    `shared_gate_up` and `shared_down`, a shared expert's down_s(act(gate_s(x)) * up_s(x)) over every token
    is added unweighted (DeepSeek-V3 / Ling style), its matmuls in the same compute dtype.
    """
    num_tokens, hidden = x.shape
    num_experts, _, two_f = w_gate_up.shape
    top_k = experts.shape[1]
    if w_down.shape != (num_experts, two_f // 2, hidden):
        raise ValueError(f"w_down shape {w_down.shape} != ({num_experts}, {two_f // 2}, {hidden})")
    if weights.shape != experts.shape or experts.shape[0] != num_tokens:
        raise ValueError(f"weights {weights.shape} and experts {experts.shape} must be ({num_tokens}, k)")
    quantized = gate_up_scale is not None
    if quantized != (down_scale is not None):
        raise ValueError("give both gate_up_scale and down_scale, or neither")
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("give both shared_gate_up and shared_down, or neither")
    compute = x.dtype if quantized else w_gate_up.dtype

    # Sort the T*k assignments by expert so each expert's rows are one contiguous group of the ragged dot.
    flat_experts = experts.reshape(-1)  # i32[T*k]
    order = jnp.argsort(flat_experts, stable=True)  # i32[T*k] assignment index of each sorted row
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)  # i32[E]
    row_experts = flat_experts[order]  # i32[T*k] expert of each sorted row
    xs = x.astype(compute)[order // top_k]  # f[T*k, D]
    gate_up = _grouped_dot(xs, w_gate_up.astype(compute), group_sizes, row_experts)  # f32[T*k, 2F]
    if quantized:
        gate_up = gate_up * gate_up_scale[row_experts]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    h = (ACTIVATIONS[act](gate) * up).astype(compute)  # f[T*k, F]
    ys = _grouped_dot(h, w_down.astype(compute), group_sizes, row_experts)
    if quantized:
        ys = ys * down_scale[row_experts]  # f32[T*k, D]

    y = jnp.zeros_like(ys).at[order].set(ys).reshape(num_tokens, top_k, hidden)  # back to token order
    # Multiply-and-sum rather than a contraction: an f32 dot may run at reduced precision on accelerators.
    out = (weights[:, :, None] * y).sum(axis=1)
    if shared_gate_up is not None:
        xc = x.astype(compute)
        gate, up = jnp.split(
            jnp.dot(xc, shared_gate_up.astype(compute), preferred_element_type=jnp.float32), 2, -1
        )
        h = (ACTIVATIONS[act](gate) * up).astype(compute)
        out = out + jnp.dot(h, shared_down.astype(compute), preferred_element_type=jnp.float32)
    return out
