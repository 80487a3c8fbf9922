"""The exact bytes one token stands for.

`tokenizer.decode([id])` is wrong for logprobs: a byte-level BPE token may hold part of a UTF-8
character (decoded alone it becomes U+FFFD), and SentencePiece tokens lose their leading space.
The bytes come from the tokenizer's own vocabulary instead, read the way mlx-lm's streaming
detokenizer for that tokenizer reads it:

- byte-level BPE (GPT-2 style: the embedded GGUF tokenizer, SmolLM, Llama 3, Qwen): each
  character of the vocabulary entry stands for one byte (GPT-2's bytes_to_unicode table);
  added tokens written in plain text (`<|im_start|>`) keep their UTF-8 bytes.
- SentencePiece: `<0xNN>` byte-fallback tokens are that byte; U+2581 is a space.
- anything else: the token decoded alone, as UTF-8 (the best the tokenizer offers).

A tokenizer may also provide `token_bytes(id)` itself (the tests' byte tokenizer does).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

_SPM_SPACE = "\u2581".encode()


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: vocabulary character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    n = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + n)] = b
            n += 1
    return table


def _byte_level(token: str) -> bytes:
    decoder = _gpt2_byte_decoder()
    out = bytearray()
    for ch in token:
        b = decoder.get(ch)
        if b is None:
            out += ch.encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _sentencepiece(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.encode("utf-8").replace(_SPM_SPACE, b" ")


def vocabulary_kind(tokenizer: Any) -> str:
    """"byte_level", "sentencepiece" or "other", from the detokenizer mlx-lm chose for it."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

    detokenizer = getattr(tokenizer, "_detokenizer", None)
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        return "byte_level"
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        return "sentencepiece"
    return "other"


class TokenBytes:
    """token id -> bytes for one tokenizer (cached; safe to call from any thread)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        own = getattr(type(tokenizer), "token_bytes", None)
        self._own = own is not None
        self._kind = "own" if self._own else vocabulary_kind(tokenizer)
        self._cache: dict[int, bytes] = {}
        # Added tokens (<|im_start|>, ...) are stored as plain text in any vocabulary.
        self._added: set[int] = set()
        if self._kind != "other":
            try:
                self._added = set(tokenizer.added_tokens_decoder)
            except Exception:  # not an HF tokenizer after all: read every entry as the kind says
                self._added = set()

    @property
    def kind(self) -> str:
        return self._kind

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._lookup(token_id)
        return cached

    def _lookup(self, token_id: int) -> bytes:
        tok = self._tokenizer
        if self._own:
            return bytes(tok.token_bytes(token_id))
        if self._kind != "other":
            token = tok.convert_ids_to_tokens(token_id)
            if isinstance(token, str):
                if token_id in self._added:
                    return token.encode("utf-8")
                return _byte_level(token) if self._kind == "byte_level" else _sentencepiece(token)
        return tok.decode([token_id]).encode("utf-8")
