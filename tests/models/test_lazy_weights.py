"""Lazy checkpoint tensors (models/weights/lazy.py) against numpy; the memory-mapped safetensors reader."""

import numpy as np
import pytest

from models.weights.lazy import STATS, LazyArray, along_axis, lazy
from models.weights.safetensors import read_safetensors_file

RNG = np.random.default_rng(0)


def _arr(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# (name, fn) applied to both numpy arrays and lazy sources of the same arrays.
A, B, C = _arr(4, 6, 5), _arr(4, 6, 5), _arr(4, 3, 5)
EXPRESSIONS = [
    ("transpose", lambda a, b, c: a.T),
    ("transpose axes", lambda a, b, c: a.transpose(2, 0, 1)),
    ("swapaxes", lambda a, b, c: np.swapaxes(a, 0, 2)),
    ("moveaxis", lambda a, b, c: np.moveaxis(a, 2, 0)),
    ("stack", lambda a, b, c: np.stack([a, b, a], axis=1)),
    ("stack last", lambda a, b, c: np.stack([a, b], axis=-1)),
    ("concat", lambda a, b, c: np.concatenate([a, c, b], axis=1)),
    ("concat then T", lambda a, b, c: np.concatenate([a, b], axis=2).T),
    ("split reshape", lambda a, b, c: a.reshape(4, 2, 3, 5)),
    ("merge reshape", lambda a, b, c: a.reshape(24, 5)),
    ("mixed reshape", lambda a, b, c: a.reshape(2, 60)),
    ("reshape -1 and 1s", lambda a, b, c: a.reshape(1, 4, -1, 1)),
    ("select", lambda a, b, c: a[1:3, ::2, 4]),
    ("select ellipsis", lambda a, b, c: a[..., 1:]),
    ("fancy", lambda a, b, c: a[:, [5, 0, 2, 2], :]),
    ("ufuncs", lambda a, b, c: -np.exp(a) * 2.0 + b / (np.abs(b) + 1)),
    ("broadcast", lambda a, b, c: a * c[:, :1, :] + np.arange(5, dtype=np.float32)),
    ("astype", lambda a, b, c: (a * 100).astype(np.int8)),
    ("where clip", lambda a, b, c: np.where(a > 0, np.clip(b, -0.5, 0.5), a)),
    ("split", lambda a, b, c: np.split(a, [2, 5], axis=1)[1]),
    ("deep", lambda a, b, c: np.stack([np.concatenate([a, b], 1).reshape(4, 2, 6, 5)[:, 1].T] * 2)),
]


@pytest.mark.parametrize("name,fn", EXPRESSIONS, ids=[e[0] for e in EXPRESSIONS])
def test_expression_matches_numpy(name, fn):
    want = fn(A, B, C)
    got = fn(lazy(A, "a"), lazy(B, "b"), lazy(C, "c"))
    assert isinstance(got, LazyArray), type(got)
    assert got.shape == want.shape and got.dtype == want.dtype
    STATS.clear()
    np.testing.assert_array_equal(np.asarray(got), want)
    assert not STATS.fallbacks
    # Random sub-regions, as a device's shard asks for them.
    for _ in range(5):
        index = []
        for n in want.shape:
            lo = int(RNG.integers(0, n))
            hi = int(RNG.integers(lo + 1, n + 1))
            index.append(slice(lo, hi))
        np.testing.assert_array_equal(np.asarray(got[tuple(index)]), want[tuple(index)])


def test_reads_only_the_region_asked_for():
    big = _arr(64, 32)
    expr = np.stack([lazy(big, "w").T, lazy(big, "w").T])  # [2, 32, 64]
    STATS.clear()
    np.asarray(expr[:, :, 16:32])
    assert {name for name, _, _ in STATS.reads} == {"w"}
    # Each read is the 16 rows of `big` the slice needs, not the whole tensor.
    assert all(nbytes == 16 * 32 * 4 for _, nbytes, _ in STATS.reads)


def test_unsupported_operation_materialises_and_is_counted():
    STATS.clear()
    got = np.cumsum(lazy(A), axis=1)
    np.testing.assert_allclose(got, np.cumsum(A, axis=1))
    assert STATS.fallbacks == ["cumsum"]


def test_along_axis_quantization_by_shards():
    from models.quantization import quantize_weight

    w = _arr(3, 8, 6)  # [experts, in, out]
    q_all, s_all = quantize_weight(w, "int8")
    q = along_axis(lambda b: quantize_weight(b, "int8")[0], w, -2, keep=True, dtype=np.int8)
    s = along_axis(lambda b: quantize_weight(b, "int8")[1], w, -2, keep=False, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(q[1:, 2:5, 3:]), q_all[1:, 2:5, 3:])
    np.testing.assert_array_equal(np.asarray(s[:2, 1:4]), s_all[:2, 1:4])


def test_safetensors_memory_map_matches_safetensors(tmp_path):
    import ml_dtypes
    from safetensors.numpy import save_file

    tensors = {
        "f32": _arr(5, 7),
        "f16": _arr(3, 4).astype(np.float16),
        "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "scalar": np.array(2.5, np.float32),
    }
    save_file(tensors, str(tmp_path / "a.safetensors"))
    got = read_safetensors_file(str(tmp_path / "a.safetensors"))
    for name, want in tensors.items():
        value = np.asarray(got[name])
        assert value.shape == want.shape
        np.testing.assert_array_equal(value, want.astype(np.float32) if want.dtype.kind == "f" else want)
    # bfloat16 (what most checkpoints hold), written by torch's safetensors.
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    bf = torch.randn(4, 6, dtype=torch.bfloat16)
    save_torch({"bf": bf}, str(tmp_path / "b.safetensors"))
    got = read_safetensors_file(str(tmp_path / "b.safetensors"))["bf"]
    np.testing.assert_array_equal(np.asarray(got[1:3, 2:]), bf.float().numpy()[1:3, 2:])
    assert got.array.dtype == np.dtype(ml_dtypes.bfloat16)


def test_fused_layouts_split_back_into_hf_projections():
    """models/fused.py: fused rows (from numpy or lazy tensors) give back HF's q, k, v and gate, up."""
    import jax.numpy as jnp

    from models.fused import gate_up_rows, qkv_rows, split_gate_up, split_qkv

    heads, kv_heads, hd, hidden, inter = 6, 2, 4, 8, 5
    q, k, v = _arr(heads * hd, hidden), _arr(kv_heads * hd, hidden), _arr(kv_heads * hd, hidden)
    gate, up = _arr(inter, hidden), _arr(inter, hidden)
    x = _arr(3, hidden)
    fused = qkv_rows(q, k, v, kv_heads)
    np.testing.assert_array_equal(np.asarray(qkv_rows(lazy(q), lazy(k), lazy(v), kv_heads)), fused)
    got = split_qkv(jnp.asarray(x @ fused.T), heads, kv_heads, hd)
    for ours, w, n in zip(got, (q, k, v), (heads, kv_heads, kv_heads)):
        np.testing.assert_allclose(np.asarray(ours), (x @ w.T).reshape(3, n, hd), rtol=1e-6, atol=1e-6)
    # Split over 2 devices (contiguous halves): each half holds one KV head's group whole.
    half = fused[: len(fused) // 2]
    np.testing.assert_array_equal(half, np.concatenate([q[: heads // 2 * hd], k[:hd], v[:hd]]))
    fused = gate_up_rows(gate, up)
    np.testing.assert_array_equal(np.asarray(gate_up_rows(lazy(gate), lazy(up))), fused)
    g, u = split_gate_up(jnp.asarray(x @ fused.T))
    np.testing.assert_allclose(np.asarray(g), x @ gate.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(u), x @ up.T, rtol=1e-6, atol=1e-6)
