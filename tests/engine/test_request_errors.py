"""Engine.validate raises RequestError naming what the caller should change."""

from __future__ import annotations

import pytest

from engine.errors import RequestError
from engine.sampling import SamplingParams


@pytest.mark.parametrize(("prompt", "max_tokens", "param", "code", "words"), [
    ([], 1, "prompt", "invalid_value", "empty"),
    ([5, 259], 1, "prompt", "invalid_value", "[0, 259)"),
    ([5, -1], 1, "prompt", "invalid_value", "[0, 259)"),
    ([5] * 10, 503, "max_tokens", "context_length_exceeded", "10 tokens) plus max_tokens (503)"),
    ([5] * 512, 1, "prompt", "context_length_exceeded", "context window of 512"),
])
def test_context_window(make_engine, prompt, max_tokens, param, code, words):
    engine = make_engine()
    with pytest.raises(RequestError) as info:
        engine.submit(prompt, SamplingParams(max_tokens=max_tokens))
    assert (info.value.param, info.value.code) == (param, code)
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)  # callers catching ValueError keep working
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(("n_prompt", "param"), [(100, "max_tokens"), (128, "prompt")])
def test_kv_pool(make_engine, n_prompt, param):
    engine = make_engine(num_kv_blocks=8, block_size=16)  # 128 tokens of KV
    with pytest.raises(RequestError, match="needs 9 KV blocks of 16 tokens") as info:
        engine.submit([5] * n_prompt, SamplingParams(max_tokens=129 - n_prompt))
    assert info.value.param == param and info.value.code == "context_length_exceeded"
