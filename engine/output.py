"""Turns a request's sampled tokens into text, releasing it safely around stop strings.

The text is decoded incrementally: each token costs the same whatever the length of the
output, where decoding the whole output again for every token costs O(n) a token. The full
`tokenizer.decode(ids)` stays the truth, and the incremental decode equals it on every prefix:

- Tokenizers whose text is their tokens' bytes read as UTF-8 (byte-level BPE without space
  clean-up: the embedded GGUF tokenizer, SmolLM, Qwen; the tests' byte tokenizer) stream those
  bytes (engine.token_bytes, which reads the vocabulary as mlx-lm's streaming detokenizer for
  the tokenizer does) through an incremental UTF-8 decoder: a character split across tokens
  waits in the decoder, so nothing is decoded twice.
  mlx-lm's BPEStreamingDetokenizer itself is not used: it drops the text's leading space,
  holds a lone space back a token, holds a whole token back while it ends inside a character,
  and reads the byte 0x00 as "Ā", each of which would move text from one token to another.
- Any other tokenizer (SentencePiece, clean_up_tokenization_spaces, custom decoders) decodes
  the whole output again, as before.

Which applies is decided once a tokenizer, by its vocabulary kind and a probe text that must
decode the same both ways.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

from engine.token_bytes import TokenBytes

# Leading space, clean-up targets (" ,", " .", " 's", " n't"), characters of 2, 3 and 4 bytes,
# a flag made of two characters, control characters.
_PROBE = " Hi , there . It 's 12 o'clock ! Don 't , café Ærø 日本語 🎉🇫🇷 ok?\n\t x  y "

# tokenizer -> its TokenBytes when its text streams as bytes, None when it must be re-decoded.
_BYTE_SOURCES: WeakKeyDictionary[Any, TokenBytes | None] = WeakKeyDictionary()


class _ByteStream:
    """A token's bytes in, the text so far out; a character split across tokens waits."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""

    def add(self, token_id: int) -> str:
        self._text += self._utf8.decode(self._token_bytes(token_id))
        pending = self._utf8.getstate()[0]
        # An incomplete character at the end reads as U+FFFD, as in a full decode.
        return self._text + pending.decode("utf-8", errors="replace") if pending else self._text


def _streams_as_bytes(tokenizer: Any, token_bytes: TokenBytes) -> bool:
    if token_bytes.kind not in ("own", "byte_level"):
        return False
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    ids = list(tokenizer.encode(_PROBE))
    stream = _ByteStream(token_bytes)
    return all(stream.add(t) == tokenizer.decode(ids[:i + 1]) for i, t in enumerate(ids))


def byte_source(tokenizer: Any) -> TokenBytes | None:
    """The tokenizer's TokenBytes when its text can stream as bytes, else None (cached)."""
    try:
        return _BYTE_SOURCES[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable or hashable: probe it each time
        return _probed(tokenizer)
    source = _BYTE_SOURCES[tokenizer] = _probed(tokenizer)
    return source


def _probed(tokenizer: Any) -> TokenBytes | None:
    token_bytes = TokenBytes(tokenizer)
    return token_bytes if _streams_as_bytes(tokenizer, token_bytes) else None


class OutputText:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self._decoded = ""  # tokenizer.decode(token_ids)
        self._released = 0
        source = byte_source(tokenizer)
        self._decode: Callable[[int], str] = (
            _ByteStream(source).add if source is not None
            else lambda _token_id: tokenizer.decode(self.token_ids))

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (text to release now, whether a stop string was hit)."""
        self.token_ids.append(token_id)
        self._decoded = self._decode(token_id)
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the next token.
        text = self._decoded.rstrip("\ufffd")
        stopped = False
        if self._stop:
            search_from = max(0, self._released - self._hold)
            hits = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                text, stopped = text[:min(hits)], True
        self.text = text
        safe = len(text) if stopped else len(text) - self._hold
        return self._release(safe), stopped

    def flush(self) -> str:
        """Release whatever is held back (the request is ending)."""
        if self.token_ids and not self._stop_hit_in(self._decoded):
            self.text = self._decoded
        return self._release(len(self.text))

    def _stop_hit_in(self, text: str) -> bool:
        return any(s in text for s in self._stop)

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        out = self.text[self._released:upto]
        self._released = upto
        return out
