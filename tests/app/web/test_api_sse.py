"""A streamed token's SSE bytes: the per-token fast path against the chunk models it stands for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.web.api.routes import _ChatShape, _CompletionShape, _sse
from engine.events import TokenEvent

TEXTS = ["hi", " there", 'a "quote" and a \\ backslash', "\n\t\r\b\f\x00\x1f\x7f",
         "café 日本語 🎉🇫🇷", "\u2028\u2029\ufffd", "</script><!--", "data: [DONE]\n\n", "{}"]


def shape(kind, include_usage: bool, model: str = "SmolLM2-135M-Instruct"):
    service = SimpleNamespace(model_name=model)
    run = SimpleNamespace(id="cmpl-0123456789abcdef01234567", created=1767225600.5)
    return kind(service, [run], False, include_usage)


def token(text: str, index: int = 0) -> TokenEvent:
    return TokenEvent("cmpl-0123456789abcdef01234567", index, 42, text, -0.5, [], 0.0, 1)


@pytest.mark.parametrize("kind", [_CompletionShape, _ChatShape])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_tokens_sse_bytes_are_its_chunk_models(kind, include_usage):
    s = shape(kind, include_usage)
    for i, text in enumerate(TEXTS):
        assert s.token_sse(token(text, i), 0) == _sse(s.token_chunk(token(text, i), 0)), text


@pytest.mark.parametrize("kind", [_CompletionShape, _ChatShape])
def test_a_token_without_text_sends_nothing(kind):
    s = shape(kind, True)
    assert s.token_sse(token(""), 0) is None and s.token_chunk(token(""), 0) is None


def test_a_model_name_holding_text_like_json_changes_nothing():
    s = shape(_CompletionShape, True, model='m "text": "x" \\ 🎉')
    assert s.token_sse(token("y"), 0) == _sse(s.token_chunk(token("y"), 0))


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_matches_its_chunk_models(text):
    for kind in (_CompletionShape, _ChatShape):
        s = shape(kind, True)
        s.token_sse(token("first"), 0)  # the frame is built once, then reused
        expected = s.token_chunk(token(text), 0)
        assert s.token_sse(token(text), 0) == (None if expected is None else _sse(expected))
