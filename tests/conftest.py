from __future__ import annotations

import os

import pytest

from engine.config import EngineConfig, NativeSetting
from engine.engine import Engine
from engine.testing import tiny_model


@pytest.fixture(autouse=True, scope="session")
def _no_machine_calibration(tmp_path_factory):
    """`batchscope serve` and `generate` give the engine the calibrations saved on this machine
    (~/.cache/batchscope): tests must not pick up one someone ran here."""
    old = os.environ.get("BATCHSCOPE_CALIBRATION_DIR")
    os.environ["BATCHSCOPE_CALIBRATION_DIR"] = str(tmp_path_factory.mktemp("calibration"))
    yield
    if old is None:
        os.environ.pop("BATCHSCOPE_CALIBRATION_DIR", None)
    else:
        os.environ["BATCHSCOPE_CALIBRATION_DIR"] = old


@pytest.fixture(autouse=True, scope="session")
def _kernels_as_on_a_gpu():
    """BATCHSCOPE_TEST_KERNELS=mlx: every engine's `auto` attention and row kernels mean MLX's
    own ops, as on a GPU backend (engine/native_ops.py), so the CPU runs the engine code a GPU
    runs (scripts/gpu-check.sh --cpu); a test that asks for "native" still gets it."""
    value = os.environ.get("BATCHSCOPE_TEST_KERNELS", "auto")
    if value == NativeSetting.AUTO:
        yield
        return
    if value != NativeSetting.MLX:
        raise pytest.UsageError(f"BATCHSCOPE_TEST_KERNELS must be auto or mlx, got {value!r}")
    checked = EngineConfig.__post_init__

    def post_init(self) -> None:
        for name in ("attention", "row_kernels"):
            if getattr(self, name) == NativeSetting.AUTO:
                setattr(self, name, NativeSetting.MLX)
        checked(self)

    EngineConfig.__post_init__ = post_init
    yield
    EngineConfig.__post_init__ = checked


@pytest.fixture
def make_engine():
    """Start engines on the tiny random model; all are stopped after the test."""
    engines = []

    def factory(loader=tiny_model, proposer=None, draft_loader=None, **config):
        config.setdefault("num_kv_blocks", 128)
        engine = Engine(EngineConfig(**config), loader=loader, proposer=proposer,
                        draft_loader=draft_loader).start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.stop()
