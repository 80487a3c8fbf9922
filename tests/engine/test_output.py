"""OutputText: the incremental decode equals a full decode on every prefix, and stop strings,
held-back text and flush() release the same text as decoding the whole output each token."""

from __future__ import annotations

import copy
import random

import pytest
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from engine.model_loader import load_embedded_tokenizer
from engine.output import OutputText, byte_source
from engine.testing import ByteTokenizer, FixedTextTokenizer

TEXTS = [
    " Paris is the capital of France.",  # a leading space (mlx-lm's detokenizer drops it)
    "Accents: café, naïve, Ærøskøbing, Ελληνικά",
    "CJK: 日本語のテキスト, 中文, 한국어",
    "Emoji: 🎉🚀 👩‍👩‍👧 🇫🇷 ok",
    "a lone space: x y  z \t\n\n  tail ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "nul \x00 byte",
]


class Redecoding:
    """The same tokenizer, with the flag that makes OutputText decode everything each token."""

    clean_up_tokenization_spaces = True

    def __init__(self, tokenizer):
        self._inner = tokenizer

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def embedded():
    return load_embedded_tokenizer()


@pytest.fixture(params=["embedded", "bytes"])
def tokenizer(request, embedded):
    return embedded if request.param == "embedded" else ByteTokenizer()


def stream(tokenizer, ids, stop=()):
    """(delta, stopped, text) after each token, then the flush's (delta, text)."""
    out = OutputText(tokenizer, stop)
    steps = []
    for token_id in ids:
        delta, stopped = out.add(token_id)
        steps.append((delta, stopped, out.text))
        if stopped:
            break
    return steps, (out.flush(), out.text)


def encode(tokenizer, text):
    return list(tokenizer.encode(text))


def test_real_and_byte_tokenizers_stream_bytes(embedded):
    assert byte_source(embedded) is not None
    assert byte_source(ByteTokenizer()) is not None
    assert byte_source(embedded) is byte_source(embedded)  # probed once a tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_text_is_the_full_decode_on_every_prefix(tokenizer, text):
    ids = encode(tokenizer, text)
    steps, (tail, final) = stream(tokenizer, ids)
    for i, (_, stopped, shown) in enumerate(steps):
        assert not stopped
        assert shown == tokenizer.decode(ids[:i + 1]).rstrip("\ufffd")
    assert final == tokenizer.decode(ids) == text
    assert "".join(d for d, _, _ in steps) + tail == final


def test_characters_split_across_tokens(tokenizer):
    ids = encode(tokenizer, " 日本語🎉")
    partial = [i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd")]
    assert partial  # some prefix ends inside a character: its text waits for the next token
    steps, _ = stream(tokenizer, ids)
    for i in partial:
        assert "\ufffd" not in steps[i - 1][2]


def test_random_tokens_with_broken_utf8(embedded):
    """Random vocabulary entries mixed with single-byte tokens (stray continuation bytes,
    truncated characters): the streamed text is still the full decode on every prefix."""
    single_bytes = [i for i in range(len(embedded)) if len(byte_source(embedded)(i)) == 1]
    assert len(single_bytes) > 200
    rng = random.Random(0)
    for _ in range(40):
        ids = [rng.choice(single_bytes) if rng.random() < 0.6 else rng.randrange(len(embedded))
               for _ in range(40)]
        steps, (_, final) = stream(embedded, ids)
        for i, (_, _, shown) in enumerate(steps):
            assert shown == embedded.decode(ids[:i + 1]).rstrip("\ufffd")
        assert final == embedded.decode(ids)


@pytest.mark.parametrize("stop", [(), ("capital",), ("ta",), ("l o",), ("France.", "is th"),
                                  ("本語",), ("🚀",), ("x",), ("not there", "q")])
def test_stop_strings_release_as_a_full_decode_does(tokenizer, stop):
    text = " Paris is the capital of France. 日本語 🎉🚀 xyz"
    ids = encode(tokenizer, text)
    redecoding = Redecoding(tokenizer)
    assert byte_source(redecoding) is None
    assert stream(tokenizer, ids, stop) == stream(redecoding, ids, stop)
    steps, _ = stream(tokenizer, ids, stop)
    hit = [s for s in stop if s in text]
    assert steps[-1][1] == bool(hit)
    if hit:
        assert steps[-1][2] == text[:min(text.index(s) for s in hit)]


def test_tokenizer_that_cleans_up_spaces_decodes_whole(embedded):
    hf = copy.copy(embedded._tokenizer)
    hf.clean_up_tokenization_spaces = True
    hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    cleaning = TokenizerWrapper(hf, BPEStreamingDetokenizer)
    assert byte_source(cleaning) is None
    ids = encode(cleaning, "Hi , there . It 's fine !")
    steps, (_, final) = stream(cleaning, ids)
    for i, (_, _, shown) in enumerate(steps):
        assert shown == cleaning.decode(ids[:i + 1]).rstrip("\ufffd")
    assert final == "Hi, there. It's fine!"


def test_tokenizer_whose_decode_is_not_its_bytes_decodes_whole():
    tokenizer = FixedTextTokenizer("ab")
    assert byte_source(tokenizer) is None
    steps, (tail, final) = stream(tokenizer, [10, 11, 12], stop=("bab",))
    assert [(d, s) for d, s, _ in steps] == [("", False), ("a", True)]
    assert (tail, final) == ("", "a")
