"""The runs database on PostgreSQL: what a shared database adds to the tests every dialect
runs (tests/app/db/test_db.py and the others take the db fixture on SQLite and PostgreSQL):
clear errors for URLs, servers starting and recording together, interrupted runs."""

from __future__ import annotations

import multiprocessing
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from app.db import DatabaseError, Recorder, open_database
from app.db.postgres import without_nul
from app.db.runs import get_run, list_runs
from engine.events import TokenEvent
from tests.postgres import record_as_a_server


@pytest.fixture
def pg_url(postgres_cluster):
    url = postgres_cluster.create_database()
    yield url
    postgres_cluster.drop_database(url)


def start_run(recorder: Recorder, run_id: str, session_id: int) -> None:
    recorder.run_started(run_id, session_id=session_id, source="api", endpoint="completions",
                         model="m", weights="q4", kernel_policy="auto", prompt_text="hi",
                         messages=None, prompt_token_ids=[1], params={}, queued_at=1000.0)


@pytest.mark.parametrize(("url", "problem"), [
    ("mysql://u:secret@localhost/runs", "mysql:// is not supported"),
    ("sqlite:///runs.db", "sqlite:// is not supported"),
    ("postgresql+psycopg2://u:secret@localhost/runs", "postgresql+psycopg2:// is not supported"),
    ("postgresql+psycopg://u:secret@localhost", "names no database"),
])
def test_unsupported_urls_are_clear_errors(url, problem):
    with pytest.raises(DatabaseError, match=re.escape(problem)) as info:
        open_database(url)
    assert "secret" not in str(info.value)


def test_a_missing_driver_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg fails
    with pytest.raises(DatabaseError, match=r"driver is missing.*batchscope\[postgres\]") as info:
        open_database("postgresql+psycopg://u:secret@localhost/runs")
    assert "u:***@localhost/runs" in str(info.value) and "secret" not in str(info.value)


def test_an_unreachable_server_is_a_clear_error(tmp_path):
    url = f"postgresql+psycopg://u:secret@/runs?host={tmp_path}&port=1"  # nobody listens
    with pytest.raises(DatabaseError, match="cannot use database .*u:\\*\\*\\*@.*runs") as info:
        open_database(url)
    assert "secret" not in str(info.value) and "No such file" in str(info.value)


def test_a_missing_database_or_role_is_a_clear_error(postgres_cluster):
    missing = postgres_cluster.url("no_such_db")
    with pytest.raises(DatabaseError, match='database "no_such_db" does not exist'):
        open_database(missing)
    stranger = missing.replace("postgres@", "stranger:secret@")
    with pytest.raises(DatabaseError, match='role "stranger" does not exist') as info:
        open_database(stranger)
    assert "secret" not in str(info.value)


def test_servers_starting_together_migrate_once(pg_url):
    opened: list = []
    failed: list = []

    def open_one() -> None:
        try:
            opened.append(open_database(pg_url, busy_timeout=30))
        except Exception as e:  # reported below
            failed.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert failed == [] and len(opened) == 4
    finally:
        for db in opened:
            db.close()


@contextmanager
def recording(db) -> Iterator[tuple[Recorder, int]]:
    """A started recorder on db with an engine session of its own; closed afterwards."""
    recorder = Recorder(db, flush_interval=0.01)
    recorder.start()
    try:
        yield recorder, recorder.start_session("m", "q4", "auto", {})
    finally:
        recorder.close()


def test_a_starting_server_leaves_a_live_servers_runs_alone(pg_url):
    with open_database(pg_url) as first:
        with recording(first) as (recorder, session):
            start_run(recorder, "live", session)
            assert recorder.flush()
            with open_database(pg_url) as second:
                assert second.mark_interrupted() == 0  # the first server still serves it
                assert get_run(second, "live")["status"] == "running"
    with open_database(pg_url) as third:  # the first server is gone
        assert third.mark_interrupted() == 1
        assert get_run(third, "live")["status"] == "interrupted"


def test_a_nul_in_a_tokens_text_keeps_the_run_with_the_symbol_for_null(pg_url):
    with open_database(pg_url) as db, recording(db) as (recorder, session):
        start_run(recorder, "nul", session)
        recorder.token(TokenEvent("nul", 0, 7, "a\x00b", -0.5, [], 1001.0, 1))
        assert recorder.flush()
        run = get_run(db, "nul")
    assert [(t["token_id"], t["text"]) for t in run["tokens"]] == [(7, "a\u2400b")]
    assert run["output_text"] == "a\u2400b"


def test_statements_send_no_nul():
    assert without_nul({"a": "x\x00y", "b": 3}) == {"a": "x\u2400y", "b": 3}
    assert without_nul([{"t": "\x00"}, {"t": "ok"}]) == [{"t": "\u2400"}, {"t": "ok"}]
    clean = {"a": "x", "b": b"\x00"}  # bytes are not text: left as they are
    assert without_nul(clean) is clean


def test_two_servers_record_into_one_database_and_see_each_others_runs(pg_url):
    runs = 20
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    processes = [ctx.Process(target=record_as_a_server, args=(pg_url, name, runs, barrier, out))
                 for name in ("a", "b")]
    for p in processes:
        p.start()
    results = {}
    try:
        for _ in processes:
            name, session, listed, texts = out.get(timeout=120)
            results[name] = (session, listed, texts)
    finally:
        for p in processes:
            p.join(30)
    assert [p.exitcode for p in processes] == [0, 0]
    assert results["a"][0] != results["b"][0]  # one engine session each, never shared
    expected = {f"{name}-{k}" for name in "ab" for k in range(runs)}
    for name in "ab":
        _, listed, texts = results[name]
        assert sorted(listed) == sorted(expected)  # its own runs and the other's
        assert texts == {run_id: "".join(f"{run_id[0]}{i} " for i in range(3))
                         for run_id in expected}
    with open_database(pg_url) as db:
        assert list_runs(db, model="b")["total"] == runs
        run = get_run(db, "a-0")
        assert len(run["tokens"]) == 3 and run["steps"][0]["entry"]["run_id"] == "a-0"
