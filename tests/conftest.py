from __future__ import annotations

import os

import pytest

from engine.config import EngineConfig
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
