from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model


@pytest.fixture
def make_engine():
    """Start engines on the tiny random model; all are stopped after the test."""
    engines = []

    def factory(loader=tiny_model, **config):
        config.setdefault("num_kv_blocks", 128)
        engine = Engine(EngineConfig(**config), loader=loader).start()
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.stop()
