"""Grouped 4- / 8-bit weights for every Linear layer, the embedding and the LM head (`--quantization int4 |
int8 | fp8 | auto`, models/quantization.py): a GGUF file's Q4_1 / Q8_0 blocks load as exactly their numbers
and serve the logits of the fp32 dequantization; tiny models served quantized against unquantized, with the
layers kept one array each (CPU) and stacked (GPU/TPU), dense and Mamba-2."""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.cpu import panel_width
from kernels.quant import dequantize
from kernels.quant.reference import PANEL
from models.loader import load_model
from models.quantization import LINEAR_BITS, stored_panel_counts
from runtime.buckets import Buckets
from runtime.runner import ModelRunner, RunnerConfig
from serve import Engine
from tests.helpers import greedy
from tests.tiny_models import save_tiny_llama, save_tiny_mamba2

pytestmark = pytest.mark.slow

ARGS = dict(in_process=True, dtype="float32", max_running_requests=4, chunked_prefill_size=32, page_size=16,
            context_length=128, max_total_tokens=1024, skip_tokenizer_init=True)


def _linears(model):
    from flax import nnx

    from models.layers.linear import Linear

    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Linear)]


def test_gguf_blocks_load_as_their_own_numbers(smollm2_gguf):
    """`auto` keeps the file's Q4_1 Linear weights 4-bit and its Q8_0 embedding 8-bit, and every quantized
    weight dequantizes to exactly the fp32 the reader makes of the same blocks; ~92 MiB instead of 513."""
    _, quant = load_model(smollm2_gguf, quantization="auto")
    _, full = load_model(smollm2_gguf)
    linears = dict(_linears(quant))
    assert linears and all(m.qkernel is not None and m.kernel is None for m in linears.values())
    for path, ref in _linears(full):
        m = linears[path]
        assert m.qkernel[...].dtype == np.uint8 and m.qzero is not None  # Q4_1: 4 bits with a minimum
        w = dequantize(m.qkernel[...], m.qscale[...], m.qzero[...])
        np.testing.assert_array_equal(np.asarray(w), np.asarray(ref.kernel[...]).T)
    assert quant.embed[...].dtype == np.int8 and quant.embed_zero is None  # Q8_0
    np.testing.assert_array_equal(np.asarray(dequantize(quant.embed[...], quant.embed_scale[...], None)),
                                  np.asarray(full.embed[...]))
    size = sum(x.nbytes for x in jax.tree.leaves(quant)) / 2**20
    assert 85 < size < 100, size


def test_gguf_4bit_serves_the_logits_of_its_fp32_dequantization(smollm2_gguf, smollm2_engine):
    """Served with `--quantization auto` (the native quantized matmul in decode, the dequantizing reference
    in prefill): prompt logprobs within 1e-3 of the fp32 engine's, the same greedy tokens."""
    prompts = ["The capital of France is", "def fibonacci(n):\n", "List three colours of the rainbow:"]
    kw = dict(prompt=prompts, sampling_params=greedy(16), return_logprob=True, logprob_start_len=0)
    want = smollm2_engine.generate(**kw)
    engine = Engine(model=smollm2_gguf, quantization="auto", in_process=True, dtype="float32",
                    max_running_requests=8, chunked_prefill_size=128, context_length=512,
                    max_total_tokens=4096)
    try:
        got = engine.generate(**kw)
    finally:
        engine.shutdown()
    for g, w in zip(got, want, strict=True):
        lg = [lp for lp, _ in g["meta_info"]["input_token_logprobs"][1:]]
        lw = [lp for lp, _ in w["meta_info"]["input_token_logprobs"][1:]]
        np.testing.assert_allclose(lg, lw, atol=1e-3, rtol=0)
        assert g["output_ids"] == w["output_ids"]
        np.testing.assert_allclose([lp for lp, _ in g["meta_info"]["output_token_logprobs"]],
                                   [lp for lp, _ in w["meta_info"]["output_token_logprobs"]],
                                   atol=1e-3, rtol=0)


def _on_grid(path: str, kind: str) -> str:
    """Rounds every 2-D weight of the checkpoint at `path` whose rows split into groups onto the grid of
    `--quantization kind` (in place): the checkpoint's numbers are then exactly what quantizing them keeps."""
    from safetensors.numpy import load_file, save_file

    from kernels.quant import GROUP, quantize

    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    for name, w in tensors.items():
        if w.ndim == 2 and w.shape[1] % GROUP == 0:
            parts = quantize(w, LINEAR_BITS[kind], fp8=kind == "fp8")
            tensors[name] = np.asarray(dequantize(*parts)).astype(w.dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def _serve(path: str, prompts, kind, layer_weights: str = "auto", **extra):
    """(prompt logprobs, greedy tokens, parameter dtypes, startup log) of each prompt alone (batch-1 decode:
    the native kernel) and of all batched."""
    startup = io.StringIO()
    with contextlib.redirect_stderr(startup):
        engine = Engine(model=path, quantization=kind, layer_weights=layer_weights, **ARGS, **extra)
    try:
        dtypes = {leaf.dtype.name for leaf in jax.tree.leaves(engine.runner.params)}
        kw = dict(sampling_params=greedy(12), return_logprob=True, logprob_start_len=0)
        res = [engine.generate(input_ids=p, **kw) for p in prompts]
        res += engine.generate(input_ids=prompts, **kw)
    finally:
        engine.shutdown()
    lps = np.array([lp for r in res for lp, _ in r["meta_info"]["input_token_logprobs"][1:]])
    out_lps = np.array([lp for r in res for lp, _ in r["meta_info"]["output_token_logprobs"]])
    return lps, [r["output_ids"] for r in res], dtypes, startup.getvalue(), out_lps


PROMPTS = [np.random.default_rng(0).integers(3, 500, size=n).tolist() for n in (37, 70)]


Q_DTYPES = {"int4": "uint8", "int8": "int8", "fp8": "float8_e4m3fn"}  # how each kind stores its values


@pytest.mark.parametrize("name,kind", [("llama", "int4"), ("llama", "int8"), ("llama", "fp8"),
                                       ("llama_stacked", "int4"), ("mamba2", "int4")])
def test_quantized_serving_equals_fp32_of_the_same_numbers(name, kind, tmp_path_factory):
    """A checkpoint whose weights already lie on the grid: served quantized (4-/8-bit or e4m3 values, f16
    scales; int4 / int8 the native kernel in decode, the dequantizing reference in prefill, fp8 the reference
    throughout) it gives the fp32 engine's prompt and output logprobs to 1e-4 and its greedy tokens."""
    path = str(tmp_path_factory.mktemp(f"{name}_grid_{kind}"))
    _on_grid((save_tiny_mamba2 if name == "mamba2" else save_tiny_llama)(path), kind)
    layers = "stacked" if name.endswith("stacked") else "auto"
    want = _serve(path, PROMPTS, None, layers)
    got = _serve(path, PROMPTS, kind, layers)
    assert Q_DTYPES[kind] in got[2] and "float16" in got[2]
    np.testing.assert_allclose(got[0], want[0], atol=1e-4, rtol=0)
    assert got[1] == want[1]
    np.testing.assert_allclose(got[4], want[4], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Llama (random weights, off the grid) served unquantized, int8, fp8 and int4."""
    path = save_tiny_llama(str(tmp_path_factory.mktemp("llama")))
    return {kind: _serve(path, PROMPTS, kind) for kind in (None, "int8", "fp8", "int4")}


# What quantizing costs a random tiny model, which is far more sensitive than a trained one (large weights,
# sharp logits over 512 tokens, two groups per row), measured: int8 max 0.18 / mean 0.046 nats, every greedy
# token the same; fp8 max 0.91 / mean 0.22, 12 of 48 the same; int4 max 2.0 / mean 0.49, 2 of 48 the same.
# (SmolLM2's own 4-bit blocks: docs/.)
@pytest.mark.parametrize("kind,max_bound,mean_bound", [("int8", 0.5, 0.1), ("fp8", 2.5, 0.5),
                                                      ("int4", 5.0, 1.0)])
def test_served_logprob_drift_is_bounded(served, kind, max_bound, mean_bound, capsys):
    base, quant = served[None], served[kind]
    drift = np.abs(quant[0] - base[0])
    same = sum(a == b for x, y in zip(quant[1], base[1]) for a, b in zip(x, y))
    with capsys.disabled():
        print(f"\n{kind}: prompt logprob drift max {drift.max():.4f} mean {drift.mean():.5f}; "
              f"greedy tokens equal: {same}/{sum(map(len, base[1]))}")
    assert 0 < drift.max() < max_bound and drift.mean() < mean_bound
    assert quant[1][:2] == quant[1][2:]  # alone (batch-1 decode) and batched: the same tokens


def test_int8_drifts_less_than_int4(served):
    drift = {kind: np.abs(served[kind][0] - served[None][0]).mean() for kind in ("int8", "int4")}
    assert drift["int8"] < drift["int4"] / 4


def test_fp8_drifts_between_int8_and_int4(served):
    # e4m3 keeps 4 significant bits of each weight (a relative error up to 2^-4): coarser than int8's 255
    # levels a group for all but the group's smallest weights, finer than int4's 16.
    drift = {kind: np.abs(served[kind][0] - served[None][0]).mean() for kind in ("int8", "fp8", "int4")}
    assert drift["int8"] < drift["fp8"] < drift["int4"], drift


def test_startup_reports_the_quantized_size(served):
    for kind in ("int8", "fp8", "int4"):
        line = re.search(r"quantization \w+: grouped weights ([\d.]+) MiB -> ([\d.]+) MiB", served[kind][3])
        assert line, served[kind][3]
        before, after = map(float, line.groups())
        # 8.5 (int8, fp8) or 5 bits a weight (values, f16 scale, f16 minimum per 32) against 32, to the
        # printed 0.1 MiB
        assert after <= before * (5 if kind == "int4" else 8.5) / 32 + 0.05, (kind, before, after)
        assert line.group(0).startswith(f"quantization {kind}:")
    assert "quantization" not in served[None][3]


def _k_quant_blocks(rng, t, n: int, k: int, scale: float) -> np.ndarray:
    """u8 bytes of GGML `t` (Q4_K or Q6_K) blocks for a [n, k] tensor, random but valid (gguf-py cannot
    quantize K-quants): random packed values and sub-block scales, super-block scales `scale`-sized."""
    from gguf import GGMLQuantizationType as T

    blocks = n * k // 256
    nbytes = {T.Q4_K: 144, T.Q6_K: 210}[t]
    raw = rng.integers(0, 256, (blocks, nbytes), dtype=np.uint8)
    def f16(size: float) -> np.ndarray:  # a float16 per block, between size / 2 and size, as 2 bytes
        return np.frombuffer((rng.uniform(0.5, 1.0, blocks) * size).astype(np.float16).tobytes(),
                             np.uint8).reshape(blocks, 2)

    if t == T.Q4_K:  # f16 d, f16 dmin, then 12 bytes of 6-bit scales and minimums, 128 of nibbles
        raw[:, 0:2], raw[:, 2:4] = f16(scale / 63 / 8), f16(scale / 63 / 8)
    else:  # 128 + 64 bytes of 6-bit values, 16 int8 scales, f16 d
        raw[:, 208:210] = f16(scale / 128 / 16)
    return raw.reshape(n, k * nbytes // 256)


def _write_mixed_gguf(path: str) -> dict[str, str]:
    """A 2-layer llama GGUF (hidden 256, the K-quants' block) whose tensors use the block types llama.cpp's
    Q4_0 / Q4_K_M files do, layer 1's attn_v in another type than layer 0's. Returns name -> type name."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(3)
    hidden, heads, kv_heads, ffn, vocab, layers = 256, 4, 2, 512, 96, 2
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers), writer.add_embedding_length(hidden), writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads), writer.add_head_count_kv(kv_heads), writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(1e-5), writer.add_rope_freq_base(1e4), writer.add_vocab_size(vocab)
    types = {"token_embd.weight": T.Q4_0, "output.weight": T.Q6_K, "output_norm.weight": T.F32}
    for i in range(layers):
        types |= {f"blk.{i}.attn_q.weight": T.Q4_0, f"blk.{i}.attn_k.weight": T.Q4_K,
                  f"blk.{i}.attn_v.weight": T.Q6_K if i == 0 else T.Q4_K,
                  f"blk.{i}.attn_output.weight": T.Q4_K,
                  f"blk.{i}.ffn_gate.weight": T.Q4_0, f"blk.{i}.ffn_up.weight": T.Q4_1,
                  f"blk.{i}.ffn_down.weight": T.Q6_K, f"blk.{i}.attn_norm.weight": T.F32,
                  f"blk.{i}.ffn_norm.weight": T.F32}
    shapes = {"token_embd": (vocab, hidden), "output": (vocab, hidden), "attn_q": (hidden, hidden),
              "attn_k": (kv_heads * 64, hidden), "attn_v": (kv_heads * 64, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    for name, t in types.items():
        base = name.split(".")[-2]
        if t == T.F32:
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
            continue
        n, k = shapes[base]
        if t in (T.Q4_K, T.Q6_K):
            raw = _k_quant_blocks(rng, t, n, k, 0.05)
        else:
            raw = gguf.quants.quantize((0.05 * rng.standard_normal((n, k))).astype(np.float32), t)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=t)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return {name: t.name for name, t in types.items()}


def test_gguf_q4_0_and_k_quant_files_load_quantized(tmp_path):
    """`auto` on a file in llama.cpp's Q4_0 / Q4_K_M types: Q4_0 and Q4_1 weights 4-bit with exactly their
    numbers, Q4_K 4-bit up to the float16 rounding of its sub-block scales and minimums, Q6_K (and a
    weight whose layers mix Q4_K and Q6_K) 8-bit within half a step of the 8-bit grid; served, the prompt
    logprobs stay near the fp32 dequantization's."""
    from kernels.quant import GROUP

    path = str(tmp_path / "mixed.gguf")
    _write_mixed_gguf(path)
    _, quant = load_model(path, quantization="auto")
    _, full = load_model(path)
    linears = dict(_linears(quant))
    # Our fused projections: q|k|v 8-bit (layer 0's attn_v is Q6_K), gate|up 4-bit and exact (Q4_0, Q4_1),
    # o 4-bit (Q4_K), down 8-bit (Q6_K)
    want_bits = {"qkv": 8, "gate_up": 4, "o": 4, "down": 8}
    seen = set()
    for path_, ref in _linears(full):
        m, kind = linears[path_], str(path_[-1])
        seen.add(kind)
        bits = 4 if m.qzero is not None else 8
        assert bits == want_bits[kind], (path_, bits)
        w = np.asarray(dequantize(m.qkernel[...], m.qscale[...], None if bits == 8 else m.qzero[...]))
        r = np.asarray(ref.kernel[...]).T
        err = np.abs(w - r).reshape(w.shape[0], -1, GROUP).max(axis=-1)
        step = np.abs(np.asarray(m.qscale[...], np.float32))
        rounding = lambda x: np.maximum(np.abs(x) * 2**-11, 2**-25)  # noqa: E731  (half a float16 ulp)
        if kind == "gate_up":
            np.testing.assert_array_equal(w, r, err_msg=str(path_))
        elif bits == 4:  # Q4_K: the float16 rounding of a scale (times up to 15) and of a minimum
            zero = np.asarray(m.qzero[...], np.float32)
            assert (err <= 15 * rounding(step) + rounding(zero)).all(), path_
        else:  # half a step of the 8-bit grid, and the float16 rounding of its scale (times up to 127)
            assert (err <= 0.5 * step + 127 * rounding(step)).all(), path_
    assert seen == set(want_bits)
    assert quant.embed[...].dtype == np.uint8 and quant.embed_zero is not None  # Q4_0 -> 4 bits, exactly
    np.testing.assert_array_equal(np.asarray(dequantize(quant.embed[...], quant.embed_scale[...],
                                                        quant.embed_zero[...])), np.asarray(full.embed[...]))
    assert quant.lm_head[...].dtype == np.int8  # Q6_K -> 8 bits
    prompt = [np.random.default_rng(1).integers(3, 90, size=40).tolist()]
    runs = []
    for kind in ("auto", "none"):
        engine = Engine(model=path, quantization=kind, **ARGS)
        try:
            runs.append(engine.generate(input_ids=prompt, sampling_params=greedy(4), return_logprob=True,
                                        logprob_start_len=0)[0])
        finally:
            engine.shutdown()
    # Re-rounding (Q6_K onto the 8-bit grid) and the float16 Q4_K scales move the prompt logprobs a little
    # (measured: 0.014 at most here)
    got, want = ([lp for lp, _ in r["meta_info"]["input_token_logprobs"][1:]] for r in runs)
    np.testing.assert_allclose(got, want, atol=0.05, rtol=0)
    assert runs[0]["output_ids"] == runs[1]["output_ids"]


@pytest.mark.parametrize("activations", ["int8", "none"])
def test_skipping_padding_rows_changes_no_bit(activations, tmp_path_factory, monkeypatch):
    """4-bit weights, int8 or f32 activations: products that skip a step's padding rows (kernels/cpu
    `live_rows`: partly used prefill blocks, unused blocks, unused decode rows) give the real tokens the
    bits of products over every row: prompt and output logprobs and tokens identical, alone and batched."""
    import kernels.cpu as cpu
    import runtime.step

    path = save_tiny_llama(str(tmp_path_factory.mktemp("llama_live_rows")))
    prompts = [list(range(5, 10)), list(range(40, 60)), list(range(100, 137))]  # 1-3 blocks of 16
    skipped = []  # products traced on a step's token rows, with its live ranges
    live = cpu._live

    def spy(x):
        step = cpu._LIVE.get()
        skipped.append(step is not None and x.ndim == 2 and x.shape[0] == step[0])
        return live(x)

    monkeypatch.setattr(cpu, "_live", spy)
    skipping = _serve(path, prompts, "int4", activation_quantization=activations)
    if cpu.available() and (activations == "none" or cpu.has_int8_activations()):
        assert any(skipped), "no product took the step's live rows"
    monkeypatch.setattr(runtime.step, "live_rows", lambda rows, live: contextlib.nullcontext())
    skipped.clear()
    every = _serve(path, prompts, "int4", activation_quantization=activations)
    assert not any(skipped)
    np.testing.assert_array_equal(skipping[0], every[0])
    assert skipping[1] == every[1]
    np.testing.assert_array_equal(skipping[4], every[4])


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_int8_activations_native_equals_reference(kind, tmp_path_factory, capsys):
    """`--activation-quantization int8`: the native products (integer products: qmatmul_i8.cc in decode,
    qgemm_i8.cc in prefill, or qgemm_i8.cc's stored-panel kernel in both where it is built; each within f32
    rounding of the reference's on the same input,
    tests/kernels/test_qmatmul.py) give the reference product's greedy tokens and, within 0.1, its
    logprobs, every other op native in both. Not 1e-4: an f32-rounding difference in one layer's output
    can move an activation of the next across an int8 rounding boundary (a whole step), and this random
    tiny model amplifies that (measured 0.044 on the 4-bit one; the same happens between the reference and
    the all-reference engine: up to 0.036 on the 8-bit one). The drift from the same weights without
    activation rounding is reported and bounded (a random tiny model: far more sensitive than a trained
    one)."""
    path = save_tiny_llama(str(tmp_path_factory.mktemp(f"llama_a8_{kind}")))
    native = _serve(path, PROMPTS, kind, activation_quantization="int8")
    reference = _serve(path, PROMPTS, kind, activation_quantization="int8",
                       kernel_backend="auto,qmatmul=reference")
    plain = _serve(path, PROMPTS, kind)
    # where the library reads stored panels (built with AVX512-VNNI or AVX2) the native engine's weights are
    # in them, the reference engine's in rows (kernels/backend.py `KernelBackends.stored_panels`)
    assert ("stored panels:" in native[3]) == (panel_width() == PANEL)
    assert "stored panels:" not in reference[3]
    np.testing.assert_allclose(native[0], reference[0], atol=0.1, rtol=0)
    assert native[1] == reference[1]
    np.testing.assert_allclose(native[4], reference[4], atol=0.1, rtol=0)
    assert native[1][:2] == native[1][2:]  # alone (batch-1 decode) and batched: the same tokens
    drift = np.abs(native[0] - plain[0])
    with capsys.disabled():
        print(f"\n{kind} weights, int8 activations: prompt logprob drift max {drift.max():.4f} mean "
              f"{drift.mean():.5f} against {kind} weights alone")
    assert 0 < drift.max() < 0.5 and drift.mean() < 0.1


@pytest.mark.parametrize("layer_weights", ["per_layer", "stacked"])
def test_stored_panels_hold_the_same_weights(layer_weights, tmp_path_factory):
    """`load_model(stored_panels=True)` (what the server asks for on a CPU whose kernel reads them, int8
    activations, one device) lays out every quantized Linear whose output size is a multiple of 16, and the
    embedding (here the tied LM head), in stored panels (`to_stored_panels`), holding exactly the row-layout
    model's numbers, and the embedding's token rows come out of them unchanged; without int8 activations it
    changes nothing. The engine's outputs with them are checked against the reference products in
    `test_int8_activations_native_equals_reference`."""
    from kernels.quant.reference import from_panels

    path = save_tiny_llama(str(tmp_path_factory.mktemp(f"llama_panels_{layer_weights}")))
    for kind in ("int4", "int8"):
        load = dict(quantization=kind, layer_weights=layer_weights)
        _, rows = load_model(path, jnp.float32, activation_quantization="int8", **load)
        _, panels = load_model(path, jnp.float32, activation_quantization="int8", stored_panels=True, **load)
        _, plain = load_model(path, jnp.float32, stored_panels=True, **load)
        assert all(m.layout == "rows" for _, m in _linears(plain) + _linears(rows))
        changed = 0
        for (_, a), (_, b) in zip(_linears(rows), _linears(panels)):
            assert b.layout == ("panels" if a.qscale[...].shape[-2] % PANEL == 0 else "rows")
            parts = (b.qkernel[...], b.qscale[...], None if b.qzero is None else b.qzero[...])
            if b.layout == "panels":
                changed += 1
                assert not np.array_equal(np.asarray(parts[0]), np.asarray(a.qkernel[...]))
                parts = from_panels(*parts)
            for got, want in zip(parts, (a.qkernel, a.qscale, a.qzero)):
                if want is not None:
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want[...]))
        assert changed == len(_linears(rows))  # the tiny model's output sizes are all multiples of 16
        assert (rows.embed_layout, panels.embed_layout, plain.embed_layout) == ("rows", "panels", "rows")
        tables = 1 + (rows.lm_head_scale is not None)  # the embedding, and the LM head when untied (here)
        assert panels.lm_head_layout == ("panels" if tables == 2 else "rows")
        assert stored_panel_counts(panels) == (changed + tables,) * 2 and stored_panel_counts(rows)[0] == 0
        zero = None if panels.embed_zero is None else panels.embed_zero[...]
        back = from_panels(panels.embed[...], panels.embed_scale[...], zero)
        np.testing.assert_array_equal(np.asarray(back[0]), np.asarray(rows.embed[...]))
        ids = jnp.asarray([[0, 5, 17], [31, 16, rows.embed.shape[0] - 1]])
        np.testing.assert_array_equal(np.asarray(panels.embed_tokens(ids)),
                                      np.asarray(rows.embed_tokens(ids)))


def test_stored_panels_tied_lm_head(smollm2_gguf):
    """SmolLM2 (`auto`: 4-bit Linear layers, an 8-bit embedding tied to the LM head) in stored panels: token
    rows as in rows, and the logits of the tied head (the stored-panel kernel where the library has it)
    within f32 rounding of the row-layout model's (qmatmul_i8.cc), int8 activations in both."""
    _, rows = load_model(smollm2_gguf, quantization="auto", activation_quantization="int8")
    _, panels = load_model(smollm2_gguf, quantization="auto", activation_quantization="int8",
                           stored_panels=True)
    assert panels.lm_head is None and panels.embed_layout == "panels"
    ids = jnp.asarray([1, 2, 100, 4000, 49151])
    np.testing.assert_array_equal(np.asarray(panels.embed_tokens(ids)), np.asarray(rows.embed_tokens(ids)))
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((3, rows.embed.shape[1]), np.float32))
    want, got = (np.asarray(jax.jit(lambda h, m=m: m.logits(h))(hidden)) for m in (rows, panels))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_bf16_activations_native_equals_reference(tmp_path_factory, capsys):
    """`--activation-quantization bf16`: a prefill's products (qgemm.cc's bf16 pairs) give the reference
    product's prompt logprobs (1e-4: the same bf16 numbers, summed in another order); decode steps of a few
    rows stay f32 (qmatmul.cc), closer to f32 than the reference, with the same greedy tokens here. Against
    the same weights without rounding the drift is reported and bounded, and is not zero (the rounding took
    place)."""
    path = save_tiny_llama(str(tmp_path_factory.mktemp("llama_abf16")))
    native = _serve(path, PROMPTS, "int4", activation_quantization="bf16")
    reference = _serve(path, PROMPTS, "int4", activation_quantization="bf16",
                       kernel_backend="auto,qmatmul=reference")
    plain = _serve(path, PROMPTS, "int4")
    np.testing.assert_allclose(native[0], reference[0], atol=1e-4, rtol=0)
    assert native[1] == reference[1] == plain[1]
    drift = np.abs(native[0] - plain[0])
    with capsys.disabled():
        print(f"\nint4 weights, bf16 activations: prompt logprob drift max {drift.max():.4f} mean "
              f"{drift.mean():.5f} against int4 weights alone")
    assert 0 < drift.max() < 0.25 and drift.mean() < 0.05


def test_bf16_activations_round_attention_over_bf16_kv(tmp_path_factory):
    """Over a bf16 KV cache, `--activation-quantization bf16` gives attention bf16 queries, prefill and decode
    (the native kernels' bf16 pairs, `bf16_query = 1` on their calls), and no other configuration does: f32
    KV, or no activation rounding. The engine's prompt logprobs then stay near those of the reference
    products and attention (whose prefill rounds the softmax weights after normalizing, the kernel before:
    bf16-sized differences on this sensitive tiny model), with the same greedy tokens."""
    path = save_tiny_llama(str(tmp_path_factory.mktemp("llama_abf16_kv")))
    seen = {}
    for activations, kv in (("bf16", "bfloat16"), ("bf16", None), ("none", "bfloat16")):
        cfg, model = load_model(path, jnp.float32, quantization="int4", activation_quantization=activations)
        buckets = Buckets.make(max_running_requests=2, chunked_prefill_size=32, prefill_block_size=16,
                               max_context_len=64, page_size=16)
        runner = ModelRunner(model, cfg, RunnerConfig(16, 16, 2, buckets, cfg.vocab_size, kv_cache_dtype=kv),
                             jnp.float32)
        shape = next(s for s in buckets.all_shapes() if s.prefill_blocks and s.decode)
        hlo = runner._step_jit.lower(runner._params_flat, runner.pools, runner.dummy_batch(shape)).as_text()
        seen[activations, kv] = sorted((kind, re.search(r"bf16_query = (\d)", line).group(1))
                                       for line in hlo.splitlines() for kind in ("prefill", "decode")
                                       if f"xlaserve_cpu_{kind}_attention" in line)
    assert seen == {("bf16", "bfloat16"): [("decode", "1"), ("prefill", "1")],
                    ("bf16", None): [("decode", "0"), ("prefill", "0")],
                    ("none", "bfloat16"): [("decode", "0"), ("prefill", "0")]}

    native = _serve(path, PROMPTS, "int4", activation_quantization="bf16", kv_cache_dtype="bfloat16")
    reference = _serve(path, PROMPTS, "int4", activation_quantization="bf16", kv_cache_dtype="bfloat16",
                       kernel_backend="auto,qmatmul=reference,prefill_attention=reference,"
                                      "decode_attention=reference")
    assert native[1] == reference[1]
    assert np.abs(native[0] - reference[0]).max() < 0.1


def test_int8_activations_need_quantized_weights():
    """--activation-quantization is checked at startup: int8 and bf16 need grouped weights to round the
    inputs of."""
    from serve.server_args import ServerArgs

    ServerArgs(quantization="auto", activation_quantization="int8")
    with pytest.raises(ValueError, match="activation_quantization=int8 .* needs --quantization"):
        ServerArgs(activation_quantization="int8")
    with pytest.raises(ValueError, match="activation_quantization=bf16 .* needs --quantization"):
        ServerArgs(activation_quantization="bf16")
    with pytest.raises(ValueError, match="activation_quantization='int4' must be none, int8 or bf16"):
        ServerArgs(quantization="int8", activation_quantization="int4")
