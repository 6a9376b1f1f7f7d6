"""Output layouts of fused projections (q|k|v, gate|up) that tensor parallelism splits without reshuffles.

Tensor parallelism splits a fused projection's output columns into contiguous blocks, one per device
(runtime/mesh.py). With the plain layouts [q | k | v] and [gate | up] a block holds all of q, or all of
gate, and XLA must move activations between devices before attention or the activation. These layouts keep
what belongs together adjacent, so any block count that divides the groups gives each device whole units:

- q/k/v grouped by KV head: for each KV head g, its `num_heads / num_kv_heads` query heads, then k_g, then
  v_g (query heads stay in HF order, since query head h reads KV head h // group). Split over the TP
  devices, each holds whole groups: its query heads and the KV heads they read.
- linear attention's projections grouped by head (Gated DeltaNet: per key head its q, k, the v and z of its
  value heads; KDA: per head q, k, v), and so the conv channels and recurrent states that follow them.
- gate/up interleaved by channel: gate_0, up_0, gate_1, up_1, ...: a block holds matching gate and up
  channels.

`*_rows` build the fused weight from HF's [out, in] tensors (numpy or lazy, models/weights/lazy.py) in
the name maps; `split_*` take the projection's output apart in the forward pass.
"""

from __future__ import annotations

import jax
import numpy as np


def grouped_rows(parts, num_groups: int):
    """HF tensors [num_groups * n_i, ...] (the rows of part i for group 0, then group 1, ...) -> rows grouped:
    for each group g, part 0's rows of g, then part 1's, ... (a contiguous block of whole groups holds every
    part of them)."""
    rest = parts[0].shape[1:]
    return np.concatenate([x.reshape(num_groups, -1, *rest) for x in parts], axis=1).reshape(-1, *rest)


def qkv_rows(q, k, v, num_kv_heads: int):
    """HF q [H*hd, ...], k and v [KVH*hd, ...] (weights or biases) -> rows grouped by KV head."""
    return grouped_rows((q, k, v), num_kv_heads)


def split_qkv(y: jax.Array, num_heads: int, num_kv_heads: int, head_dim: int):
    """Projection output y [T, (H + 2*KVH) * hd] in `qkv_rows` order -> q [T, H, hd], k, v [T, KVH, hd]."""
    t, group = y.shape[0], num_heads // num_kv_heads
    y = y.reshape(t, num_kv_heads, group + 2, head_dim)
    return y[:, :, :group].reshape(t, num_heads, head_dim), y[:, :, group], y[:, :, group + 1]


def gate_up_rows(gate, up):
    """HF gate and up [I, ...] (weights or biases) -> rows interleaved by channel [2I, ...]."""
    return np.stack([gate, up], axis=1).reshape(-1, *gate.shape[1:])


def split_gate_up(y: jax.Array):
    """Projection output y [..., 2I] in `gate_up_rows` order -> (gate, up), each [..., I]."""
    pairs = y.reshape(*y.shape[:-1], -1, 2)
    return pairs[..., 0], pairs[..., 1]
