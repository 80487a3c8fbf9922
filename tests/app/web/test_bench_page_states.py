"""/benchmarks without a database, with an empty one; the progress line on and off a tty."""

from __future__ import annotations

import io

from starlette.testclient import TestClient

from app.bench.progress import Progress
from app.db import Recorder, open_database
from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model


def make_app(recorder_factory=None):
    return create_app(Settings(engine=EngineConfig(num_kv_blocks=64)),
                      engine_factory=lambda config: Engine(config, loader=tiny_model),
                      recorder_factory=recorder_factory)


def test_without_a_database_the_page_says_so(tmp_path):
    with TestClient(make_app()) as client:
        r = client.get("/benchmarks.json")
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_database"
        assert client.get("/benchmarks").status_code == 503


def test_an_empty_database_shows_how_to_run_one(tmp_path):
    db = open_database(tmp_path / "runs.db")
    recorder = Recorder(db, flush_interval=0.01)
    recorder.start()
    try:
        with TestClient(make_app(lambda settings: recorder)) as client:
            data = client.get("/benchmarks.json").json()
            assert (data["total"], data["runs"], data["plotted"]) == (0, [], [])
            page = client.get("/benchmarks")
            assert page.status_code == 200
            assert "No benchmark runs recorded yet" in page.text
            assert "batchscope bench serve --url" in page.text
            assert client.get("/benchmarks/1").status_code == 404
    finally:
        db.close()


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_on_a_tty_and_prints_tenths_otherwise():
    tty = FakeTTY()
    p = Progress(4, tty, width=8)
    for ok in (True, False, True, True):
        p.update(ok)
    text = tty.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n")
    assert "[########] 4/4 requests, 1 failed" in text
    plain = io.StringIO()
    p = Progress(20, plain)
    for _ in range(20):
        p.update(True)
    lines = plain.getvalue().splitlines()
    assert len(lines) == 10 and "\r" not in plain.getvalue()
    assert lines[0].startswith("2/20 requests") and lines[-1].startswith("20/20 requests")
