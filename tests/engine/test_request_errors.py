"""Engine.validate raises RequestError naming what the caller should change."""

from __future__ import annotations

import pytest

from engine.errors import RequestError
from engine.sampling import SamplingParams
from engine.testing import tiny_model


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


def _no_context_length():
    """The tiny model with a config that names no context length (as gpt_oss folders do)."""
    loaded = tiny_model()
    del loaded.config["max_position_embeddings"]
    return loaded


@pytest.mark.parametrize(("max_model_len", "limit"), [(None, 8 * 16), (100, 100)])
def test_a_config_without_a_context_length_is_bounded_by_the_pool(make_engine, max_model_len,
                                                                   limit):
    """No model limit, as in mlx-lm: the pool's capacity (or --max-model-len) bounds requests,
    where a limit of 0 once refused every request."""
    engine = make_engine(loader=_no_context_length, num_kv_blocks=8, block_size=16,
                         max_model_len=max_model_len)
    assert engine.max_model_len == limit
    done = engine.generate([5] * 20, SamplingParams(max_tokens=limit - 20, ignore_eos=True))
    assert done.reason == "length" and len(done.token_ids) == limit - 20
    with pytest.raises(RequestError, match="context_length|KV blocks|context window"):
        engine.submit([5] * 20, SamplingParams(max_tokens=limit - 19))
