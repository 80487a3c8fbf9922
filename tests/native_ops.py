"""The native ops (engine/native/) for tests: the op, or a skip where it is not built; and the
runner set-up the row-kernel tests share.

In CI (`CI` set), where scripts/setup.sh builds the kernels, their absence fails the test
instead, so a broken build cannot pass as skipped tests.
"""

from __future__ import annotations

import os

import pytest


def native_op(name: str):
    """engine.native's op `name` ("paged_attention", "decode_linear")."""
    from engine import native

    op = getattr(native, name)()
    if op is None:
        if os.environ.get("CI"):
            pytest.fail(f"native kernel {native.why_not()}")
        pytest.skip(f"native kernel {native.why_not()}")
    return op


def random(shape, seed):
    import numpy as np

    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def runner_for(model, row_kernels="auto"):
    """A ModelRunner over a small pool of the model's own shapes."""
    from engine.model_runner import ModelRunner, pool_for
    from engine.models import family_for

    family = family_for(model)
    return ModelRunner(model, pool_for(family, 64, 16), "auto", row_kernels, family)


def decode_groups(lens, first_token=40):
    """Prefill groups for sequences of these lengths, then one decode row each."""
    from engine.sampling import SamplingParams
    from engine.scheduler import RowGroup

    groups, prefill, block = [], [], 0
    for i, n in enumerate(lens):
        nb = -(-(n + 1) // 16)
        table = list(range(block, block + nb))
        block += nb
        prefill.append(RowGroup(f"s{i}", [(7 * j + i) % 200 + 3 for j in range(n)], 0, table,
                                False))
        groups.append(RowGroup(f"s{i}", [first_token + i], n, table, True, SamplingParams()))
    return prefill, groups


def samples_by_setting(model, settings=("native", "mlx")) -> dict[str, dict]:
    """Per row_kernels setting: seq_id -> (token, logprob) of one decode step of four
    sequences (after their prefill) on a fresh runner over the model."""
    results = {}
    for setting in settings:
        runner = runner_for(model, setting)
        prefill, decode = decode_groups([30, 12, 25, 3])
        runner.run(prefill)
        out = runner.run(decode).samples
        results[setting] = {k: (s[0].token_id, s[0].logprob) for k, s in out.items()}
    return results
