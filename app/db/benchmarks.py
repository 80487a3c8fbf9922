"""Benchmark runs in the runs database (table benchmark_runs)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

import sqlalchemy.exc
from sqlalchemy import func, insert, select

from app.db.database import Database, DatabaseError
from app.db.models import BenchmarkRun
from app.json_safe import json_safe

LIST_COLUMNS = ("id", "created_at", "url", "model", "label", "endpoint", "dataset",
                "num_prompts", "request_rate", "max_concurrency", "seed", "duration_s",
                "completed", "failed")


def save_run(db: Database, *, url: str, model: str, endpoint: str, dataset: str,
             num_prompts: int, request_rate: float | None, max_concurrency: int | None,
             seed: int, summary: Mapping, requests: Sequence[Mapping],
             config: Mapping | None = None, label: str | None = None,
             created_at: float | None = None) -> int:
    """Insert one benchmark run; returns its id."""
    if request_rate is not None and not math.isfinite(request_rate):
        request_rate = None  # inf: all at once
    values = dict(
        created_at=time.time() if created_at is None else created_at, url=url, model=model,
        label=label, endpoint=endpoint, dataset=dataset, num_prompts=num_prompts,
        request_rate=request_rate, max_concurrency=max_concurrency, seed=seed,
        duration_s=float(summary["duration_s"]), completed=int(summary["completed"]),
        failed=int(summary["failed"]), config_json=json_safe(dict(config or {})),
        summary_json=json_safe(dict(summary)), requests_json=json_safe(list(requests)))
    try:
        with db.write_engine.begin() as conn:
            result = conn.execute(insert(BenchmarkRun).values(**values))
            return int(result.inserted_primary_key[0])
    except sqlalchemy.exc.DBAPIError as e:
        raise DatabaseError(f"cannot record the benchmark in {db.path}: {e.orig}") from e


def _row(run: BenchmarkRun, with_requests: bool) -> dict:
    out = {c: getattr(run, c) for c in LIST_COLUMNS}
    out["config"] = run.config_json
    out["summary"] = run.summary_json
    if with_requests:
        out["requests"] = run.requests_json
    return out


def list_runs(db: Database, limit: int = 100, with_requests: bool = False) -> dict:
    """The latest `limit` runs, newest first, and how many there are in all."""
    from sqlalchemy.orm import Session

    with db.read() as conn, Session(bind=conn) as session:
        total = session.scalar(select(func.count()).select_from(BenchmarkRun)) or 0
        runs = session.scalars(select(BenchmarkRun).order_by(BenchmarkRun.created_at.desc(),
                                                             BenchmarkRun.id.desc())
                               .limit(limit)).all()
        return {"total": total, "runs": [_row(r, with_requests) for r in runs]}


def get_run(db: Database, run_id: int) -> dict | None:
    from sqlalchemy.orm import Session

    with db.read() as conn, Session(bind=conn) as session:
        run = session.get(BenchmarkRun, run_id)
        return None if run is None else _row(run, True)
