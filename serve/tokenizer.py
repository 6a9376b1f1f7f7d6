"""Text <-> token ids and chat templates, from a Hugging Face model directory or a GGUF file."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from models.weights.gguf import gguf_metadata

# Bump when the GGUF -> tokenizer.json construction changes, so stale cache entries are not reused.
_GGUF_BUILDER_VERSION = 1
# Special token names in tokenizer_config.json -> their id keys in GGUF metadata (after "tokenizer.ggml.").
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs around it: chat template, BOS and end ids."""

    backend: tokenizers.Tokenizer = dataclasses.field(repr=False)
    chat_template: str | None = dataclasses.field(repr=False)
    special_tokens: dict[str, str]  # bos_token/eos_token/unk_token/pad_token -> text, for chat templates
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends a generation; the tokenizer's own eos first

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the BOS/EOS the model's post-processor asks for.

        Special tokens written in the text (e.g. "<|im_start|>") always map to their single id.
        """
        # encode_batch releases the GIL and encode does not (measured: a 7.8 MB prompt held it for 19 s), so
        # a long prompt tokenized on a worker thread leaves the server's event loop running; same ids.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's jinja chat template as transformers does (same globals,
        filters and special-token variables); extra `kwargs` (tools=..., documents=...) reach the template.

        Returns the prompt text, or its ids without added BOS/EOS when `tokenize`. Raises ValueError if
        the model has no template, jinja2.TemplateError if the template rejects the conversation.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send raw prompts (completions) instead")
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        text = _compile(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, token in self.backend.get_added_tokens_decoder().items() if token.special)


def load_tokenizer(model_path: str, cache_dir: str | None = None) -> Tokenizer:
    """Load the tokenizer of an HF model directory (tokenizer.json, tokenizer_config.json, optional
    chat_template.jinja and generation_config.json) or build one from a .gguf file's metadata.

    A tokenizer built from a GGUF is saved under `cache_dir` (as a small HF style directory keyed by the
    file's path, size and mtime) so later loads skip the build; with `cache_dir=None` nothing is written.
    Raises ValueError when the path holds neither, or the GGUF vocabulary type is unsupported.
    """
    if cache_dir is None and not os.path.isdir(model_path):
        _check_gguf(model_path)
        with tempfile.TemporaryDirectory() as tmp:
            _write_hf_dir(gguf_metadata(model_path), tmp)
            return _load_hf_dir(tmp)
    return _load_hf_dir(tokenizer_dir(model_path, cache_dir))


def _check_gguf(model_path: str) -> None:
    if not model_path.endswith(".gguf") or not os.path.isfile(model_path):
        raise ValueError(f"{model_path=} is neither an HF model directory nor a .gguf file")


def tokenizer_dir(model_path: str, cache_dir: str) -> str:
    """The HF style directory holding the tokenizer of `model_path`: the model directory itself, or for a
    .gguf file the entry built from its metadata under `cache_dir` (built on first use)."""
    if os.path.isdir(model_path):
        return model_path
    _check_gguf(model_path)
    stat = os.stat(model_path)
    key = f"{os.path.realpath(model_path)}:{stat.st_size}:{stat.st_mtime_ns}:{_GGUF_BUILDER_VERSION}"
    stem = os.path.basename(model_path).removesuffix(".gguf")
    target = os.path.join(cache_dir, "tokenizers", f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if not os.path.isfile(os.path.join(target, "tokenizer.json")):
        shutil.rmtree(target, ignore_errors=True)  # only a hand-damaged entry can lack the file
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".building-")
        try:
            _write_hf_dir(gguf_metadata(model_path), tmp)
            os.chmod(tmp, 0o755)
            with contextlib.suppress(OSError):  # fails only if another process finished first; same entry
                os.replace(tmp, target)  # atomic, so a concurrent loader never sees a half-written entry
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _load_hf_dir(path: str) -> Tokenizer:
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise ValueError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
    backend = tokenizers.Tokenizer.from_file(tokenizer_file)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
    special_tokens = {}
    for name in _SPECIAL_IDS:
        token = config.get(name, special_map.get(name))
        if isinstance(token, dict):  # a serialized AddedToken
            token = token.get("content")
        if isinstance(token, str):
            special_tokens[name] = token
    template_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(template_file):  # transformers >= 4.43 saves it apart, and prefers it
        with open(template_file, encoding="utf-8") as f:
            chat_template = f.read()
    else:
        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": ..., "template": ...}]
            chat_template = {t["name"]: t["template"] for t in chat_template}.get("default")
    eos_ids: list[int] = []
    if "eos_token" in special_tokens and backend.token_to_id(special_tokens["eos_token"]) is not None:
        eos_ids.append(backend.token_to_id(special_tokens["eos_token"]))
    for extra in ("generation_config.json", "config.json"):  # chat models list their end-of-turn ids here
        declared = _read_json(os.path.join(path, extra)).get("eos_token_id")
        eos_ids += [declared] if isinstance(declared, int) else list(declared or [])
    bos = special_tokens.get("bos_token")
    return Tokenizer(
        backend=backend,
        chat_template=chat_template,
        special_tokens=special_tokens,
        bos_token_id=backend.token_to_id(bos) if bos is not None else None,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
    )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    # Mirrors transformers' chat template environment, so templates render byte-identically.
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # jinja's own tojson escapes HTML characters, which would change the prompt text.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


# --- building a tokenizer from GGUF metadata -----------------------------------------------------

# Split regexes from llama.cpp's llama-vocab.cpp, as written in the matching HF tokenizer.json files.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2, _DIGITS = "gpt2", "digits"  # ByteLevel's built-in GPT-2 regex, optionally after one-digit splits
_LLAMA3_NAMES = ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2", "midm-2.0"]
# tokenizer.ggml.pre -> how text is split before BPE. "smollm" and friends split every digit first (HF:
# Digits(individual_digits=True) then ByteLevel; llama.cpp: "\p{N}" then the GPT-2 regex).
_PRE_TOKENIZERS = {
    **dict.fromkeys(["default", "gpt-2", "phi-2", "olmo"], _GPT2),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"], _DIGITS
    ),
    **dict.fromkeys([*_LLAMA3_NAMES, "dbrx", "smaug-bpe"], _LLAMA3),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(["gpt-4o", "llama4"], _GPT4O),
}
# llama.cpp takes a whole pre-token that is itself in the vocabulary without merging (HF: ignore_merges),
# and adds BOS when the file has no add_bos_token flag, for these.
_IGNORE_MERGES = _ADD_BOS_BY_DEFAULT = {*_LLAMA3_NAMES, "llama4"}
# Control tokens that llama.cpp also treats as end of generation, besides the declared eos/eot/eom.
_END_TEXTS = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
    "<|return|>",
    "<|call|>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",  # DeepSeek's, in full-width bars
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _pre_tokenizer(kind: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind in (_GPT2, _DIGITS))
    if kind == _GPT2:
        return byte_level
    if kind == _DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(kind), behavior="isolated"), byte_level])


def _write_hf_dir(meta: dict[str, Any], out_dir: str) -> None:
    """Build a byte-level BPE tokenizer from GGUF metadata and save it as tokenizer.json,
    tokenizer_config.json and generation_config.json in `out_dir`."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
            "use the model's Hugging Face directory instead"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")  # llama.cpp also falls back to "default"
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is unknown; known: {sorted(_PRE_TOKENIZERS)}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    backend = tokenizers.Tokenizer(
        BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
    )
    backend.pre_tokenizer = _pre_tokenizer(_PRE_TOKENIZERS[pre])
    backend.decoder = decoders.ByteLevel()
    # Added tokens are stored verbatim in the vocabulary, so adding them keeps their ids.
    typed = list(zip(tokens, types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in typed if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, k in typed if k == _USER_DEFINED]
    )

    def token_for(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    special = {name: token_for(key) for name, key in _SPECIAL_IDS.items()}
    template, specials = "$A:0", []
    add_bos = meta.get("tokenizer.ggml.add_bos_token", pre in _ADD_BOS_BY_DEFAULT)
    if add_bos and special["bos_token"] is not None:
        template = f"{special['bos_token']}:0 {template}"
        specials.append((special["bos_token"], vocab[special["bos_token"]]))
    if meta.get("tokenizer.ggml.add_eos_token", False) and special["eos_token"] is not None:
        template = f"{template} {special['eos_token']}:0"
        specials.append((special["eos_token"], vocab[special["eos_token"]]))
    backend.post_processor = processors.TemplateProcessing(single=template, special_tokens=specials)
    backend.save(os.path.join(out_dir, "tokenizer.json"))

    end_ids = [meta.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    end_ids += [i for i, (t, k) in enumerate(typed) if k == _CONTROL and t in _END_TEXTS]
    config = {name: token for name, token in special.items() if token is not None}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    generation = {"eos_token_id": list(dict.fromkeys(i for i in end_ids if i is not None))}
    for name, content in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(content, f, ensure_ascii=False, indent=1)
