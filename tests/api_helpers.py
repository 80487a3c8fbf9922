"""Shared by the API tests: an app on the tiny model, a fake recorder, error-shape checks."""

from __future__ import annotations

from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import FinishEvent, TokenEvent
from engine.testing import tiny_model

MODEL = "tiny-llama"
MAX_BODY = 8192
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


class FakeRecorder:
    """Stores every call; thread-safe enough (list appends) for the engine thread's steps."""

    def __init__(self) -> None:
        self.sessions: list[dict] = []
        self.started: list[dict] = []
        self.tokens: list[TokenEvent] = []
        self.finished: list[FinishEvent] = []
        self.steps: list[tuple] = []
        self.closed = False

    def start_session(self, model, weights, kernel_policy, config) -> int:
        self.sessions.append({"model": model, "weights": weights,
                              "kernel_policy": kernel_policy, "config": config})
        return 7

    def run_started(self, run_id, **kwargs) -> None:
        self.started.append({"run_id": run_id, **kwargs})

    def token(self, event) -> None:
        self.tokens.append(event)

    def run_finished(self, event) -> None:
        self.finished.append(event)

    def step(self, session_id, record) -> None:
        self.steps.append((session_id, record))

    def close(self) -> None:
        self.closed = True

    def finish_of(self, run_id: str) -> FinishEvent:
        return next(f for f in self.finished if f.request_id == run_id)


def make_app(recorder: FakeRecorder | None = None, engine: dict | None = None, proposer=None,
             **settings):
    config = EngineConfig(**({"num_kv_blocks": 128} | (engine or {})))
    settings = Settings(engine=config, **settings)
    return create_app(settings, engine_factory=lambda config: Engine(config, loader=tiny_model,
                                                                    proposer=proposer),
                      recorder_factory=(lambda s: recorder) if recorder else None)


def assert_error(response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    expected = {429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    assert error["type"] == expected
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error
