"""The single writer thread: batching, draining, bad items, late runs, concurrent use."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from sqlalchemy import event, text

from app.db import Recorder
from app.db.runs import get_run, list_runs
from engine.events import FinishEvent, TokenEvent
from engine.telemetry import (
    ENTRY_COLUMNS,
    STEP_COLUMNS,
    RankTimes,
    StepEntry,
    StepRecord,
    entry_rows,
    step_row,
)


@pytest.fixture
def commits(db):
    """How many transactions were committed (reads never commit)."""
    count = [0]

    def on_commit(_conn) -> None:
        count[0] += 1

    event.listen(db.engine, "commit", on_commit)
    yield count
    event.remove(db.engine, "commit", on_commit)


def start_run(rec: Recorder, run_id: str, session_id: int, params: dict | None = None) -> None:
    rec.run_started(run_id, session_id=session_id, source="api", endpoint="chat", model="m",
                    weights="q4", kernel_policy="auto", prompt_text="hi",
                    messages=[{"role": "user", "content": "hi"}], prompt_token_ids=[1, 2],
                    params=params or {"max_tokens": 4}, queued_at=time.time())


def token(run_id: str, index: int) -> TokenEvent:
    return TokenEvent(request_id=run_id, index=index, token_id=index, text=f"{index},",
                      logprob=-1.0, top_logprobs=[], time=1000.0 + index, step=index)


def finish(run_id: str, n: int) -> FinishEvent:
    return FinishEvent(request_id=run_id, reason="length", text="".join(f"{i}," for i in range(n)),
                       text_delta="", token_ids=list(range(n)), prompt_tokens=2,
                       completion_tokens=n, cached_prompt_tokens=0, preemptions=0,
                       arrival_time=999.0, first_scheduled_time=999.5, first_token_time=1000.0,
                       finish_time=1000.0 + n)


def step_record(step: int, run_ids: list[str]) -> StepRecord:
    entries = [StepEntry(request_id=r, phase="decode", rows=1, context_len=5, blocks_held=1,
                         sampled=True) for r in run_ids]
    return StepRecord(step=step, started_at=1000.0 + step, wall_time=0.01, model_time=0.008,
                      scheduler_time=0.002, entries=entries, total_rows=len(entries),
                      prefill_rows=0, decode_rows=len(entries), kv_blocks_total=8,
                      kv_blocks_used=1, kv_blocks_free=7, kv_blocks_cached=0,
                      num_running=len(entries), num_waiting=0)


def count(db, table: str) -> int:
    with db.read() as conn:
        return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()


def test_many_events_are_written_in_few_transactions(db, commits):
    rec = Recorder(db, flush_interval=0.2, max_batch=500)
    session = rec.start_session("m", "q4", "auto", {})  # before start(): written directly
    start_run(rec, "A", session)
    for i in range(1000):
        rec.token(token("A", i))
    rec.run_finished(finish("A", 1000))
    commits[0] = 0
    rec.start()  # everything is already queued: batches of max_batch
    assert rec.flush()
    assert count(db, "run_tokens") == 1000
    assert commits[0] <= 4, commits[0]  # 1002 items: 3 batches (plus slack)
    run = get_run(db, "A")
    assert run["status"] == "finished" and run["completion_tokens"] == 1000
    assert run["output_text"] == "".join(f"{i}," for i in range(1000))
    assert rec.written == 1002 and rec.dropped == 0
    rec.close()


def test_a_request_the_engine_lost_under_it_is_recorded_interrupted(db):
    """A tensor-parallel rank lost mid-request: the engine finishes it with an error and
    interrupted=True, and its run is recorded as a dead server's would be."""
    rec = Recorder(db, flush_interval=0.01)
    rec.start()
    try:
        session = rec.start_session("m", "q4", "auto", {})
        for run_id, interrupted in (("lost", True), ("failed", False)):
            start_run(rec, run_id, session)
            rec.token(token(run_id, 0))
            rec.run_finished(replace(finish(run_id, 1), reason="error", interrupted=interrupted,
                                     error="rank 1 exited (signal SIGKILL)"))
        assert rec.flush()
    finally:
        rec.close()
    lost, failed = get_run(db, "lost"), get_run(db, "failed")
    assert (lost["status"], lost["finish_reason"]) == ("interrupted", "error")
    assert lost["error"] == "rank 1 exited (signal SIGKILL)" and lost["output_text"] == "0,"
    assert failed["status"] == "finished"


def test_events_arriving_over_time_are_grouped_by_interval(db, commits):
    rec = Recorder(db, flush_interval=0.3)
    rec.start()
    session = rec.start_session("m", "q4", "auto", {})
    start_run(rec, "A", session)
    commits[0] = 0
    started = time.monotonic()
    for i in range(200):  # ~0.2 s of events, one every millisecond
        rec.token(token("A", i))
        time.sleep(0.001)
    elapsed = time.monotonic() - started
    assert rec.flush()
    assert count(db, "run_tokens") == 200
    # One transaction per interval (plus the flush's), however slow the machine is today.
    assert commits[0] <= elapsed / 0.3 + 2, (commits[0], elapsed)
    rec.close()


def test_close_drains_everything_without_waiting_for_the_interval(db):
    rec = Recorder(db, flush_interval=30)
    rec.start()
    session = rec.start_session("m", "q4", "auto", {})
    start_run(rec, "A", session)
    for i in range(300):
        rec.token(token("A", i))
    for s in range(50):
        rec.step(session, step_record(s, ["A"]))
    started = time.monotonic()
    rec.close()
    assert time.monotonic() - started < 5
    assert not rec.running
    assert count(db, "run_tokens") == 300 and count(db, "steps") == 50
    assert count(db, "step_entries") == 50
    rec.token(token("A", 300))  # after close: dropped quietly, never blocks
    assert rec.flush() is False


def test_a_bad_item_does_not_lose_the_rest_of_its_batch(db):
    rec = Recorder(db, flush_interval=0.5)
    rec.retry_window = 0  # an event for an unknown run is dropped at once
    session = rec.start_session("m", "q4", "auto", {})
    start_run(rec, "A", session)
    for i in range(10):
        rec.token(token("A", i))
    rec.token(token("A", 3))  # duplicate position: primary key violation
    start_run(rec, "B", session, params={"stop": {"not", "json"}})  # a set: cannot serialize
    rec.token(token("ghost", 0))  # no such run
    rec.step(session, step_record(1, ["A", "ghost"]))
    rec.run_finished(finish("A", 10))
    rec.start()
    assert rec.flush()
    assert rec.dropped == 3
    run = get_run(db, "A")
    assert run["status"] == "finished" and len(run["tokens"]) == 10
    assert count(db, "steps") == 1 and count(db, "step_entries") == 2
    assert get_run(db, "B") is None
    # The writer is still alive and writing.
    start_run(rec, "C", session)
    assert rec.flush()
    assert get_run(db, "C")["status"] == "running"
    rec.close()


def test_events_queued_before_their_run_are_held_until_it_arrives(db):
    rec = Recorder(db, flush_interval=0.01)
    rec.start()
    session = rec.start_session("m", "q4", "auto", {})
    rec.token(token("late", 0))  # run_started lost the race with the first token
    assert rec.flush()
    assert count(db, "run_tokens") == 0 and rec.dropped == 0
    start_run(rec, "late", session)
    rec.token(token("late", 1))
    rec.run_finished(finish("late", 2))
    assert rec.flush()
    run = get_run(db, "late")
    assert [t["idx"] for t in run["tokens"]] == [0, 1]
    assert run["status"] == "finished" and rec.dropped == 0
    rec.close()


def test_events_for_a_run_that_never_arrives_are_dropped_after_the_window(db):
    rec = Recorder(db, flush_interval=0.01)
    rec.retry_window = 0.2
    rec.start()
    rec.token(token("never", 0))
    rec.run_finished(finish("never", 1))
    deadline = time.monotonic() + 5
    while rec.dropped < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rec.dropped == 2
    rec.close()


def test_writer_survives_an_unexpected_failure(db, monkeypatch):
    rec = Recorder(db, flush_interval=0.01)
    rec.start()
    session = rec.start_session("m", "q4", "auto", {})

    def explode(items):
        raise RuntimeError("boom")

    monkeypatch.setattr(rec, "_write_batch", explode)
    start_run(rec, "lost", session)
    assert rec.flush()
    monkeypatch.undo()
    start_run(rec, "kept", session)
    assert rec.flush()
    assert get_run(db, "kept") is not None and get_run(db, "lost") is None
    rec.close()


def test_concurrent_producers_and_readers(db):
    rec = Recorder(db, flush_interval=0.02)
    rec.start()
    session = rec.start_session("m", "q4", "auto", {})
    runs = [f"run{i}" for i in range(4)]
    for r in runs:
        start_run(rec, r, session)
    errors: list[BaseException] = []
    done = threading.Event()

    def produce(run_id: str) -> None:
        try:
            for i in range(300):
                rec.token(token(run_id, i))
                if i % 50 == 0:
                    rec.step(session, step_record(1000 * runs.index(run_id) + i, [run_id]))
                    time.sleep(0.001)
        except BaseException as e:
            errors.append(e)

    def read() -> None:
        try:
            while not done.is_set():
                list_runs(db, q="1,")
                get_run(db, runs[0])
        except BaseException as e:
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    producers = [threading.Thread(target=produce, args=(r,)) for r in runs]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    assert rec.flush(timeout=20)
    done.set()
    reader.join()
    assert errors == []
    assert rec.dropped == 0
    assert count(db, "run_tokens") == 1200 and count(db, "steps") == 24
    for r in runs:
        assert get_run(db, r)["output_text"] == "".join(f"{i}," for i in range(300))
    rec.close()


def test_a_step_and_its_saved_dict_give_the_same_rows():
    """step_row and entry_rows read a live StepRecord by its fields in column order, and an
    older version's to_dict() by name: the two must agree, column for column."""
    record = replace(step_record(7, ["a", "b"]), preempted=["c"], expert_rows={"0": [1, 2]},
                     ranks=[RankTimes(rank=0, wall_s=0.01, model_s=0.008, broadcast_s=0.001)],
                     speculation="ngram", overlapped=True, discarded_rows=1)
    record.entries[1] = replace(record.entries[1], phase="verify", rows=3, drafted=2,
                                accepted=1, emitted=2)
    row = step_row(record)
    assert list(row) == list(STEP_COLUMNS)
    assert row == step_row(record.to_dict())
    assert row["step"] == 7 and row["preempted_json"] == ["c"] and row["overlapped"] is True
    assert row["ranks_json"] == [{"rank": 0, "wall_s": 0.01, "model_s": 0.008,
                                  "broadcast_s": 0.001, "all_sum_s": None}]
    entries = entry_rows(record)
    assert [list(e) for e in entries] == [list(ENTRY_COLUMNS)] * 2
    assert entries == entry_rows(record.to_dict())
    assert entries[1]["run_id"] == "b" and entries[1]["drafted"] == 2
    assert "emitted" not in entries[1] and "entries" not in row
