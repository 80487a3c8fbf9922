"""The read side of the runs database: plain functions returning JSON-ready dicts.

Each takes a Database (a fresh connection, one snapshot) or an open Connection / Session.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection, func, or_, select, tuple_
from sqlalchemy.orm import Session

from app.db.database import Database
from app.db.models import Run, RunToken, Step, StepEntry
from app.stats import percentile
from engine.telemetry import ENTRY_COLUMNS, STEP_COLUMNS, field_name

PREVIEW_CHARS = 120
MAX_PER_PAGE = 500

Source = Database | Connection | Session


@contextmanager
def _connection(db: Source) -> Iterator[Connection | Session]:
    if isinstance(db, Database):
        with db.read() as conn:
            yield conn
    else:
        yield db


def list_runs(db: Source, *, model: str | None = None, kernel_policy: str | None = None,
              finish_reason: str | None = None, status: str | None = None, q: str | None = None,
              page: int = 1, per_page: int = 50) -> dict:
    """Newest runs first, filtered; `q` is a case-insensitive substring of prompt or output."""
    if page < 1:
        raise ValueError(f"page must be >= 1, got {page}")
    if not 1 <= per_page <= MAX_PER_PAGE:
        raise ValueError(f"per_page must be between 1 and {MAX_PER_PAGE}, got {per_page}")
    conditions = []
    if model:
        conditions.append(Run.model == model)
    if kernel_policy:
        conditions.append(Run.kernel_policy == kernel_policy)
    if finish_reason:
        conditions.append(Run.finish_reason == finish_reason)
    if status:
        conditions.append(Run.status == status)
    if q:
        pattern = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        # ILIKE on PostgreSQL, whose LIKE is case-sensitive; lower() LIKE lower() on SQLite.
        conditions.append(or_(Run.prompt_text.ilike(pattern, escape="\\"),
                              Run.output_text.ilike(pattern, escape="\\")))
    columns = [
        Run.id, Run.created_at, Run.source, Run.endpoint, Run.model, Run.weights,
        Run.kernel_policy, Run.status, Run.finish_reason, Run.prompt_tokens,
        Run.completion_tokens, Run.queued_at, Run.first_token_at, Run.finished_at,
        # Previews are cut in SQL so a page never loads whole long texts.
        func.substr(Run.prompt_text, 1, PREVIEW_CHARS + 1).label("prompt_head"),
        func.substr(Run.output_text, 1, PREVIEW_CHARS + 1).label("output_head"),
    ]
    with _connection(db) as conn:
        total = conn.execute(select(func.count()).select_from(Run).where(*conditions)).scalar_one()
        offset = (page - 1) * per_page
        # A page past the end is empty; asking SQLite for it could overflow its 64-bit OFFSET.
        rows = [] if offset >= total else conn.execute(
            select(*columns).where(*conditions)
            .order_by(Run.created_at.desc(), Run.id.desc())
            .limit(per_page).offset(offset)).mappings().all()
    runs = [{
        "id": r["id"], "created_at": r["created_at"], "source": r["source"],
        "endpoint": r["endpoint"], "model": r["model"], "weights": r["weights"],
        "kernel_policy": r["kernel_policy"], "status": r["status"],
        "finish_reason": r["finish_reason"],
        "prompt_preview": _preview(r["prompt_head"]), "output_preview": _preview(r["output_head"]),
        "prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"],
        "ttft": _diff(r["first_token_at"], r["queued_at"]),
        "e2e_latency": _diff(r["finished_at"], r["queued_at"]),
    } for r in rows]
    return {"runs": runs, "total": total, "page": page, "per_page": per_page}


def get_run(db: Source, run_id: str) -> dict | None:
    """Everything about one run: fields, tokens, the steps it took part in, and metrics."""
    with _connection(db) as conn:
        run = conn.execute(select(Run.__table__).where(Run.id == run_id)).mappings().first()
        if run is None:
            return None
        tokens = conn.execute(
            select(RunToken.__table__).where(RunToken.run_id == run_id).order_by(RunToken.idx)
        ).mappings().all()
        steps = _run_steps(conn, run_id)
    out = {_FIELD_NAMES.get(k, k): v for k, v in run.items()}
    out["tokens"] = [{
        "idx": t["idx"], "token_id": t["token_id"], "text": t["text"], "logprob": t["logprob"],
        "top_logprobs": t["top_logprobs_json"] or [], "t": t["t"], "step": t["step"],
        "drafted": bool(t["drafted"]),
    } for t in tokens]
    out["steps"] = steps
    out["metrics"] = run_metrics(out, [t["t"] for t in out["tokens"]])
    out["speculation"] = speculation_summary(steps)
    return out


def speculation_summary(steps: list[dict]) -> dict:
    """What speculative decoding did for a run, from its own step entries: the steps that
    verified drafts, the drafts, those accepted, and the acceptance rate (None: no drafts)."""
    verify = [s["entry"] for s in steps if s["entry"]["phase"] == "verify"]
    drafted = sum(e["drafted"] for e in verify)
    accepted = sum(e["accepted"] for e in verify)
    return {"verify_steps": len(verify), "drafted": drafted, "accepted": accepted,
            "rate": accepted / drafted if drafted else None}


def distinct_values(db: Source) -> dict:
    """The values the runs page's filter dropdowns offer."""
    with _connection(db) as conn:
        def values(column) -> list:
            stmt = select(column).where(column.is_not(None)).distinct().order_by(column)
            return list(conn.execute(stmt).scalars())

        return {"models": values(Run.model), "kernel_policies": values(Run.kernel_policy),
                "finish_reasons": values(Run.finish_reason)}


def run_metrics(run: dict, token_times: list[float]) -> dict:
    """Latency metrics from a run's timestamps; None where they cannot be computed.

    tpot is the mean gap between consecutive output tokens after the first, measured from the
    token timestamps (so it equals the mean inter-token latency).
    """
    gaps = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    return {
        "ttft": _diff(run.get("first_token_at"), run.get("queued_at")),
        "tpot": sum(gaps) / len(gaps) if gaps else None,
        "itl_p50": percentile(gaps, 50, method="lerp"),
        "itl_p90": percentile(gaps, 90, method="lerp"),
        "itl_p99": percentile(gaps, 99, method="lerp"),
        "e2e_latency": _diff(run.get("finished_at"), run.get("queued_at")),
        "queue_time": _diff(run.get("first_scheduled_at"), run.get("queued_at")),
    }


# ---- helpers -----------------------------------------------------------------------------------
# JSON column names drop their suffix in what callers see.
_FIELD_NAMES = {
    "messages_json": "messages", "prompt_token_ids_json": "prompt_token_ids",
    "params_json": "params", "output_token_ids_json": "output_token_ids",
    "top_logprobs_json": "top_logprobs",
}

# The run's view of a step: every stored column but the engine's cumulative prefix-cache and
# state-checkpoint counters (they describe the engine, not this run).
_CUMULATIVE = ("prefix_cache_queries", "prefix_cache_hits", "state_checkpoint_hits")
_STEP_FIELDS = [c for c in STEP_COLUMNS if c not in _CUMULATIVE]


def _run_steps(conn: Connection | Session, run_id: str) -> list[dict]:
    own = conn.execute(
        select(StepEntry.session_id, *(getattr(StepEntry, f) for f in ENTRY_COLUMNS),
               *(getattr(Step, f).label(f"s_{f}") for f in _STEP_FIELDS))
        .join(Step, (Step.session_id == StepEntry.session_id) & (Step.step == StepEntry.step))
        .where(StepEntry.run_id == run_id)
        .order_by(StepEntry.session_id, StepEntry.step)).mappings().all()
    if not own:
        return []
    keys = [(r["session_id"], r["s_step"]) for r in own]
    mates: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for chunk in _chunks(keys, 400):  # SQLite caps bound parameters per statement
        # recorded: whether the mate is a run (a divergence side's companions are not).
        rows = conn.execute(
            select(StepEntry.session_id, StepEntry.step,
                   *(getattr(StepEntry, f) for f in ENTRY_COLUMNS),
                   Run.id.is_not(None).label("recorded"))
            .outerjoin(Run, Run.id == StepEntry.run_id)
            .where(tuple_(StepEntry.session_id, StepEntry.step).in_(chunk),
                   StepEntry.run_id != run_id)
            .order_by(StepEntry.run_id)).mappings().all()
        for r in rows:
            mates[(r["session_id"], r["step"])].append(
                {**_entry(r), "recorded": bool(r["recorded"])})
    steps = []
    for r in own:
        step = {field_name(f): r[f"s_{f}"] for f in _STEP_FIELDS}
        step["session_id"] = r["session_id"]
        step["entry"] = _entry(r)
        step["batch_mates"] = mates.get((r["session_id"], r["s_step"]), [])
        steps.append(step)
    return steps


def _entry(r) -> dict:
    return {**{f: r[f] for f in ENTRY_COLUMNS}, "sampled": bool(r["sampled"])}


def _chunks(items: list, n: int) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def _preview(head: str | None) -> str:
    if not head:
        return ""
    return head if len(head) <= PREVIEW_CHARS else head[:PREVIEW_CHARS] + "…"


def _diff(end: float | None, start: float | None) -> float | None:
    return None if end is None or start is None else end - start
