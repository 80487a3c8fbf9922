"""An exception inside one engine step, end to end: a real uvicorn server, the tiny model, a real
SQLite runs database.

Four requests (three streamed, one plain JSON) share the step that fails; a fifth waits in the
queue. The four must get an error (an SSE error chunk then [DONE]; a 500 in OpenAI's error
shape: an engine failure is the server's fault, not the client's), the database must record an
`error` finish with the message for each, the waiting request and a new one must be served
correctly (same greedy text as before the fault), and no KV block may stay held.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import httpx
import pytest
from live_server import serving

from app.cli.serve import runs_recorder
from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model

FAULT = "injected fault in this step"
IN_STEP = 4  # requests sharing the failing step (max_num_seqs): 3 streamed, 1 plain JSON


def sse_events(response: httpx.Response) -> list:
    """The data payloads of an SSE response, JSON-decoded ([DONE] stays a string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def db_runs(path) -> dict[str, dict]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return {r["id"]: dict(r) for r in conn.execute(
            "SELECT id, status, finish_reason, error, output_text, completion_tokens FROM runs")}
    finally:
        conn.close()


def wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Fault:
    """Installed where a step can fail; raises once, in the first step where all IN_STEP
    requests are decoding (each has streamed tokens already) and another request waits."""

    def __init__(self, engine: Engine, where: str):
        self.engine, self.where = engine, where
        self.armed = False
        self.fired_step: int | None = None
        self.victims: set[str] = set()
        self.decoding = threading.Event()  # all IN_STEP requests are decoding
        if where == "before_forward":
            engine.before_forward = self.check
        else:  # after the model wrote this step's keys and values into the KV pool
            runner = engine.runner
            real_launch = runner.launch

            def launch_then_fail(*args, **kwargs):
                pending = real_launch(*args, **kwargs)
                real_result = pending.result

                def result(since=None):
                    out = real_result(since)
                    self.check(None)
                    return out

                pending.result = result
                return pending

            runner.launch = launch_then_fail

    def check(self, plan) -> None:
        if not self.armed or self.fired_step is not None:
            return
        scheduler = self.engine.scheduler
        running = list(scheduler.running)
        ready = (len(running) == IN_STEP
                 and all(s.in_decode and len(s.output_ids) >= 4 for s in running))
        if ready:
            self.decoding.set()
        if ready and scheduler.waiting:
            # The plan's own number: a step launched ahead (engine/lookahead.py) is launched
            # while the one before it still runs.
            self.fired_step = plan.step if plan is not None else self.engine.step_count
            self.victims = {s.seq_id for s in running}
            raise RuntimeError(FAULT)
        time.sleep(0.01)  # slow the steps down so the test's fifth request arrives in time


@pytest.mark.parametrize("where", ["before_forward", "after_forward"])
def test_a_failed_step_errors_its_requests_records_them_and_the_server_goes_on(tmp_path, where):
    db_path = tmp_path / "runs.db"
    engines: list[Engine] = []

    def engine_factory(config):
        engines.append(Engine(config, loader=tiny_model))
        return engines[-1]

    settings = Settings(db_path=str(db_path),
                        engine=EngineConfig(num_kv_blocks=128, max_num_seqs=IN_STEP))
    app = create_app(settings, engine_factory=engine_factory, recorder_factory=runs_recorder)
    body = {"prompt": "reference prompt", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        engine = engines[0]
        reference = client.post("/v1/completions", json=body)
        assert reference.status_code == 200
        reference_text = reference.json()["choices"][0]["text"]
        fault = Fault(engine, where)
        fault.armed = True

        long = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
        streams: list[list] = [[] for _ in range(IN_STEP - 1)]
        plain: dict = {}

        def stream(i: int) -> None:
            with client.stream("POST", "/v1/completions",
                               json={"prompt": f"stream {i}", "stream": True, **long}) as r:
                assert r.status_code == 200
                streams[i].extend(sse_events(r))

        def post_plain() -> None:
            r = client.post("/v1/completions", json={"prompt": "plain", **long})
            plain["status"], plain["body"] = r.status_code, r.json()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(IN_STEP - 1)]
        threads.append(threading.Thread(target=post_plain))
        for t in threads:
            t.start()
        assert fault.decoding.wait(30), "the four requests never decoded together"
        waiting = {}

        def post_waiting() -> None:  # max_num_seqs is full: this one waits in the queue
            r = client.post("/v1/completions", json=body)
            waiting["status"], waiting["body"] = r.status_code, r.json()

        threads.append(threading.Thread(target=post_waiting))
        threads[-1].start()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert fault.fired_step is not None, "the fault never fired"
        assert len(fault.victims) == IN_STEP

        # Streams: some tokens, then one error chunk in OpenAI's shape, then [DONE]; no finish.
        for events in streams:
            assert events[-1] == "[DONE]"
            error = events[-2]["error"]
            assert FAULT in error["message"] and error["type"] == "server_error"
            # Text came before the error (a token may hold back a partial UTF-8 character, so
            # chunks can be fewer than tokens).
            assert any(e["choices"][0]["text"] for e in events[:-2])
            assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
        # Plain JSON: a server error in OpenAI's shape, never a 200 with a truncated text.
        assert plain["status"] == 500
        assert plain["body"]["error"]["code"] == "engine_error"
        assert FAULT in plain["body"]["error"]["message"]
        # The waiting request was not in the failed step: served, and correctly.
        assert waiting["status"] == 200
        assert waiting["body"]["choices"][0]["text"] == reference_text
        # A new request after the fault: same greedy text as before it.
        after = client.post("/v1/completions", json=body)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == reference_text

        # The database: an error finish with the message for each request of the failed step.
        def recorded():
            runs = db_runs(db_path)
            done = len(runs) == IN_STEP + 3 and all(r["status"] == "finished"
                                                    for r in runs.values())
            return runs if done else None

        runs = wait_for(recorded, what="every run's finish in the database")
        for victim in fault.victims:
            run = runs[victim]
            assert run["finish_reason"] == "error", run
            assert FAULT in run["error"]
            assert run["completion_tokens"] >= 4 and run["output_text"]
        others = [r for i, r in runs.items() if i not in fault.victims]
        assert len(others) == 3 and all(r["finish_reason"] == "length" for r in others)
        assert all(r["output_text"] == reference_text for r in others)

        # No KV block leaked: only evictable prefix-cache blocks may remain.
        bm = engine.block_manager
        wait_for(lambda: not engine.scheduler.has_work(), what="the engine to go idle")
        bm.check_invariants()
        assert bm.num_used_blocks == 0, f"{bm.num_used_blocks} KV blocks still held"
        kv = client.get("/dashboard.json").json()["state"]["kv"]
        assert kv["used"] == 0 and kv["requests"] == []
        failed = [r for r in engine.steps.recent(1000) if r.error]
        assert [r.step for r in failed] == [fault.fired_step] and FAULT in failed[0].error
