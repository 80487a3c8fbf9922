"""The runs database: migrations, opening errors, interrupted runs and the read side."""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import stat
from dataclasses import asdict

import pytest
import sqlalchemy.exc
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.orm import Session

from app.cli.db import add_db_commands
from app.db import Database, DatabaseError, Recorder, open_database
from app.db.database import alembic_config, create_database_engine, run_migrations
from app.db.models import Base
from app.db.runs import distinct_values, get_run, list_runs, run_metrics
from engine.events import FinishEvent, TokenEvent
from engine.telemetry import RankTimes, StepEntry, StepRecord


@pytest.fixture
def recorder(db):
    rec = Recorder(db, flush_interval=0.01)
    rec.start()
    yield rec
    rec.close()


def head_revision() -> str:
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    assert len(heads) == 1, f"migrations have several heads: {heads}"
    return heads[0]


def current_revision(db: Database) -> str | None:
    with db.read() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def start_run(rec: Recorder, run_id: str, session_id: int, *, model="m", kernel_policy="auto",
              prompt="hello", queued_at=1000.0, source="api") -> None:
    rec.run_started(run_id, session_id=session_id, source=source, endpoint="completions",
                    model=model, weights="q4", kernel_policy=kernel_policy, prompt_text=prompt,
                    messages=None, prompt_token_ids=[1, 2, 3],
                    params={"max_tokens": 8, "temperature": 0.0, "stop": ["\n"]},
                    queued_at=queued_at)


def token(run_id: str, index: int, t: float, text: str | None = None, step: int = 0) -> TokenEvent:
    return TokenEvent(request_id=run_id, index=index, token_id=100 + index,
                      text=f"t{index} " if text is None else text, logprob=-0.5 * index,
                      top_logprobs=[(100 + index, -0.5 * index), (7, -3.0)], time=t, step=step)


def finish(run_id: str, *, reason="length", text="", n=0, queued=1000.0, scheduled=None,
           first=None, end=1002.0) -> FinishEvent:
    return FinishEvent(request_id=run_id, reason=reason, text=text, text_delta="",
                       token_ids=[100 + i for i in range(n)], prompt_tokens=3, completion_tokens=n,
                       cached_prompt_tokens=1, preemptions=0, arrival_time=queued,
                       first_scheduled_time=scheduled, first_token_time=first, finish_time=end)


def step_record(step: int, started: float, entries: list[tuple[str, str, int]]) -> StepRecord:
    es = [StepEntry(request_id=rid, phase=phase, rows=rows, context_len=10 + step,
                    blocks_held=1, sampled=True) for rid, phase, rows in entries]
    prefill = sum(e.rows for e in es if e.phase == "prefill")
    decode = sum(e.rows for e in es if e.phase == "decode")
    return StepRecord(step=step, started_at=started, wall_time=0.05, model_time=0.04,
                      scheduler_time=0.01, entries=es, total_rows=prefill + decode,
                      prefill_rows=prefill, decode_rows=decode, kv_blocks_total=64,
                      kv_blocks_used=len(es), kv_blocks_free=64 - len(es), kv_blocks_cached=0,
                      num_running=len(es), num_waiting=0, kernel_path="gemv",
                      linear_calls_per_layer=len(es))


# ---- migrations and opening ----
def test_open_creates_and_migrates_to_head(db_target):
    with open_database(db_target) as db:
        assert current_revision(db) == head_revision()
        tables = set(inspect(db.engine).get_table_names())
        assert {"engine_sessions", "runs", "run_tokens", "steps", "step_entries",
                "benchmark_runs", "divergence_experiments"} <= tables
        if db.postgres:
            return
        with db.read() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000


def test_reopening_is_idempotent_and_keeps_data(db_target):
    path = db_target
    with open_database(path) as db:
        session_id = Recorder(db).start_session("m", "q4", "auto", {"max_num_seqs": 4})
    for _ in range(2):
        with open_database(path) as db:
            assert current_revision(db) == head_revision()
            with db.read() as conn:
                rows = conn.exec_driver_sql("SELECT id, config_json FROM engine_sessions").all()
            assert rows == [(session_id, '{"max_num_seqs": 4}')]


def test_upgrade_from_0002_adds_divergence_experiments_and_keeps_runs(db_target):
    path = db_target
    engine = create_database_engine(path)
    try:
        run_migrations(engine, "0002")  # a database written before divergence experiments
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text(
                "INSERT INTO runs (id, created_at, source, endpoint, model, weights, "
                "kernel_policy, prompt_text, prompt_token_ids_json, params_json, status, "
                "output_text, prompt_tokens, completion_tokens, queued_at) VALUES ('old-run', "
                "1.0, 'api', '/v1/completions', 'm', 'q4', 'gemm', 'hi', '[1]', '{}', "
                "'finished', 'there', 1, 1, 1.0)"))
        assert "divergence_experiments" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    with open_database(path) as db:
        assert current_revision(db) == head_revision()
        columns = {c["name"] for c in inspect(db.engine).get_columns("divergence_experiments")}
        assert {"id", "created_at", "started_at", "finished_at", "status", "params_json",
                "run_a_id", "run_b_id", "verdict", "fork_token_index", "error",
                "record_json"} <= columns
        foreign = inspect(db.engine).get_foreign_keys("divergence_experiments")
        assert sorted(fk["constrained_columns"][0] for fk in foreign) == ["run_a_id", "run_b_id"]
        assert {fk["referred_table"] for fk in foreign} == {"runs"}
        with db.read() as conn:
            assert conn.exec_driver_sql("SELECT output_text FROM runs").scalar() == "there"
        insert = sqlalchemy.text(
            "INSERT INTO divergence_experiments (id, created_at, source, status, prompt_text, "
            "params_json, run_a_id, run_b_id) VALUES (:id, 1.0, 'web', 'done', 'hi', '{}', "
            ":a, :b)")
        with db.write_engine.begin() as conn:
            conn.execute(insert, {"id": "d1", "a": "old-run", "b": "old-run"})
        # The run ids are foreign keys: a missing run is refused.
        with pytest.raises(sqlalchemy.exc.IntegrityError):
            with db.write_engine.begin() as conn:
                conn.execute(insert, {"id": "d2", "a": "no-such-run", "b": None})


def test_upgrade_from_0004_adds_speculation_columns_and_old_rows_read_as_no_drafts(db_target):
    path = db_target
    engine = create_database_engine(path)
    try:
        run_migrations(engine, "0004")  # a database written before speculative decoding
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO engine_sessions (id, started_at, model, weights, kernel_policy, "
                "config_json) VALUES (1, 1.0, 'm', 'q4', 'gemm', '{}')")
            conn.exec_driver_sql(
                "INSERT INTO runs (id, session_id, created_at, source, endpoint, model, "
                "weights, kernel_policy, prompt_text, prompt_token_ids_json, params_json, "
                "status, output_text, prompt_tokens, completion_tokens, queued_at) VALUES "
                "('old-run', 1, 1.0, 'api', '/v1/completions', 'm', 'q4', 'gemm', 'hi', '[1]', "
                "'{}', 'finished', 'x', 1, 1, 1.0)")
            conn.exec_driver_sql(
                "INSERT INTO run_tokens (run_id, idx, token_id, text, t, step) VALUES "
                "('old-run', 0, 120, 'x', 1.5, 1)")
            insert_old_step(conn)
            conn.exec_driver_sql(
                "INSERT INTO step_entries (session_id, step, run_id, phase, rows, "
                "context_len, blocks_held, sampled) VALUES (1, 1, 'old-run', 'prefill', 1, 1, "
                "1, true)")
        assert "drafted" not in {c["name"] for c in inspect(engine).get_columns("run_tokens")}
    finally:
        engine.dispose()
    with open_database(path) as db:
        assert current_revision(db) == head_revision()
        columns = {t: {c["name"] for c in inspect(db.engine).get_columns(t)}
                   for t in ("run_tokens", "steps", "step_entries")}
        assert "drafted" in columns["run_tokens"]
        assert {"verify_rows", "draft_tokens", "accepted_tokens", "speculation"} \
            <= columns["steps"]
        assert {"drafted", "accepted"} <= columns["step_entries"]
        run = get_run(db, "old-run")
    assert run["output_text"] == "x" and run["tokens"][0]["drafted"] is False
    [step] = run["steps"]
    assert (step["verify_rows"], step["draft_tokens"], step["accepted_tokens"],
            step["speculation"]) == (0, 0, 0, "")
    assert (step["entry"]["drafted"], step["entry"]["accepted"]) == (0, 0)
    assert run["speculation"] == {"verify_steps": 0, "drafted": 0, "accepted": 0,
                                  "rate": None}


def old_database(path, revision: str, missing: str):
    """A database migrated to `revision` only, with a session and one step of its columns;
    `missing`: a steps column a later revision adds (checked absent)."""
    engine = create_database_engine(path)
    try:
        run_migrations(engine, revision)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO engine_sessions (id, started_at, model, weights, kernel_policy, "
                "config_json) VALUES (1, 1.0, 'm', 'q4', 'gemm', '{}')")
            insert_old_step(conn)
        assert missing not in {c["name"] for c in inspect(engine).get_columns("steps")}
    finally:
        engine.dispose()


def record_after_upgrade(path, run_id: str, record, columns: list[str]) -> tuple[list, dict]:
    """Open an old database (migrating it to head), record a run with one step, and return
    (every step row's step and `columns`, the run's step as its page reads it)."""
    with open_database(path) as db:
        assert current_revision(db) == head_revision()
        assert set(columns) <= {c["name"] for c in inspect(db.engine).get_columns("steps")}
        recorder = Recorder(db, flush_interval=0.01)
        recorder.start()
        try:
            start_run(recorder, run_id, 1)
            recorder.step(1, record)
            assert recorder.flush()
        finally:
            recorder.close()
        with db.read() as conn:
            stored = conn.execute(sqlalchemy.text(
                f"SELECT step, {', '.join(columns)} FROM steps ORDER BY step")).all()
        [step] = get_run(db, run_id)["steps"]
    return [tuple(r) for r in stored], step


def insert_old_step(conn) -> None:
    """One step row as a database before 0005 holds it (its columns only)."""
    conn.exec_driver_sql(
        "INSERT INTO steps (session_id, step, started_at, wall_time, model_time, "
        "scheduler_time, total_rows, prefill_rows, decode_rows, kv_blocks_total, "
        "kv_blocks_used, kv_blocks_free, kv_blocks_cached, num_running, num_waiting, "
        "kernel_path, linear_calls_per_layer, prefix_cache_queries, prefix_cache_hits, "
        "preempted_json) VALUES "
        "(1, 1, 1.2, 0.1, 0.1, 0.0, 1, 1, 0, 8, 1, 7, 0, 1, 0, 'gemm', 1, 0, 0, '[]')")


STATE_POOL = {"state_slots_total": 4, "state_slots_used": 3, "state_checkpoints": 5,
              "state_checkpoint_capacity": 16, "state_checkpoint_hits": 2,
              "state_slot_bytes": 3 * 2**31}  # past 32 bits


def test_upgrade_from_0005_adds_the_state_pool_and_old_steps_read_as_none(db_target):
    path = db_target
    old_database(path, "0005", "state_slots_total")  # written before the state pool
    hybrid = step_record(2, 1000.0, [("H", "prefill", 3)])
    for name, value in STATE_POOL.items():
        setattr(hybrid, name, value)
    stored, step = record_after_upgrade(path, "H", hybrid, list(STATE_POOL))
    assert stored == [(1, 0, 0, 0, 0, 0, 0), (2, *STATE_POOL.values())]
    # The run's view has the pool as the step ran, not the engine's cumulative hit count.
    assert {k: step[k] for k in STATE_POOL if k in step} == \
        {k: v for k, v in STATE_POOL.items() if k != "state_checkpoint_hits"}
    assert "state_checkpoint_hits" not in step


def test_upgrade_from_0008_adds_the_ranks_and_old_steps_read_as_none(db_target):
    path = db_target
    old_database(path, "0008", "ranks_json")  # written before tensor parallelism's ranks
    sharded = step_record(2, 1000.0, [("R", "decode", 1)])
    sharded.ranks = [RankTimes(0, 0.02, 0.019, 0.001, 0.004),
                     RankTimes(1, 0.021, 0.02, 0.003, 0.005)]
    stored, step = record_after_upgrade(path, "R", sharded, ["ranks_json"])
    assert [(n, None if v is None else json.loads(v)) for n, v in stored] == [
        (1, None), (2, [asdict(t) for t in sharded.ranks])]
    assert step["ranks"] == [asdict(t) for t in sharded.ranks]  # the run page's steps


def test_upgrade_from_0006_adds_constrained_rows_and_mask_time(db_target):
    path = db_target
    old_database(path, "0006", "mask_ms")  # written before the steps' grammar masks
    constrained = step_record(2, 1000.0, [("C", "decode", 1)])
    constrained.constrained_rows, constrained.mask_ms = 1, 0.375
    stored, step = record_after_upgrade(path, "C", constrained, ["constrained_rows", "mask_ms"])
    assert stored == [(1, 0, 0.0), (2, 1, 0.375)]
    assert (step["constrained_rows"], step["mask_ms"]) == (1, 0.375)  # the run page's steps
    # And back down: 0006's steps table, its rows kept.
    engine = create_database_engine(path)
    try:
        with engine.begin() as conn:
            config = alembic_config()
            config.attributes["connection"] = conn
            command.downgrade(config, "0006")
        assert "mask_ms" not in {c["name"] for c in inspect(engine).get_columns("steps")}
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM steps").scalar() == 2
    finally:
        engine.dispose()


def test_drafted_tokens_and_verify_entries_are_stored_and_read_back(db, recorder):
    session = recorder.start_session("m", "q4", "auto", {"speculative": "ngram"})
    start_run(recorder, "S", session)
    start_run(recorder, "T", session)
    prefill = step_record(1, 1000.1, [("S", "prefill", 3), ("T", "prefill", 3)])
    # Step 2: S verifies 3 drafts and keeps 2 (3 tokens); T verifies 2 and keeps none.
    verify = StepRecord(**{**prefill.__dict__, "step": 2, "started_at": 1000.2, "entries": [
        StepEntry("S", "verify", 4, 7, 1, True, drafted=3, accepted=2),
        StepEntry("T", "verify", 3, 4, 1, True, drafted=2, accepted=0)],
        "total_rows": 7, "prefill_rows": 0, "verify_rows": 7, "draft_tokens": 5,
        "accepted_tokens": 2, "speculation": "on"})
    recorder.step(session, prefill)
    recorder.step(session, verify)
    recorder.token(token("S", 0, 1000.15, step=1))
    for i, drafted in ((1, True), (2, True), (3, False)):
        recorder.token(TokenEvent("S", i, 100 + i, f"t{i}", -0.1, [], 1000.25, 2, drafted))
    recorder.run_finished(finish("S", text="t0t1t2t3", n=4, first=1000.15, end=1000.3))
    assert recorder.flush()
    run = get_run(db, "S")
    assert [t["drafted"] for t in run["tokens"]] == [False, True, True, False]
    second = run["steps"][1]
    assert second["entry"] == {"run_id": "S", "phase": "verify", "rows": 4, "context_len": 7,
                               "blocks_held": 1, "sampled": True, "drafted": 3, "accepted": 2}
    assert (second["verify_rows"], second["draft_tokens"], second["accepted_tokens"],
            second["speculation"]) == (7, 5, 2, "on")
    [mate] = second["batch_mates"]
    assert (mate["run_id"], mate["phase"], mate["drafted"], mate["accepted"]) == \
        ("T", "verify", 2, 0)
    # The run's own acceptance, from its entries only (not its batch-mate's).
    assert run["speculation"] == {"verify_steps": 1, "drafted": 3, "accepted": 2,
                                  "rate": pytest.approx(2 / 3)}
    assert get_run(db, "T")["speculation"]["rate"] == 0.0


def test_an_infinite_top_logprob_reads_back_as_written(db, recorder):
    """A token a grammar masked has a -inf logprob; PostgreSQL's json type refuses infinities,
    so its JSON columns are text, as on SQLite."""
    session = recorder.start_session("m", "q4", "auto", {})
    start_run(recorder, "N", session)
    recorder.token(TokenEvent("N", 0, 5, "x", -0.25, [(5, -0.25), (6, float("-inf"))], 1000.5, 1))
    assert recorder.flush()
    assert get_run(db, "N")["tokens"][0]["top_logprobs"] == [[5, -0.25], [6, float("-inf")]]
    assert recorder.dropped == 0


def test_schema_matches_models(db):
    with db.read() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_db_upgrade_command(db_target, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_db_commands(parser.add_subparsers(dest="command", required=True))
    path = db_target
    args = parser.parse_args(["db", "upgrade", "--db", str(path)])
    assert args.func(args) == 0
    assert head_revision() in capsys.readouterr().out
    with open_database(path, migrate=False) as db:
        assert current_revision(db) == head_revision()
    args = parser.parse_args(["db", "upgrade", "--db", str(tmp_path / "missing" / "x.db")])
    assert args.func(args) == 2
    assert "does not exist" in capsys.readouterr().err


def test_missing_directory_is_a_clear_error(tmp_path):
    path = tmp_path / "no" / "such" / "runs.db"
    with pytest.raises(DatabaseError, match="directory .* does not exist") as info:
        open_database(path)
    assert str(path) in str(info.value)


def test_read_only_file_is_a_clear_error(tmp_path):
    path = tmp_path / "runs.db"
    open_database(path).close()
    os.chmod(path, stat.S_IRUSR | stat.S_IRGRP)
    try:
        with pytest.raises(DatabaseError, match="read-only") as info:
            open_database(path)
        assert str(path) in str(info.value)
    finally:
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


def test_locked_file_is_a_clear_error(tmp_path):
    path = tmp_path / "runs.db"
    other = sqlite3.connect(path, isolation_level=None)  # another process, in effect
    try:
        other.execute("CREATE TABLE t (x)")
        other.execute("BEGIN EXCLUSIVE")
        other.execute("INSERT INTO t VALUES (1)")
        with pytest.raises(DatabaseError, match="locked") as info:
            open_database(path, busy_timeout=0.1)
        assert str(path) in str(info.value)
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_not_a_database_is_a_clear_error(tmp_path):
    path = tmp_path / "runs.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(DatabaseError, match="not a valid SQLite database"):
        open_database(path)


# ---- recorded runs read back ----
def test_get_run_returns_tokens_steps_and_metrics(db, recorder):
    session = recorder.start_session("m", "q4", "auto", {})
    start_run(recorder, "A", session, queued_at=1000.0, prompt="tell me")
    start_run(recorder, "B", session, queued_at=1000.1)
    start_run(recorder, "C", session, queued_at=1000.3)
    times = [1000.5, 1000.6, 1000.8, 1001.1]  # gaps 0.1, 0.2, 0.3
    for i, t in enumerate(times):
        recorder.token(token("A", i, t, step=i + 1))
    # X was never recorded as a run (a divergence side's companions are such mates).
    recorder.step(session, step_record(1, 1000.2, [("A", "prefill", 5), ("B", "prefill", 3),
                                                    ("X", "prefill", 2)]))
    recorder.step(session, step_record(2, 1000.55, [("A", "decode", 1), ("B", "decode", 1),
                                                    ("C", "prefill", 4)]))
    recorder.step(session, step_record(3, 1000.7, [("B", "decode", 1)]))  # without A
    recorder.run_finished(finish("A", reason="length", text="t0 t1 t2 t3 ", n=4, queued=999.9,
                                 scheduled=1000.2, first=1000.5, end=1001.2))
    assert recorder.flush()

    run = get_run(db, "A")
    assert run["status"] == "finished" and run["finish_reason"] == "length"
    assert run["output_text"] == "t0 t1 t2 t3 "
    assert run["output_token_ids"] == [100, 101, 102, 103]
    assert run["prompt_token_ids"] == [1, 2, 3]
    assert run["params"] == {"max_tokens": 8, "temperature": 0.0, "stop": ["\n"]}
    assert run["messages"] is None
    assert (run["prompt_tokens"], run["completion_tokens"]) == (3, 4)
    assert run["cached_prompt_tokens"] == 1 and run["preemptions"] == 0
    assert run["queued_at"] == 1000.0  # the app's queue time, not the engine's arrival
    assert [t["idx"] for t in run["tokens"]] == [0, 1, 2, 3]
    assert run["tokens"][2] == {"idx": 2, "token_id": 102, "text": "t2 ", "logprob": -1.0,
                                "top_logprobs": [[102, -1.0], [7, -3.0]], "t": 1000.8, "step": 3,
                                "drafted": False}

    assert [s["step"] for s in run["steps"]] == [1, 2]
    first, second = run["steps"]
    assert first["entry"] == {"run_id": "A", "phase": "prefill", "rows": 5, "context_len": 11,
                              "blocks_held": 1, "sampled": True, "drafted": 0, "accepted": 0}
    assert [(m["run_id"], m["recorded"]) for m in first["batch_mates"]] == [
        ("B", True), ("X", False)]
    assert [(m["run_id"], m["phase"]) for m in second["batch_mates"]] == [
        ("B", "decode"), ("C", "prefill")]
    assert second["total_rows"] == 6 and second["prefill_rows"] == 4
    assert second["kernel_path"] == "gemv" and second["preempted"] == []

    m = run["metrics"]
    assert m["ttft"] == pytest.approx(0.5)
    assert m["tpot"] == pytest.approx(0.2)
    assert m["itl_p50"] == pytest.approx(0.2)
    assert m["itl_p90"] == pytest.approx(0.28)
    assert m["itl_p99"] == pytest.approx(0.298)
    assert m["e2e_latency"] == pytest.approx(1.2)
    assert m["queue_time"] == pytest.approx(0.2)

    b = get_run(db, "B")  # still running: no finish, no tokens
    assert b["status"] == "running" and b["tokens"] == [] and len(b["steps"]) == 3
    assert b["metrics"] == {k: None for k in m}
    assert get_run(db, "nope") is None


def test_metrics_with_one_token():
    m = run_metrics({"queued_at": 1.0, "first_token_at": 1.5, "finished_at": 1.6}, [1.5])
    assert m["ttft"] == 0.5 and m["tpot"] is None and m["itl_p50"] is None
    assert m["e2e_latency"] == pytest.approx(0.6) and m["queue_time"] is None


def test_mark_interrupted_keeps_text_and_tokens(db_target):
    path = db_target
    with open_database(path) as db:
        rec = Recorder(db)
        rec.start()
        session = rec.start_session("m", "q4", "auto", {})
        start_run(rec, "cut", session)
        start_run(rec, "done", session)
        for i in range(3):
            rec.token(token("cut", i, 1000.5 + i))
            rec.token(token("done", i, 1000.5 + i))
        rec.run_finished(finish("done", reason="stop", text="final", n=3, first=1000.5))
        rec.close()  # the server stops; "cut" never finishes

    with open_database(path) as db:  # the next start
        assert db.mark_interrupted() == 1
        assert db.mark_interrupted() == 0
        cut = get_run(db, "cut")
        assert cut["status"] == "interrupted" and cut["finish_reason"] is None
        assert cut["output_text"] == "t0 t1 t2 "
        assert cut["completion_tokens"] == 3 and len(cut["tokens"]) == 3
        assert cut["first_token_at"] == 1000.5
        assert cut["metrics"]["ttft"] == pytest.approx(0.5)
        assert cut["metrics"]["e2e_latency"] is None
        done = get_run(db, "done")
        assert done["status"] == "finished" and done["output_text"] == "final"
        assert list_runs(db, status="interrupted")["total"] == 1


# ---- listing and filtering ----
@pytest.fixture
def listed(db, recorder):
    session = recorder.start_session("m", "q4", "auto", {})
    specs = [  # id, model, kernel_policy, finish reason (None: still running), prompt
        ("r0", "small", "auto", "stop", "the cat sat"),
        ("r1", "small", "gemv", "length", "a dog ran"),
        ("r2", "big", "auto", "stop", "100% sure"),
        ("r3", "big", "gemm", None, "under_score"),
        ("r4", "small", "auto", "cancelled", "x" * 500),
        ("r5", "big", "auto", "length", "CATS and dogs"),
        ("r6", "small", "gemv", "stop", "plain"),
    ]
    for rid, model, policy, reason, prompt in specs:
        start_run(recorder, rid, session, model=model, kernel_policy=policy, prompt=prompt)
        recorder.token(token(rid, 0, 1000.4, text=f"out-{rid}"))
        if reason:
            recorder.run_finished(finish(rid, reason=reason, text=f"out-{rid} done", n=1,
                                         first=1000.4, end=1001.0))
        assert recorder.flush()  # one at a time, so created_at orders them
    return db


def test_list_runs_newest_first_with_summary(listed):
    page = list_runs(listed)
    assert page["total"] == 7 and page["page"] == 1 and page["per_page"] == 50
    assert [r["id"] for r in page["runs"]] == ["r6", "r5", "r4", "r3", "r2", "r1", "r0"]
    r5 = page["runs"][1]
    assert r5["model"] == "big" and r5["finish_reason"] == "length" and r5["status"] == "finished"
    assert r5["prompt_preview"] == "CATS and dogs" and r5["output_preview"] == "out-r5 done"
    assert r5["ttft"] == pytest.approx(0.4) and r5["e2e_latency"] == pytest.approx(1.0)
    assert (r5["prompt_tokens"], r5["completion_tokens"]) == (3, 1)
    assert set(r5) >= {"id", "created_at", "source", "endpoint", "weights", "kernel_policy"}
    r4 = page["runs"][2]
    assert len(r4["prompt_preview"]) == 121 and r4["prompt_preview"].endswith("…")
    r3 = page["runs"][3]
    assert r3["status"] == "running" and r3["output_preview"] == "out-r3"
    assert r3["e2e_latency"] is None


def test_list_runs_filters(listed):
    def ids(**kw):
        return [r["id"] for r in list_runs(listed, **kw)["runs"]]

    assert ids(model="big") == ["r5", "r3", "r2"]
    assert ids(kernel_policy="gemv") == ["r6", "r1"]
    assert ids(finish_reason="stop") == ["r6", "r2", "r0"]
    assert ids(model="small", finish_reason="stop") == ["r6", "r0"]
    assert ids(status="running") == ["r3"]
    assert ids(q="cat") == ["r5", "r0"]  # case-insensitive, in the prompt
    assert ids(q="out-r2") == ["r2"]  # in the output
    assert ids(q="0%") == ["r2"]  # % and _ are literal characters
    assert ids(q="r_s") == ["r3"]
    assert ids(q="nothing like this") == []


def test_list_runs_pagination(listed):
    pages = [list_runs(listed, page=p, per_page=3) for p in (1, 2, 3, 4)]
    assert [[r["id"] for r in p["runs"]] for p in pages] == [
        ["r6", "r5", "r4"], ["r3", "r2", "r1"], ["r0"], []]
    assert all(p["total"] == 7 for p in pages)
    assert list_runs(listed, model="small", page=2, per_page=2)["total"] == 4
    with pytest.raises(ValueError, match="page"):
        list_runs(listed, page=0)
    with pytest.raises(ValueError, match="per_page"):
        list_runs(listed, per_page=0)


def test_distinct_values(listed):
    assert distinct_values(listed) == {
        "models": ["big", "small"], "kernel_policies": ["auto", "gemm", "gemv"],
        "finish_reasons": ["cancelled", "length", "stop"]}


def test_queries_accept_a_connection_or_session_and_return_json(listed):
    with listed.read() as conn:
        assert list_runs(conn, per_page=1)["total"] == 7
        assert get_run(conn, "r0")["id"] == "r0"
    with Session(listed.engine) as session:
        assert distinct_values(session)["models"] == ["big", "small"]
        run = get_run(session, "r1")
    assert json.loads(json.dumps(run)) == run
    assert json.loads(json.dumps(list_runs(listed)))["total"] == 7


def test_steps_are_stored_and_read_back_field_by_field(db, recorder):
    """Every stored StepRecord field reaches the run's view of the step under its own name (the
    engine's cumulative prefix-cache and checkpoint counters and in-memory fields stay out); a
    to_dict() saved before later fields existed reads with their defaults."""
    session = recorder.start_session("m", "q4", "auto", {})
    start_run(recorder, "A", session)
    full = step_record(1, 1000.0, [("A", "verify", 3)])
    full.entries[0].drafted, full.entries[0].accepted, full.entries[0].emitted = 2, 1, 2
    full.preempted, full.error, full.expert_rows = ["Z"], "boom", {"0": [1, 2]}
    full.verify_rows, full.draft_tokens, full.accepted_tokens = 3, 2, 1
    full.speculation, full.propose_time, full.prefix_cache_queries = "on", 0.5, 9
    full.constrained_rows, full.mask_ms = 3, 0.25
    full.overlapped, full.discarded_rows = True, 2
    full.ranks = [RankTimes(0, 0.04, 0.035, 0.001, 0.006),
                  RankTimes(1, 0.041, 0.036, 0.002, 0.007)]
    for name, value in STATE_POOL.items():
        setattr(full, name, value)
    old = step_record(2, 1000.1, [("A", "decode", 1)]).to_dict()
    for newer in ("verify_rows", "draft_tokens", "accepted_tokens", "speculation", "kernel_path",
                  "linear_calls_per_layer", "prefix_cache_queries", "prefix_cache_hits",
                  "expert_rows", "preempted", "error", *STATE_POOL, "constrained_rows",
                  "mask_ms", "ranks", "overlapped", "discarded_rows"):
        del old[newer]
    for entry in old["entries"]:
        del entry["drafted"], entry["accepted"], entry["emitted"]
    recorder.step(session, full)
    recorder.step(session, old)
    assert recorder.flush()

    first, second = get_run(db, "A")["steps"]
    common = {"session_id": session, "started_at": 1000.0, "wall_time": 0.05,
              "model_time": 0.04, "scheduler_time": 0.01, "total_rows": 0, "prefill_rows": 0,
              "decode_rows": 0, "kv_blocks_total": 64, "kv_blocks_used": 1, "kv_blocks_free": 63,
              "kv_blocks_cached": 0, "num_running": 1, "num_waiting": 0, "batch_mates": []}
    assert first == {**common, "step": 1, "kernel_path": "gemv", "linear_calls_per_layer": 1,
                     "preempted": ["Z"], "error": "boom", "expert_rows": {"0": [1, 2]},
                     "verify_rows": 3, "draft_tokens": 2, "accepted_tokens": 1,
                     "speculation": "on", "state_slots_total": 4, "state_slots_used": 3,
                     "state_checkpoints": 5, "state_checkpoint_capacity": 16,
                     "state_slot_bytes": 3 * 2**31, "constrained_rows": 3, "mask_ms": 0.25,
                     "ranks": [{"rank": 0, "wall_s": 0.04, "model_s": 0.035,
                                "broadcast_s": 0.001, "all_sum_s": 0.006},
                               {"rank": 1, "wall_s": 0.041, "model_s": 0.036,
                                "broadcast_s": 0.002, "all_sum_s": 0.007}],
                     "overlapped": True, "discarded_rows": 2,
                     "entry": {"run_id": "A", "phase": "verify", "rows": 3, "context_len": 11,
                               "blocks_held": 1, "sampled": True, "drafted": 2, "accepted": 1}}
    assert second == {**common, "step": 2, "started_at": 1000.1, "decode_rows": 1,
                      "total_rows": 1, "kernel_path": "gemm", "linear_calls_per_layer": 1,
                      "preempted": [], "error": None, "expert_rows": None, "verify_rows": 0,
                      "draft_tokens": 0, "accepted_tokens": 0, "speculation": "",
                      "state_slots_total": 0, "state_slots_used": 0, "state_checkpoints": 0,
                      "state_checkpoint_capacity": 0, "state_slot_bytes": 0,
                      "constrained_rows": 0, "mask_ms": 0.0, "ranks": None,
                      "overlapped": False, "discarded_rows": 0,
                      "entry": {"run_id": "A", "phase": "decode", "rows": 1, "context_len": 12,
                                "blocks_held": 1, "sampled": True, "drafted": 0, "accepted": 0}}
    with db.read() as conn:
        stored = conn.exec_driver_sql(
            "SELECT prefix_cache_queries, prefix_cache_hits, state_checkpoint_hits FROM steps "
            "ORDER BY step").all()
    assert [tuple(r) for r in stored] == [(9, 0, 2), (0, 0, 0)]


def test_benchmark_runs_are_saved_listed_and_read_back(db):
    from app.db import benchmarks

    summary = {"duration_s": 2.5, "completed": 2, "failed": 0, "ttft_p50": float("nan")}
    common = dict(url="http://x/v1", model="m", endpoint="completions", dataset="mixed",
                  num_prompts=2, max_concurrency=None, summary=summary,
                  requests=[{"ok": True, "itl": [0.1, 0.2]}, {"ok": True, "itl": []}])
    first = benchmarks.save_run(db, request_rate=float("inf"), seed=2**40, label="all at once",
                                created_at=1.0, **common)
    second = benchmarks.save_run(db, request_rate=4.0, seed=0, created_at=2.0, **common)
    assert first != second
    listing = benchmarks.list_runs(db)
    assert listing["total"] == 2 and [r["id"] for r in listing["runs"]] == [second, first]
    run = benchmarks.get_run(db, first)
    assert (run["seed"], run["request_rate"], run["label"]) == (2**40, None, "all at once")
    assert run["summary"]["ttft_p50"] is None and run["requests"] == common["requests"]
    assert benchmarks.get_run(db, 999) is None
