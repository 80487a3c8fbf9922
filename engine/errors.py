"""Errors the engine raises to its callers, typed so they need not read the messages."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot serve as asked.

    param: what the caller should change, in the engine's terms: "prompt" (empty, token ids
    out of range, or too long on its own), "max_tokens" (the prompt fits, but not with this
    many new tokens), "logit_bias" (a token id out of the vocabulary) or "structured" (a
    schema, regex or grammar the library cannot compile: engine/structured.py). code:
    "invalid_value" or "context_length_exceeded".
    """

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
