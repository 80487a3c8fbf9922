"""Benchmark datasets: the seeded mixed set (deterministic, long-tailed, within the context)
and files (JSON lines or plain text)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.bench.dataset import MIN_INPUT, WORDS, from_file, load, mixed, token_budget


def test_mixed_is_deterministic_for_a_seed_and_differs_across_seeds():
    a, b = mixed(50, seed=7), mixed(50, seed=7)
    assert a == b
    c = mixed(50, seed=8)
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert [r.max_tokens for r in a] != [r.max_tokens for r in c]


@pytest.mark.parametrize("context,cap", [(2048, 256), (512, 64), (256, 300)])
def test_mixed_lengths_stay_within_bounds(context, cap):
    requests = mixed(400, seed=1, context=context, max_tokens_cap=cap)
    budget = token_budget(context)
    for r in requests:
        words = r.prompt.split()
        assert len(words) == r.input_len >= MIN_INPUT
        assert set(words) <= set(WORDS)
        assert 1 <= r.max_tokens <= cap
        assert r.input_len + r.max_tokens <= budget < context


def test_mixed_is_long_tailed():
    requests = mixed(1000, seed=3)
    ins = np.array([r.input_len for r in requests])
    outs = np.array([r.max_tokens for r in requests])
    # Lognormal: a median near the configured one, a tail far beyond it.
    assert 90 <= np.median(ins) <= 170
    assert np.percentile(ins, 99) > 5 * np.median(ins)
    assert np.percentile(outs, 95) > 3 * np.median(outs)
    assert len(set(ins.tolist())) > 200  # a spread, not a handful of sizes


def test_mixed_caps_prompt_length():
    assert max(r.input_len for r in mixed(200, seed=0, input_len_cap=30)) == 30


def test_mixed_rejects_impossible_arguments():
    with pytest.raises(ValueError, match="num_prompts"):
        mixed(0)
    with pytest.raises(ValueError, match="context"):
        mixed(5, context=60)


def test_jsonl_file_with_and_without_max_tokens_cycles_to_num_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "one two three", "max_tokens": 7}) + "\n\n"
                    + json.dumps({"prompt": "four"}) + "\n")
    requests = from_file(path, 5, default_max_tokens=11, max_tokens_cap=9)
    assert [(r.prompt, r.max_tokens, r.input_len) for r in requests] == [
        ("one two three", 7, 3), ("four", 9, 1), ("one two three", 7, 3), ("four", 9, 1),
        ("one two three", 7, 3)]


def test_text_file_is_one_prompt_per_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Hello there\n\n  {not json} at the start? no, a brace later\nlast one\n")
    requests = load(str(path), 2)
    assert [r.prompt for r in requests] == ["Hello there",
                                             "  {not json} at the start? no, a brace later"]
    assert all(r.max_tokens == 128 for r in requests)


@pytest.mark.parametrize("content,message", [
    ("", "no prompts"),
    ('{"prompt": "a"}\n{oops\n', ":2: not valid JSON"),
    ('{"text": "a"}\n', ':1: expected an object with a "prompt"'),
    ('{"prompt": "a", "max_tokens": 0}\n', "max_tokens must be a positive integer"),
])
def test_bad_files_say_what_and_where(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        from_file(path, 3)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(str(tmp_path / "nope.jsonl"), 3)
