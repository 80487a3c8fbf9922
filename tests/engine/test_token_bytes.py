"""Engine.token_bytes: the exact bytes of one token, from the tokenizer's vocabulary."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import (
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)

from engine.model_loader import load_embedded_tokenizer
from engine.token_bytes import TokenBytes

TEXTS = [
    "Hello, world!",
    "Accents: café, naïve, Ærøskøbing, Ελληνικά, 日本語",
    "Emoji: 🎉🚀 👩‍👩‍👧 ok",
    "\ttabs\tand\nnewlines\r\n  double  spaces \x00",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def embedded():
    return load_embedded_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_tokens_join_to_the_text(embedded, text):
    tb = TokenBytes(embedded)
    assert tb.kind == "byte_level"
    ids = embedded.encode(text)
    assert b"".join(tb(i) for i in ids) == text.encode("utf-8")


def test_byte_level_token_holding_part_of_a_character(embedded):
    tb = TokenBytes(embedded)
    ids = embedded.encode(" 日本語")
    pieces = [tb(i) for i in ids]
    # Some token is not a whole character: decode([id]) would give U+FFFD for it.
    partial = [p for p in pieces if "\ufffd" in p.decode("utf-8", errors="replace")]
    assert partial
    assert all("\ufffd" in embedded.decode([i]) or embedded.decode([i]).encode() == p
               for i, p in zip(ids, pieces, strict=True))
    # Added tokens are plain text, not byte-level characters.
    [im_start] = embedded.encode("<|im_start|>")
    assert tb(im_start) == b"<|im_start|>"


def _spm_tokenizer():
    """A SentencePiece-style (Metaspace, byte fallback) tokenizer, built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581": 1, "h": 2, "i": 3, "\u2581h": 4, "\u2581hi": 5,
             **{f"<0x{b:02X}>": 6 + b for b in range(256)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u2581", "h"), ("\u2581h", "i")],
                               unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_sentencepiece_byte_fallback_and_spaces():
    hf = _spm_tokenizer()
    wrapper = TokenizerWrapper(hf, SPMStreamingDetokenizer)
    tb = TokenBytes(wrapper)
    assert tb.kind == "sentencepiece"
    ids = hf.encode("hi 日")
    pieces = [tb(i) for i in ids]
    assert pieces[0] == b" hi"  # decode([id]) drops the leading space
    assert b"".join(pieces) == " hi 日".encode()
    assert b"\xe6" in pieces  # one byte-fallback token holds one byte of 日


def test_other_tokenizers_fall_back_to_decoding():
    hf = _spm_tokenizer()
    tb = TokenBytes(TokenizerWrapper(hf, NaiveStreamingDetokenizer))
    assert tb.kind == "other"
    [hi] = [i for i in hf.encode("hi") if hf.decode([i]) == "hi"]
    assert tb(hi) == b"hi"


def test_engine_token_bytes(make_engine):
    engine = make_engine()
    ids = engine.encode("é")
    assert [engine.token_bytes(i) for i in ids] == [b"\xc3", b"\xa9"]
