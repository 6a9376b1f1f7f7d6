"""Incremental detokenization: streamed deltas add up to the full text, and text is not held back."""

from __future__ import annotations

from serve.detokenizer import Detokenizer
from serve.io_struct import TokenOut
from serve.tokenizer import load_tokenizer


def _stream(detok, ids, stop=(), skip=True):
    deltas = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        out = TokenOut("r", [t], {"type": "length", "length": len(ids)} if last else None, 1, i + 1,
                       stop=stop, skip_special_tokens=skip)
        deltas.append(detok.process(out).text_delta)
    return deltas


def test_deltas_concatenate_and_replacement_chars_are_not_held_back(smollm2_gguf, cache_dir):
    tok = load_tokenizer(smollm2_gguf, cache_dir)
    detok = Detokenizer(tok)
    ids = tok.encode("Hello wörld, 東京 🙂 done")
    deltas = _stream(detok, ids)
    assert "".join(deltas) == tok.decode(ids)
    # The model may emit U+FFFD as a complete token: a run of them must stream, not arrive at the end.
    fffd = tok.encode("\ufffd")
    assert tok.decode(fffd) == "\ufffd"
    deltas = _stream(detok, fffd * 10)
    assert "".join(deltas) == "\ufffd" * 10
    assert sum(len(d) for d in deltas[:-1]) >= 5, deltas


def test_possible_stop_string_prefix_is_held_until_resolved(smollm2_gguf, cache_dir):
    tok = load_tokenizer(smollm2_gguf, cache_dir)
    detok = Detokenizer(tok)
    ids = tok.encode("The end is near")
    deltas = _stream(detok, ids, stop=("near by",))
    assert "".join(deltas) == "The end is near"


def test_the_special_token_that_ended_a_request_is_not_its_text(smollm2_gguf, cache_dir):
    """With skip_special_tokens off (tool-call markup in special tokens), special tokens the model writes
    stay in the text, but the EOS that ends the request does not; a plain stop token id stays (as vLLM)."""
    tok = load_tokenizer(smollm2_gguf, cache_dir)
    eos = tok.eos_token_id
    body = tok.encode("Hi <|im_start|> there")
    assert eos in tok.all_special_ids and tok.encode("<|im_start|>")[0] in tok.all_special_ids

    def run(ids, skip, matched):
        detok = Detokenizer(tok)
        text = ""
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            out = TokenOut("r", [t], {"type": "stop", "matched": matched} if last else None, 1, i + 1,
                           skip_special_tokens=skip)
            text += detok.process(out).text_delta
        return text

    assert run(body + [eos], False, eos) == "Hi <|im_start|> there"
    assert run(body + [eos], True, eos) == tok.decode(body)
    period = tok.encode(".")[0]
    assert run(body + [period], False, period) == "Hi <|im_start|> there."


def _full_decode_deltas(tok, ids, skip):
    """The deltas of decoding the whole output at every step (what the detokenizer did before it decoded
    incrementally): everything but at most 3 trailing U+FFFD (maybe an incomplete character) while running,
    the full decode at the end, and nothing that contradicts text already sent."""
    sent, deltas = "", []
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1], skip_special_tokens=skip)
        if i < len(ids) - 1:
            run = len(text) - len(text.rstrip("\ufffd"))
            text = text[: len(text) - min(run, 3)]
        if text.startswith(sent):
            deltas.append(text[len(sent):])
            sent = text
        else:
            deltas.append("")
    return deltas


def _check_stream(detok, ids, skip=True):
    """Streams `ids` one token a step: the deltas must be those of full decodes at every step."""
    deltas = _stream(detok, ids, skip=skip)
    assert deltas == _full_decode_deltas(detok.tokenizer, ids, skip), ids
    assert not detok.streams  # finished: nothing kept


def test_incremental_decoding_equals_full_decodes(smollm2_gguf, cache_dir):
    """Each step decodes only the new tokens after a short window (not the whole output): its deltas are
    those of full decodes at every step, for text in many scripts, split characters, special tokens and
    arbitrary ids."""
    import numpy as np

    tok = load_tokenizer(smollm2_gguf, cache_dir)
    detok = Detokenizer(tok)
    text = "Grüße, мир! 東京タワー 🙂🙃 naïve café — ∑ x² <|im_start|> done\n\n  indented\tcode()"
    _check_stream(detok, tok.encode(text))
    _check_stream(detok, tok.encode(text), skip=False)
    rng = np.random.default_rng(0)
    vocab = max(tok.all_special_ids) + 1000
    for _ in range(20):
        _check_stream(detok, [int(t) for t in rng.integers(0, vocab, 40)], skip=bool(rng.integers(2)))


def _sentencepiece_like():
    """A Llama-style tokenizer (SentencePiece BPE: "▁" for spaces, <0xXX> byte tokens for what the pieces
    miss, the decoder stripping the text's leading space), its pieces trained on a few sentences: a decoder
    whose start-of-text rule a window must not apply in the middle of an output."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    def tokenizer(model):
        t = Tokenizer(model)
        t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
        return t

    pieces = tokenizer(models.BPE(unk_token="<unk>"))
    pieces.train_from_iterator(["the cat sat on the mat", "a quick brown fox", "hello world again"] * 20,
                               trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    trained = json.loads(pieces.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    t = tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    t.add_special_tokens(["<unk>", "<s>", "</s>"])

    class Adapter:  # what Detokenizer uses of serve.tokenizer.Tokenizer
        all_special_ids = [0, 1, 2]
        vocab_size = t.get_vocab_size()

        def decode(self, ids, skip_special_tokens=True):
            return t.decode(list(ids), skip_special_tokens=skip_special_tokens)

        def encode(self, s):
            return t.encode(s).ids

    return Adapter()


def test_incremental_decoding_with_a_leading_space_rule_and_byte_fallback():
    """hypothesis: random outputs of a SentencePiece-like tokenizer (words, "▁" pieces, single UTF-8 bytes
    that may or may not form characters, specials) stream exactly what full decodes stream."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tok = _sentencepiece_like()
    words = tok.encode("the cat sat on the mat hello world é 東 🙂")
    assert tok.decode(words) == "the cat sat on the mat hello world é 東 🙂"
    assert any(3 <= t < 259 for t in words)  # byte tokens among them

    specials = tok.all_special_ids  # skipped: a window of only these has no text

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.one_of(st.sampled_from(words), st.sampled_from(specials),
                              st.integers(0, tok.vocab_size - 1)), min_size=1, max_size=30), st.booleans())
    def check(ids, skip):
        _check_stream(Detokenizer(tok), ids, skip)

    check()
