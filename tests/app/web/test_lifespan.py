"""The lifespan owns every long-lived object of the app: made at startup, on app.state, and
stopped at shutdown (app/web/app.py)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from app.settings import Settings
from app.web.app import create_app
from app.web.pages.divergence import LabBusy
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model


def test_long_lived_objects_are_made_at_startup_and_stopped_at_shutdown():
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=64)),
                     engine_factory=lambda config: Engine(config, loader=tiny_model))
    with TestClient(app) as client:
        state = client.app.state
        made = {name: getattr(state, name) for name in (
            "templates", "live_runs", "step_feed", "divergence_lab", "metrics", "runs")}
        assert client.get("/dashboard").status_code == 200
        assert client.get("/metrics").status_code == 200
        # Requests use these very objects; none is replaced on first use.
        assert all(getattr(state, name) is obj for name, obj in made.items())
        engine = state.engine
    assert not engine.running
    with pytest.raises(LabBusy, match="shutting down"):
        made["divergence_lab"].submit({"prompt": "x"})
