"""Divergence experiments in the runs database.

A finished experiment becomes three things, written in one transaction (as app/db/benchmarks.py
writes a benchmark run): a row in divergence_experiments with its parameters, verdict and the
whole record the /divergence page renders, and its two sides as rows of `runs` (source
"divergence", ids EXPERIMENT-a and EXPERIMENT-b) with their output tokens in run_tokens and
every step their engine ran in steps/step_entries, under an engine_sessions row per side (its
model, weights, kernel policy and configuration), so /runs, /runs/{id} and /compare show them
like served runs. The requests that ran alongside the target are step entries under ids
EXPERIMENT-a-alongside-N, not runs: filler text whose steps are already the side's (step_entries
has no foreign key to runs, and /runs stays a list of what was asked). A failed experiment is a
row with its error and no runs.

An entry is the dict the page shows: id, status, created, started, finished, params, record (a
DivergenceRecord, stored as its to_dict() and read back with from_dict()), error
(app/web/divergence_lab.py's Lab keeps the same shape in memory).
"""

from __future__ import annotations

import sqlalchemy.exc
from sqlalchemy import Connection, func, insert, select
from sqlalchemy.orm import Session

from app.db.database import Database, DatabaseError
from app.db.models import DivergenceExperiment, EngineSession, Run, RunToken
from app.db.recorder import write_steps
from app.json_safe import json_safe
from app.lab.divergence.record import DivergenceRecord, SideRecord

SOURCE = "divergence"  # runs.source of an experiment's sides
ENDPOINTS = {"web": "/divergence", "cli": "batchscope diverge"}  # runs.endpoint, by origin
PROMPT_PREVIEW = 80


def verdict_kind(record: DivergenceRecord) -> str:
    """identical (bit for bit) | same_tokens (numbers differ) | forked."""
    if record.bit_identical:
        return "identical"
    return "same_tokens" if record.identical else "forked"


def run_ids(exp_id: str) -> dict[str, str]:
    return {"a": f"{exp_id}-a", "b": f"{exp_id}-b"}


def save_experiment(db: Database, entry: dict, origin: str = "web") -> None:
    """Insert a finished ("done") or failed ("error") experiment and, if done, its two runs."""
    record: DivergenceRecord | None = entry.get("record")
    params = entry.get("params") or {}
    prompt = params.get("prompt") or (record.prompt if record is not None else None) or ""
    ids = run_ids(entry["id"]) if record is not None else {"a": None, "b": None}
    fork = record.fork if record is not None else None
    row = dict(
        id=entry["id"], created_at=entry["created"], started_at=entry.get("started"),
        finished_at=entry.get("finished"), source=origin, status=entry["status"],
        prompt_text=prompt, params_json=json_safe(params), run_a_id=ids["a"], run_b_id=ids["b"],
        verdict=verdict_kind(record) if record is not None else None,
        verdict_text=record.verdict if record is not None else None,
        fork_token_index=fork.token_index if fork else None, error=entry.get("error"),
        record_json=json_safe(record.to_dict()) if record is not None else None)
    try:
        with db.write_engine.begin() as conn:
            if record is not None:  # the runs first: the experiment's row refers to them
                for s, side in record.sides.items():
                    session_id = _write_session(conn, entry["id"], s, side)
                    conn.execute(insert(Run).values(
                        **_run_row(ids[s], s, side, record, entry, prompt, origin),
                        session_id=session_id))
                    tokens = _token_rows(ids[s], side)
                    if tokens:
                        conn.execute(insert(RunToken), tokens)
                    write_steps(conn, [(session_id, step) for step in _steps(ids[s], side)])
            conn.execute(insert(DivergenceExperiment).values(**row))
    except sqlalchemy.exc.DBAPIError as e:
        raise DatabaseError(f"cannot record the divergence experiment in {db.path}: "
                            f"{e.orig}") from e


def _kernel_policy(side: SideRecord) -> str:
    c = side.side
    return "batch-invariant" if c.batch_invariant else c.policy.describe()


def _write_session(conn: Connection, exp_id: str, s: str, side: SideRecord) -> int | None:
    """The side's engine as an engine session (its steps are keyed by it); None for a record
    from before the sides kept their engine steps."""
    steps = side.engine_steps
    if not steps:
        return None
    config = {**(side.engine or {}),
              "divergence": {"experiment": exp_id, "side": s, "config": side.config}}
    return conn.execute(insert(EngineSession).values(
        started_at=steps[0]["started_at"], model=side.model, weights=side.weights,
        kernel_policy=_kernel_policy(side), config_json=json_safe(config))
    ).inserted_primary_key[0]


def _steps(run_id: str, side: SideRecord) -> list[dict]:
    """The side's engine steps with the engine's request ids replaced by the run's id (the
    target) and RUN-alongside-N (the others), so /runs/{id} finds its steps and batch-mates."""
    ids = side.request_ids or {}
    names = {ids.get("target"): run_id,
             **{r: f"{run_id}-alongside-{i}" for i, r in enumerate(ids.get("alongside") or [])}}
    return [{**step, "entries": [{**e, "request_id": names.get(e["request_id"], e["request_id"])}
                                 for e in step["entries"]],
             "preempted": [names.get(r, r) for r in step.get("preempted") or []]}
            for step in side.engine_steps or []]


def _run_row(run_id: str, s: str, side: SideRecord, record: DivergenceRecord, entry: dict,
             prompt: str, origin: str) -> dict:
    config = side.config
    times = side.times or {}  # records from before the sides kept their times: none
    queued = times.get("queued") or entry.get("started") or entry["created"]
    chat = bool(record.chat)
    # Flat, so /compare lists which settings differ between the two sides.
    params = {"experiment": entry["id"], "side": s, "label": side.label,
              "max_tokens": record.max_tokens, "temperature": 0.0,
              "ignore_eos": record.ignore_eos, "chat": chat,
              **{k: v for k, v in config.items() if k != "label"},
              "others_joined": side.others_joined}
    return dict(
        id=run_id, created_at=queued, source=SOURCE,
        endpoint=ENDPOINTS.get(origin, origin), model=side.model, weights=side.weights,
        kernel_policy=_kernel_policy(side),
        prompt_text=prompt, messages_json=[{"role": "user", "content": prompt}] if chat else None,
        prompt_token_ids_json=list(record.prompt_ids), params_json=json_safe(params),
        status="finished", finish_reason=side.finish_reason, error=None,
        output_text=side.text, output_token_ids_json=list(side.token_ids),
        prompt_tokens=record.prompt_tokens, completion_tokens=len(side.token_ids),
        cached_prompt_tokens=0,  # the experiments' engines run without prefix caching
        preemptions=side.preemptions, queued_at=queued,
        first_scheduled_at=times.get("first_scheduled"), first_token_at=times.get("first_token"),
        finished_at=times.get("finished") or entry.get("finished"))


def _token_rows(run_id: str, side: SideRecord) -> list[dict]:
    return [{"run_id": run_id, "idx": i, "token_id": t["token_id"], "text": t["text"],
             "logprob": json_safe(t.get("logprob")),
             "top_logprobs_json": None, "t": t["time"], "step": t.get("step")}
            for i, t in enumerate(side.tokens or [])]


_LIST_COLUMNS = (DivergenceExperiment.id, DivergenceExperiment.created_at,
                 DivergenceExperiment.source, DivergenceExperiment.status,
                 DivergenceExperiment.prompt_text, DivergenceExperiment.params_json,
                 DivergenceExperiment.run_a_id, DivergenceExperiment.run_b_id,
                 DivergenceExperiment.verdict, DivergenceExperiment.verdict_text,
                 DivergenceExperiment.fork_token_index, DivergenceExperiment.error)


def list_experiments(db: Database, limit: int = 100) -> dict:
    """The latest `limit` experiments as summaries (no records), newest first; and the total."""
    with db.read() as conn:
        total = conn.execute(
            select(func.count()).select_from(DivergenceExperiment)).scalar_one()
        rows = conn.execute(select(*_LIST_COLUMNS).order_by(
            DivergenceExperiment.created_at.desc(), DivergenceExperiment.id.desc())
            .limit(limit)).mappings().all()
    return {"total": total, "experiments": [_summary(r) for r in rows]}


def _summary(r) -> dict:
    params = r["params_json"] or {}
    return {"id": r["id"], "status": r["status"], "created": r["created_at"],
            "source": r["source"], "prompt": (r["prompt_text"] or "")[:PROMPT_PREVIEW],
            "a": (params.get("a") or {}).get("label"), "b": (params.get("b") or {}).get("label"),
            "verdict": r["verdict_text"] or r["error"], "verdict_kind": r["verdict"],
            "fork_token_index": r["fork_token_index"], "runs": _runs(r), "saved": True}


def _runs(r) -> dict | None:
    if r["run_a_id"] is None and r["run_b_id"] is None:
        return None
    return {"a": r["run_a_id"], "b": r["run_b_id"]}


def get_experiment(db: Database, exp_id: str) -> dict | None:
    """One experiment as an entry (with its record), or None."""
    with db.read() as conn, Session(bind=conn) as session:
        e = session.get(DivergenceExperiment, exp_id)
        if e is None:
            return None
        return {"id": e.id, "status": e.status, "created": e.created_at,
                "started": e.started_at, "finished": e.finished_at, "source": e.source,
                "params": e.params_json or {}, "progress": [],
                "record": (DivergenceRecord.from_dict(e.record_json)
                           if e.record_json is not None else None),
                "error": e.error, "verdict_kind": e.verdict,
                "fork_token_index": e.fork_token_index,
                "runs": _runs({"run_a_id": e.run_a_id, "run_b_id": e.run_b_id}), "saved": True,
                "save_error": None}
