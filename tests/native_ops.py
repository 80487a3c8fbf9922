"""The native ops (engine/native/) for tests: the op, or a skip where it is not built.

In CI (`CI` set), where scripts/setup.sh builds the kernels, their absence fails the test
instead, so a broken build cannot pass as skipped tests.
"""

from __future__ import annotations

import os

import pytest


def native_op(name: str):
    """engine.native's op `name` ("paged_decode_attention", "decode_linear")."""
    from engine import native

    op = getattr(native, name)()
    if op is None:
        if os.environ.get("CI"):
            pytest.fail(f"native kernel {native.why_not()}")
        pytest.skip(f"native kernel {native.why_not()}")
    return op
