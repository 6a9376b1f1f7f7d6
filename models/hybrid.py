"""What the hybrids share: layers of several kinds run in order, each kind in its own pool."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from memory import CacheSpec, MemoryPools, RecurrentSpec
from models.batch import ForwardBatch
from models.config import AttentionConfig
from models.recurrent import decode_in_place, read_layer_states, state_rows, write_layer_states


def ordinals(kinds: Sequence[str]) -> tuple[int, ...]:
    """Index of each layer among the layers of its own kind: its layer index into that kind's pool."""
    seen: dict[str, int] = {}
    out = []
    for kind in kinds:
        out.append(seen.get(kind, 0))
        seen[kind] = out[-1] + 1
    return tuple(out)


def prefixed(
    prefix: tuple[str, ...], params: dict[tuple[str, ...], np.ndarray]
) -> dict[tuple[str, ...], np.ndarray]:
    return {prefix + path: value for path, value in params.items()}


def run_layers(
    layers: nnx.Dict, layer_types: tuple[str, ...], recurrent_kind: str, x: jax.Array, batch: ForwardBatch,
    pools: MemoryPools, in_place_ops: tuple[str, ...] = (),
) -> tuple[jax.Array, MemoryPools]:
    """Runs heterogeneous layers in order: `layers[str(i)](x, batch, kv, states, index) -> (x, kv, states)`.

    `index` is the layer's ordinal among layers of its kind (its index into the KV or the state pool);
    layers of `recurrent_kind` get their rows' initial states (see models/recurrent.py) and their final
    states are written back to the pool right after them. Returns (x, pools with kv and recurrent updated).
    `in_place_ops`: the native kernels with which the recurrent layers update `InPlace` states, given them
    in decode-only steps where those run (models/recurrent.py `decode_in_place`).
    """
    kv, rec = pools.kv, pools.recurrent
    rows = state_rows(batch) if rec is not None else None
    in_place = rec is not None and decode_in_place(batch, rec, in_place_ops)
    for i, (kind, index) in enumerate(zip(layer_types, ordinals(layer_types))):
        states = read_layer_states(rec, index, rows, in_place) if kind == recurrent_kind else None
        x, kv, states = layers[str(i)](x, batch, kv, states, index)
        if kind == recurrent_kind:
            rec = write_layer_states(rec, index, rows, states)
    return x, pools._replace(kv=kv, recurrent=rec)


def cache_spec(
    layer_types: Sequence[str], attention: AttentionConfig, ssm_shape: tuple[int, ...],
    conv_shape: tuple[int, ...] | None, *, attention_kind: str = "attention", recurrent_kind: str = "mamba",
    split_heads: bool = False,
) -> CacheSpec:
    """KV pages for the `attention_kind` layers, a state slot of the given shapes for the `recurrent_kind`
    ones (`split_heads`: see RecurrentSpec)."""
    num_recurrent = list(layer_types).count(recurrent_kind)
    recurrent = RecurrentSpec(num_recurrent, ssm_shape, conv_shape, split_heads) if num_recurrent else None
    return CacheSpec(list(layer_types).count(attention_kind), attention.num_kv_heads, attention.head_dim,
                     recurrent)


# Qwen3-Next and Kimi-Linear / Ling 3 name their layers alike.
LINEAR, FULL = "linear_attention", "full_attention"


def check_linear_full_layers(layer_types: Sequence[str], sparse_layers: Sequence[bool]) -> None:
    """Raises ValueError unless every layer is linear or full attention and has its MLP kind."""
    if not layer_types or set(layer_types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types={tuple(layer_types)} must be a non-empty sequence of {LINEAR}/{FULL}")
    if len(sparse_layers) != len(layer_types):
        raise ValueError(f"the MLP kinds name {len(sparse_layers)} layers, layer_types {len(layer_types)}")


def decoder_params(hidden: int, vocab_size: int, tie_word_embeddings: bool, layer_types: Sequence[str],
                   sparse_layers: Sequence[bool], mixers: dict[str, int], moe: int, dense: int) -> int:
    """Parameters of a pre-norm decoder: per layer two norms, its mixer (by kind) and a MoE or dense MLP; the
    embedding, an untied LM head and the final norm."""
    layers = sum(2 * hidden + mixers[kind] + (moe if sparse else dense)
                 for kind, sparse in zip(layer_types, sparse_layers, strict=True))
    return layers + vocab_size * hidden * (1 if tie_word_embeddings else 2) + hidden


class PreNormLayer(nnx.Module):
    """x = x + mixer(input_norm(x)); x = x + mlp(post_attn_norm(x)). The mixer is recurrent (`self.recurrent`:
    `attn(h, batch, states) -> (y, states)`) or attention (`attn(h, batch, kv, index) -> (y, kv)`); subclasses
    build `input_norm`, `attn`, `post_attn_norm`, `mlp` and set `recurrent`."""

    recurrent: bool

    def __call__(self, x, batch: ForwardBatch, kv, states, index: int):
        h = self.input_norm(x)
        if self.recurrent:
            with jax.named_scope("linear_attention"):
                y, states = self.attn(h, batch, states)
        else:
            with jax.named_scope("attention"):
                y, kv = self.attn(h, batch, kv, index)
        x = x + y
        with jax.named_scope("mlp"):
            x = x + self.mlp(self.post_attn_norm(x))
        return x, kv, states


def run_model(model, batch: ForwardBatch, pools: MemoryPools, recurrent_kind: str,
              in_place_ops: tuple[str, ...] = ()) -> tuple[jax.Array, MemoryPools]:
    """A hybrid CausalLM's forward: embed, `run_layers` over `model.layers` (kinds `model.cfg.layer_types`),
    final norm; returns (hidden f[T, hidden], pools)."""
    x = model.embed_tokens(batch.input_ids).astype(model.dtype)
    x, pools = run_layers(model.layers, model.cfg.layer_types, recurrent_kind, x, batch, pools, in_place_ops)
    return model.norm(x, model.dtype), pools
