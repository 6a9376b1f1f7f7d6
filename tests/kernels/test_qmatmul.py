"""Grouped 4- and 8-bit weights: the quantizer's round trip (kernels/quant/reference.py), and the native CPU
kernels (kernels/cpu/qmatmul.cc for few rows, qgemm.cc for many rows and bf16 activations) against the jnp
reference, run to run and thread to thread the same bits, and picked only where they apply."""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels import cpu, quant
from kernels.backend import KernelBackends, use_kernels
from kernels.quant.reference import (
    GROUP,
    PANEL,
    dequantize,
    from_panels,
    qmatmul_reference,
    quantize,
    to_panels,
)


def _weight(n: int, k: int, seed: int) -> np.ndarray:
    """f32[n, k] with rows of different magnitudes and offsets, and one constant group (a zero scale)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k), dtype=np.float32) * rng.uniform(0.01, 2.0, (n, 1)).astype(np.float32)
    w += rng.uniform(-0.5, 0.5, (n, 1)).astype(np.float32)
    w[0, :GROUP] = 0.25
    return w


def _quantized(n: int, k: int, bits: int, seed: int = 0):
    return tuple(None if a is None else jnp.asarray(a) for a in quantize(_weight(n, k, seed), bits))


_native = jax.jit(cpu.qmatmul_native)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 64, 203])
@pytest.mark.parametrize("n,k", [(200, 96), (576, 1536), (7, 32)])
def test_matches_reference(bits, rows, n, k):
    # qmatmul.cc up to max_qmatmul_rows() (16; 8 without AVX-512): one-row tiles (1, 5: the last row alone),
    # 2- and 3-row ones, whole tiles of 4 (AVX2: 2); n: tiles of 4 (2) weight rows and a tail, chunks that are
    # not whole blocks of 64 rows' scales. qgemm.cc above: tiles of 8 (6) rows and a tail (17, 203), panels
    # of 48 (16) columns and a partial one (200, 7), blocks of 512 inputs and a shorter last one (1536 = 3 x
    # 512, 96, 32).
    q, scale, zero = _quantized(n, k, bits, seed=rows * 10 + bits)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32))
    got = np.asarray(_native(x, q, scale, zero))
    want = np.asarray(qmatmul_reference(x, q, scale, zero))
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.fixture(params=[True, False], ids=["amx", "avx512"])
def amx(request):
    """Runs the test with qgemm.cc's AMX tiles allowed (used where the CPU and kernel have them) and with the
    AVX-512 path only."""
    cpu.use_amx(request.param)
    yield request.param
    cpu.use_amx(True)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def test_amx_is_on_where_the_cpu_has_it():
    """On a CPU with AMX-BF16 the kernels use the tiles (the process is granted them); elsewhere the reason
    says why not."""
    reason = cpu.amx_reason()
    if {"amx_tile", "amx_bf16"} <= _cpu_flags():
        assert reason is None
    else:
        assert reason is not None and "compiler" in reason


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [8, 9, 16, 47, 64, 203])
@pytest.mark.parametrize("n,k", [(200, 96), (576, 1536), (7, 32)])
def test_bf16_matches_reference(bits, rows, n, k, amx):
    """bf16 activations (a model computing in bfloat16): qgemm.cc's pair products of bf16 weights (blocks of
    16 rows on the AMX tiles where allowed and present, the rest on AVX512-BF16), against the reference's
    product of the same bf16 numbers in f32; only the order of the f32 sums may differ."""
    q, scale, zero = _quantized(n, k, bits, seed=rows * 10 + bits)
    x = np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32)
    x = jnp.asarray(x).astype(jnp.bfloat16)
    assert "xlaserve_cpu_qgemm" in _lowered(x, q, scale, zero)
    got = np.asarray(_native(x, q, scale, zero))
    want = np.asarray(qmatmul_reference(x, q, scale, zero))
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    # and the bf16 rounding of the weights is all that separates it from f32 weights
    exact = np.asarray(qmatmul_reference(x.astype(jnp.float32), q, scale, zero))
    assert np.abs(got - exact).max() <= 2 ** -8 * np.abs(exact).max() and np.abs(got - exact).max() > 0


@pytest.mark.parametrize("bits", [4, 8])
def test_amx_and_avx512_agree(bits):
    """The tiles and the AVX-512 path multiply the same bf16 numbers: they differ by the order of f32 sums
    only (on a CPU without AMX both runs take the AVX-512 path, and must be the same bits)."""
    q, scale, zero = _quantized(300, 1088, bits, seed=bits)
    x = np.random.default_rng(bits).standard_normal((50, 1088), dtype=np.float32)
    x = jnp.asarray(x).astype(jnp.bfloat16)
    try:
        cpu.use_amx(True)
        tiles = np.asarray(_native(x, q, scale, zero))
        cpu.use_amx(False)
        vectors = np.asarray(_native(x, q, scale, zero))
    finally:
        cpu.use_amx(True)
    np.testing.assert_allclose(tiles, vectors, rtol=1e-5, atol=1e-6 * np.abs(vectors).max())
    if cpu.amx_reason() is not None:
        np.testing.assert_array_equal(tiles, vectors)
    else:  # the tiles ran: their sums come in another order
        assert not np.array_equal(tiles, vectors)


def test_bf16_few_rows_are_at_least_as_exact():
    """Fewer bf16 rows than QGEMM_MIN_BF16_ROWS go to qmatmul.cc as f32, the weights not rounded to bf16: the
    f32 product of the same bf16 inputs."""
    q, scale, zero = _quantized(100, 256, 4)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 256), dtype=np.float32)).astype(jnp.bfloat16)
    got = np.asarray(_native(x, q, scale, zero))
    exact = np.asarray(qmatmul_reference(x.astype(jnp.float32), q, scale, zero))
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-5 * np.abs(exact).max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [3, 8, 17, 64])
def test_bf16_activations_are_a_bf16_models_products(bits, rows):
    """`activations="bf16"` (`--activation-quantization bf16`): from QGEMM_MIN_BF16_ROWS rows f32 x rounded
    to bf16, then exactly the product of a bf16 model's x (qgemm.cc's bf16 pairs), against the reference's
    rounding; fewer rows exactly the f32 product (not rounded); f32 comes back."""
    q, scale, zero = _quantized(300, 1088, bits, seed=rows + bits)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 1088), dtype=np.float32))
    rounded = jax.jit(lambda *a: cpu.qmatmul_native(*a, activations="bf16"))
    got = np.asarray(rounded(x, q, scale, zero))
    gemm = rows >= cpu.QGEMM_MIN_BF16_ROWS
    np.testing.assert_array_equal(got, np.asarray(_native(x.astype(jnp.bfloat16) if gemm else x, q, scale,
                                                          zero)))
    assert ("xlaserve_cpu_qgemm" in rounded.lower(x, q, scale, zero).as_text()) == gemm
    want = np.asarray(qmatmul_reference(x, q, scale, zero, activations="bf16"))
    np.testing.assert_array_equal(want, np.asarray(qmatmul_reference(x.astype(jnp.bfloat16), q, scale, zero)))
    exact = np.asarray(qmatmul_reference(x, q, scale, zero))
    if gemm:  # the same bf16 numbers: f32 sums in another order apart; the rounding is bf16's
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        assert 0 < np.abs(got - exact).max() <= 2 ** -7 * np.abs(exact).max()
    else:
        np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-5 * np.abs(exact).max())


def test_leading_dimensions():
    q, scale, zero = _quantized(40, 64, 4)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 64), dtype=np.float32))
    got = np.asarray(_native(x, q, scale, zero))
    assert got.shape == (2, 3, 40)
    want = np.asarray(qmatmul_reference(x, q, scale, zero))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 100])
@pytest.mark.parametrize("activations", ["none", "int8"])
def test_same_input_same_bits(bits, rows, activations):
    """Every output is one thread's sum in a fixed order: repeated calls, and calls from several Python
    threads at once (a caller that finds the helper threads busy works alone), agree exactly."""
    q, scale, zero = _quantized(576, 1536, bits)
    rng = np.random.default_rng(rows)
    xs = [jnp.asarray(rng.standard_normal((rows, 1536), dtype=np.float32)) for _ in range(4)]
    native = jax.jit(lambda *a: cpu.qmatmul_native(*a, activations=activations))
    first = [np.asarray(native(x, q, scale, zero)) for x in xs]
    for _ in range(10):
        np.testing.assert_array_equal(np.asarray(native(xs[0], q, scale, zero)), first[0])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: np.asarray(native(xs[i], q, scale, zero)), list(range(4)) * 6))
    for i, got in zip(list(range(4)) * 6, results):
        np.testing.assert_array_equal(got, first[i])


def _lowered(x, q, scale, zero) -> str:
    # A fresh function each time: jit's trace cache does not know about the active kernel backends.
    return jax.jit(lambda x, q, s, z: quant.qmatmul(x, q, s, z)).lower(x, q, scale, zero).as_text()


@pytest.mark.parametrize("bits", [4, 8])
def test_dispatch_only_where_it_applies(bits):
    q, scale, zero = _quantized(24, 64, bits)
    x = jnp.zeros((cpu.max_qmatmul_rows(), 64), jnp.float32)
    lowered = _lowered(x, q, scale, zero)  # default backends on CPU: auto = native
    assert "xlaserve_cpu_qmatmul" in lowered and "xlaserve_cpu_qgemm" not in lowered
    with use_kernels(KernelBackends("reference")):
        assert "xlaserve_cpu_q" not in _lowered(x, q, scale, zero)
    big = jnp.zeros((cpu.max_qmatmul_rows() + 1, 64), jnp.float32)  # prefill-sized: the GEMM
    lowered = _lowered(big, q, scale, zero)
    assert "xlaserve_cpu_qgemm" in lowered and "xlaserve_cpu_qmatmul" not in lowered
    assert "xlaserve_cpu_q" not in _lowered(x, q, scale.astype(jnp.float32), zero)  # f16 scales only
    bf16 = jnp.zeros((cpu.QGEMM_MIN_BF16_ROWS, 64), jnp.bfloat16)
    assert "xlaserve_cpu_qgemm" in _lowered(bf16, q, scale, zero)
    assert "xlaserve_cpu_qmatmul" in _lowered(bf16[:cpu.QGEMM_MIN_BF16_ROWS - 1], q, scale, zero)
    assert "xlaserve_cpu_q" not in _lowered(x.astype(jnp.float16), q, scale, zero)  # f32 or bf16 only
    np.testing.assert_allclose(np.asarray(quant.qmatmul(big, q, scale, zero)),
                               np.asarray(qmatmul_reference(big, q, scale, zero)))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_round_trip(bits):
    """Dequantized weights are within half a step of the originals (plus the f16 rounding of the scale and the
    zero), and quantizing them again gives the same numbers back."""
    w = _weight(64, 256, seed=bits)
    q, scale, zero = quantize(w, bits)
    assert q.dtype == (np.uint8 if bits == 4 else np.int8) and scale.dtype == np.float16
    assert q.shape == (64, 256 * bits // 8) and scale.shape == (64, 256 // GROUP)
    back = np.asarray(dequantize(*(None if a is None else jnp.asarray(a) for a in (q, scale, zero))))
    g = w.reshape(64, -1, GROUP)
    s16 = scale.astype(np.float32)
    if bits == 4:
        lo = g.min(axis=-1)
        step = (g.max(axis=-1) - lo) / 15
        bound = step / 2 + 15 * np.abs(step - s16) + np.abs(lo - zero.astype(np.float32))
    else:
        step = np.abs(g).max(axis=-1) / 127
        bound = step / 2 + 127 * np.abs(step - s16)
    err = np.abs(back.reshape(g.shape) - g).max(axis=-1)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-7), (err - bound).max()
    again = quantize(back, bits)
    np.testing.assert_array_equal(again[0], q)
    np.testing.assert_array_equal(again[1], scale)
    if bits == 4:
        np.testing.assert_array_equal(again[2], zero)
    else:
        assert again[2] is None


def test_fp8_quantize_round_trip():
    """fp8 groups (the 8-bit layout with e4m3 values): each weight within half an e4m3 step of its group's
    grid q * scale (the step at |w| / scale: 2^(e - 3) in the binade [2^e, 2^(e + 1)), 2^-9 under 2^-6, the
    subnormals), the group's largest magnitude at 448, a zero group a zero scale; `dequantize` is exactly
    q.astype(f32) * scale, and quantizing that again gives the same numbers back."""
    w = _weight(64, 256, seed=3)
    w[1, GROUP:2 * GROUP] = 0.0
    q, scale, zero = quantize(w, 8, fp8=True)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == w.shape and zero is None
    assert scale.dtype == np.float16 and scale.shape == (64, 256 // GROUP)
    s = scale.astype(np.float32)[..., None]
    q32 = q.astype(np.float32).reshape(64, -1, GROUP)
    back = np.asarray(dequantize(jnp.asarray(q), jnp.asarray(scale), None)).reshape(q32.shape)
    np.testing.assert_array_equal(back, q32 * s)
    g = w.reshape(q32.shape)
    assert s[1, 1] == 0 and np.all(back[1, 1] == 0)
    np.testing.assert_array_equal(np.abs(q32).max(axis=-1)[s[..., 0] > 0], 448.0)
    x = np.abs(g) / np.where(s > 0, s, 1.0)
    step = np.where(x < 2.0**-6, 2.0**-9, 2.0 ** (np.floor(np.log2(np.maximum(x, 2.0**-6))) - 3))
    err = np.abs(back - g)
    assert np.all(err <= s * step / 2 * (1 + 1e-6)), (err / (s * step / 2 + 1e-30)).max()
    again = quantize(back.reshape(w.shape), 8, fp8=True)
    np.testing.assert_array_equal(again[0].view(np.uint8), q.view(np.uint8))
    np.testing.assert_array_equal(again[1], scale)
    with pytest.raises(ValueError, match="fp8 values are the 8-bit layout"):
        quantize(w, 4, fp8=True)


def test_fp8_takes_the_reference():
    """The native kernels read int8 / packed 4-bit values: fp8 weights lower to the reference (no custom call)
    and give exactly its numbers, decode- and prefill-sized, f32 and bf16."""
    q, scale, _ = quantize(_weight(24, 64, 0), 8, fp8=True)
    q, scale, zero = jnp.asarray(q), jnp.asarray(scale), None
    for rows in (1, cpu.max_qmatmul_rows() + 1):
        for dtype in (jnp.float32, jnp.bfloat16):
            x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 64)), dtype)
            assert "xlaserve_cpu_q" not in _lowered(x, q, scale, zero)
            np.testing.assert_array_equal(np.asarray(jax.jit(quant.qmatmul)(x, q, scale, zero)),
                                          np.asarray(qmatmul_reference(x, q, scale, zero)))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17, 40, 43])
@pytest.mark.parametrize("n,k", [(200, 96), (576, 1536), (7, 32), (5, 608)])
def test_int8_activations_match_reference(bits, rows, n, k):
    """`activations="int8"`: integer products (on a CPU with AVX512-VNNI or AVX2: qmatmul_i8.cc up to
    `max_qmatmul_i8_rows()` rows, qgemm_i8.cc above, in their vpdpbusd or vpmaddubsw forms; elsewhere the jnp
    rounding and the f32 kernels) against the reference's rounding and f32 product: the same integers and
    scales, so only f32 rounding apart.
    qmatmul_i8.cc's k: whole 4-group blocks and tails of 1-3 groups (96, 32, 608 = 19 groups), n: tiles of 2
    weight rows and a tail; qgemm_i8.cc's: a panel block of 16 groups and tails of 1-3 (608), panels of 48
    (AVX2: 16) columns and a partial one (200, 7, 5), tiles of 4 rows and tails of 1 and 3 (9, 17, 43)."""
    q, scale, zero = _quantized(n, k, bits, seed=rows * 10 + bits)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, k), dtype=np.float32) * rng.uniform(0.1, 3, (1, k)).astype(np.float32)
    if k > GROUP:
        x[0, :GROUP] = 0  # a group of zeros: scale 0
    x = jnp.asarray(x)
    native = jax.jit(lambda *a: cpu.qmatmul_native(*a, activations="int8"))
    got = np.asarray(native(x, q, scale, zero))
    want = np.asarray(qmatmul_reference(x, q, scale, zero, activations="int8"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    exact = np.asarray(qmatmul_reference(x, q, scale, zero))
    assert 0 < np.abs(want - exact).max() < 0.05 * np.abs(exact).max()  # rounded, and not far


def test_stored_panels_layout():
    """`to_panels` on a hand-checked position: output c of panel p, group g, stored unit u (4 bytes) sits at
    [u][c][4] of the group's block (4 bits: the row's bytes 4u..4u+3; 8 bits: its inputs 4u..4u+3), the
    factors at [group][output]; `from_panels` gives the rows back, with a leading (layer) axis too."""
    for bits, unit_count in ((4, 4), (8, 8)):
        qs = [quantize(_weight(48, 96, seed), bits) for seed in range(2)]
        q = np.stack([a[0] for a in qs])
        scale = np.stack([a[1] for a in qs])
        zero = None if bits == 8 else np.stack([a[2] for a in qs])
        pq, ps, pz = to_panels(q, scale, zero)
        assert pq.shape == q.shape and pq.dtype == q.dtype and ps.shape == scale.shape
        group_bytes = q.shape[-1] // 3
        layer, p, c, g, u = 1, 2, 5, 1, unit_count - 1
        panel = pq[layer, p * PANEL : (p + 1) * PANEL].reshape(-1)
        block = panel[g * PANEL * group_bytes : (g + 1) * PANEL * group_bytes]
        start = g * group_bytes + 4 * u
        np.testing.assert_array_equal(block.reshape(unit_count, PANEL, 4)[u, c],
                                      q[layer, p * PANEL + c, start : start + 4])
        factors = ps[layer, p * PANEL : (p + 1) * PANEL].reshape(-1)
        assert factors[g * PANEL + c] == scale[layer, p * PANEL + c, g]
        back = from_panels(jnp.asarray(pq), jnp.asarray(ps), None if pz is None else jnp.asarray(pz))
        for got, want in zip(back, (q, scale, zero)):
            assert (got is None) == (want is None)
            if want is not None:
                np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="multiple of 16"):
        to_panels(*quantize(_weight(40, 64, 0), 4))


@pytest.mark.skipif(cpu.panel_width() != PANEL, reason="the library has no stored-panel kernel here (built "
                    "with AVX512-VNNI or AVX2); the weights then stay in rows")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17, 43])
@pytest.mark.parametrize("n,k", [(48, 96), (576, 1536), (16, 32), (32, 608), (80, 160)])
def test_stored_panels_match_reference(bits, rows, n, k):
    """The stored-panel kernel (qgemm_i8.cc `stored_tile`) against the reference on the row layout of the same
    weights: f32 rounding apart. k: a block of 16 groups and tails (608 = 19 groups), a single group (32);
    rows: tiles of 4 and tails of 1-3; n (AVX-512 takes 3 stored panels a tile): whole tiles (48, 576), one
    or two panels alone (16, 32), and after whole ones (80)."""
    q, scale, zero = _quantized(n, k, bits, seed=rows * 10 + bits)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, k), dtype=np.float32) * rng.uniform(0.1, 3, (1, k)).astype(np.float32)
    x = jnp.asarray(x)
    stored = tuple(None if a is None else jnp.asarray(a) for a in to_panels(
        np.asarray(q), np.asarray(scale), None if zero is None else np.asarray(zero)))
    native = jax.jit(lambda *a: cpu.qmatmul_native(*a, activations="int8", layout="panels"))
    assert "xlaserve_cpu_qmatmul_panels" in native.lower(x, *stored).as_text()
    got = np.asarray(native(x, *stored))
    want = np.asarray(qmatmul_reference(x, q, scale, zero, activations="int8"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    # each output by one thread in one order: the same bits from another thread
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        again = np.asarray(pool.submit(lambda: native(x, *stored)).result())
    np.testing.assert_array_equal(got, again)


@pytest.mark.skipif(not cpu.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("activations,layout,target", [
    ("none", "rows", "xlaserve_cpu_qgemm"), ("bf16", "rows", "xlaserve_cpu_qgemm"),
    ("int8", "rows", "xlaserve_cpu_qgemm_i8"), ("int8", "panels", "xlaserve_cpu_qmatmul_panels")])
@pytest.mark.parametrize("live", [(0, 21, 32, 37), (0, 0, 32, 40), (3, 3, 40, 40), (0, 40, 40, 40),
                                  (5, 2, 0, 0)])
def test_live_rows_are_computed_and_the_rest_are_zeros(activations, layout, target, live):
    """Under `live_rows` (a step's real token rows) the many-row GEMMs on grouped weights (qgemm.cc in f32
    and bf16, qgemm_i8.cc in rows and stored panels) compute rows [l0, l1) and [l2, l3) as they would
    without it, the same bits, and write zeros elsewhere (a bucket's padding); ranges out of order (the last
    case) mean every row. A product whose x is not the step's rows computes every row."""
    if activations == "int8" and not cpu.has_int8_activations():
        pytest.skip("no int8-activation GEMM in this build")
    if layout == "panels" and cpu.panel_width() != PANEL:
        pytest.skip("no stored-panel kernel in this build")
    rows, n, k = 40, 48, 96  # more rows than the few-row kernels (qmatmul.cc, qmatmul_i8.cc) take
    q, scale, zero = _quantized(n, k, 4, seed=3)
    w = (q, scale, zero) if layout == "rows" else tuple(jnp.asarray(a) for a in to_panels(
        np.asarray(q), np.asarray(scale), np.asarray(zero)))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, k), dtype=np.float32))

    def product(x, live):
        with cpu.live_rows(rows, live):
            return cpu.qmatmul_native(x, *w, activations=activations, layout=layout)

    assert target in jax.jit(product).lower(x, jnp.zeros(4, jnp.int32)).as_text()
    whole = jax.jit(lambda x: cpu.qmatmul_native(x, *w, activations=activations, layout=layout))
    everything = np.asarray(whole(x))
    got = np.asarray(jax.jit(product)(x, jnp.asarray(live, jnp.int32)))
    keep = np.zeros(rows, bool)
    if live[0] <= live[1] <= live[2] <= live[3]:
        keep[live[0]: live[1]] = keep[live[2]: live[3]] = True
    else:
        keep[:] = True
    np.testing.assert_array_equal(got[keep], everything[keep])
    assert not got[~keep].any()
    # x of other rows than the step's (an LM head on the sampled rows): every row computed
    other = np.asarray(jax.jit(product)(x[:33], jnp.asarray(live, jnp.int32)))
    np.testing.assert_array_equal(other, everything[:33])
    # x with more than one leading axis ([5, 8, k], the step's 40 rows or not): every row computed
    folded = np.asarray(jax.jit(product)(x.reshape(5, 8, k), jnp.asarray(live, jnp.int32)))
    np.testing.assert_array_equal(folded.reshape(rows, n), everything)


def test_stored_panels_without_their_kernel_take_the_reference():
    """Weights in stored panels multiplied where the panel kernel does not apply (f32 activations, or the
    reference backend) are the reference's product of the rows they hold."""
    q, scale, zero = _quantized(32, 64, 4)
    stored = tuple(jnp.asarray(a) for a in to_panels(np.asarray(q), np.asarray(scale), np.asarray(zero)))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 64), dtype=np.float32))
    want = np.asarray(qmatmul_reference(x, q, scale, zero))
    lowered = jax.jit(lambda *a: cpu.qmatmul_native(*a, layout="panels")).lower(x, *stored).as_text()
    assert "xlaserve_cpu_qmatmul_panels" not in lowered
    np.testing.assert_allclose(np.asarray(cpu.qmatmul_native(x, *stored, layout="panels")), want, rtol=1e-5,
                               atol=1e-5)
    with use_kernels(KernelBackends("reference")):
        got = quant.qmatmul(x, *stored, activations="int8", layout="panels")
    np.testing.assert_allclose(np.asarray(got), np.asarray(qmatmul_reference(x, q, scale, zero,
                                                                             activations="int8")), rtol=1e-5)
    assert not KernelBackends("reference").stored_panels()


def test_int8_activations_dispatch():
    """Where the library has the int8 kernels (AVX512-VNNI or AVX2): few rows to qmatmul_i8.cc, more to
    qgemm_i8.cc; otherwise the jnp rounding, then qmatmul.cc or (many rows) qgemm.cc."""
    q, scale, zero = _quantized(64, 64, 4)
    def lowered(rows):
        native = jax.jit(lambda *a: cpu.qmatmul_native(*a, activations="int8"))
        return native.lower(jnp.zeros((rows, 64)), q, scale, zero).as_text()
    few, many, most = (lowered(cpu.max_qmatmul_i8_rows()), lowered(cpu.max_qmatmul_i8_rows() + 1),
                       lowered(cpu.max_qmatmul_rows() + 1))
    if cpu.has_int8_activations():
        assert "xlaserve_cpu_qmatmul_i8" in few and "xlaserve_cpu_qgemm" not in few
        assert "xlaserve_cpu_qgemm_i8" in many and "xlaserve_cpu_qmatmul" not in many
        assert "xlaserve_cpu_qgemm_i8" in most
    else:
        assert "_i8" not in few + many + most
        assert "xlaserve_cpu_qmatmul" in few and "xlaserve_cpu_qgemm" in most
    if {"avx512_vnni", "avx512bw", "avx512vl"} <= _cpu_flags() or {"avx2", "f16c", "fma"} <= _cpu_flags():
        assert cpu.has_int8_activations()
    # stored panels: built with the int8 GEMM (AVX512-VNNI or AVX2)
    assert cpu.panel_width() == (PANEL if cpu.has_int8_activations() else 0)
    assert KernelBackends().stored_panels() == (cpu.panel_width() == PANEL)


def test_quantize_activations_hand_case():
    """max |x| = 2: d = 2 / 127, x * 63.5 rounded to nearest even (1 -> 63.5 -> 64, -0.5 -> -31.75 -> -32)."""
    x = np.zeros((1, GROUP), np.float32)
    x[0, :4] = [2.0, 1.0, -0.5, 0.01]
    got = np.asarray(quant.quantize_activations(jnp.asarray(x)))[0, :5]
    d = np.float32(2) / np.float32(127)
    np.testing.assert_allclose(got, np.array([127, 64, -32, 1, 0], np.float32) * d, rtol=1e-6)


def test_quantize_activations_rounds_per_group():
    """x' = d * integer, |integer| <= 127, d = the group's max |x| / 127 (that element kept to an ulp), each
    element within d / 2 of x; a group of zeros stays zeros."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4 * GROUP)).astype(np.float32) * np.float32(10) ** rng.integers(-3, 3, (3, 1))
    x[1, GROUP:2 * GROUP] = 0
    got = np.asarray(quant.quantize_activations(jnp.asarray(x))).reshape(3, 4, GROUP)
    g = x.reshape(3, 4, GROUP)
    d = np.abs(g).max(-1, keepdims=True) / 127
    steps = np.divide(got, d, out=np.zeros_like(got), where=d > 0)
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    assert np.abs(np.round(steps)).max() == 127
    assert np.all(np.abs(got - g) <= d / 2 * (1 + 1e-5))
    assert not got[1, 1].any()
