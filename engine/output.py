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
    """A token's bytes in, the text they complete out; a character split across tokens waits."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The text this token completes (not the whole text: that would cost O(n))."""
        return self._utf8.decode(self._token_bytes(token_id))

    def incomplete(self) -> str:
        """An incomplete character at the end, as a full decode reads it (U+FFFD)."""
        pending = self._utf8.getstate()[0]
        return pending.decode("utf-8", errors="replace") if pending else ""


def _streams_as_bytes(tokenizer: Any, token_bytes: TokenBytes) -> bool:
    if token_bytes.kind not in ("own", "byte_level"):
        return False
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    ids = list(tokenizer.encode(_PROBE))
    stream, text = _ByteStream(token_bytes), ""
    for i, t in enumerate(ids):
        text += stream.add(t)
        if text + stream.incomplete() != tokenizer.decode(ids[:i + 1]):
            return False
    return True


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
    """A request's text: `add` each sampled token, `flush` when the request ends.

    Only the text a stop string may still claim is kept as one string (from `_hold`
    characters before the release point on); released text is kept in pieces. So a token
    costs the same at any output length on the byte path, and `text` joins when read."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self._released: list[str] = []  # the text handed out, in pieces
        self._num_released = 0
        self._start = 0  # where the kept text starts: _hold characters before the release point
        self._decoded = ""  # the decoded text from _start on (may end in U+FFFD)
        self._shown = ""  # the text from _start on: no trailing U+FFFD, cut at a stop string
        self._stopped = False
        self._whole: str | None = None  # re-decoding tokenizers: the whole decoded text
        source = byte_source(tokenizer)
        if source is not None:
            stream = _ByteStream(source)
            self._incomplete = stream.incomplete

            def advance(token_id: int) -> None:
                self._decoded += stream.add(token_id)
        else:
            self._incomplete = lambda: ""  # the whole decode already reads it as U+FFFD

            def advance(token_id: int) -> None:
                self._whole = tokenizer.decode(self.token_ids)
                self._decoded = self._whole[self._start:]
        self._advance = advance

    @property
    def text(self) -> str:
        """The text so far: what was released and what is held back."""
        before = self._whole if self._whole is not None else "".join(self._released)
        return before[:self._start] + self._shown

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (text to release now, whether a stop string was hit)."""
        self.token_ids.append(token_id)
        self._advance(token_id)
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the next token.
        shown = self._decoded.rstrip("\ufffd")
        if self._stop:
            hits = [i for i in (shown.find(s) for s in self._stop) if i >= 0]
            if hits:
                shown, self._stopped = shown[:min(hits)], True
        self._shown = shown
        end = self._start + len(shown)
        return self._release(end if self._stopped else end - self._hold), self._stopped

    def flush(self) -> str:
        """Release whatever is held back (the request is ending)."""
        if self.token_ids and not self._stopped:
            self._shown = self._decoded + self._incomplete()
        return self._release(self._start + len(self._shown))

    def _release(self, upto: int) -> str:
        if upto <= self._num_released:
            return ""
        out = self._shown[self._num_released - self._start:upto - self._start]
        self._released.append(out)
        self._num_released = upto
        # Keep only what a stop string may still begin in.
        start = max(0, upto - self._hold)
        self._decoded = self._decoded[start - self._start:]
        self._shown = self._shown[start - self._start:]
        self._start = start
        return out
