"""The single writer thread: every write to the runs database goes through here, batched.

Producers (the event loop, the engine thread) only put items on an unbounded queue, which never
blocks. The writer takes what has accumulated (up to `max_batch` items, or whatever arrived
within `flush_interval` of the first) and writes it in one transaction. If that transaction
fails, the batch is retried item by item so one bad item loses only itself. Items for a run
whose row is not written yet (its run_started was queued after its first events) are held back
and retried for `retry_window` seconds before being dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select, update

from app.db.database import Database
from app.db.models import EngineSession, Run, RunToken, Step, StepEntry
from engine.telemetry import entry_rows, step_row

log = logging.getLogger(__name__)

# Order of writes within one transaction: parents before children, tokens before finishes
# (a finish replaces the incrementally built output text with the engine's final text).
_KIND_ORDER = {"call": 0, "run": 1, "token": 2, "finish": 3, "step": 4}


def _progress(larger: Callable) -> Any:
    """A run's text and token count so far: its tokens of one batch appended."""
    return update(Run).where(Run.id == bindparam("run")).values(
        output_text=Run.output_text + bindparam("text", type_=Run.output_text.type),
        completion_tokens=larger(Run.completion_tokens,
                                 bindparam("count", type_=Run.completion_tokens.type)),
        first_token_at=func.coalesce(Run.first_token_at,
                                     bindparam("first", type_=Run.first_token_at.type)))


# The statements of every batch, built once: one built per batch cost SQLAlchemy its argument
# coercion and cache key each time, on the writer thread, which shares the GIL with the
# engine and the event loop. SQLite's two-argument max() is PostgreSQL's greatest().
_INSERT_RUN, _INSERT_TOKEN = insert(Run), insert(RunToken)
_INSERT_STEP, _INSERT_ENTRY = insert(Step), insert(StepEntry)
_PROGRESS = {"postgresql": _progress(func.greatest), "sqlite": _progress(func.max)}


@dataclass
class _Item:
    kind: str  # a key of _KIND_ORDER
    payload: Any
    queued: float = field(default_factory=time.monotonic)
    future: Future | None = None  # for "call" items: the caller waits on it

    @property
    def run_id(self) -> str | None:
        if self.kind in ("token", "finish"):
            return self.payload.request_id
        if self.kind == "run":
            return self.payload["id"]
        return None

    @property
    def needs_run(self) -> bool:
        """Written as part of a run that must already have its row."""
        return self.kind in ("token", "finish")


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


class _Stop:
    pass


class MissingRunError(LookupError):
    """An event for a run whose row has not been written (yet)."""


class Recorder:
    retry_window = 2.0  # seconds an event may wait for its run's row before it is dropped

    def __init__(self, database: Database, flush_interval: float = 0.1, max_batch: int = 500):
        if flush_interval < 0:
            raise ValueError(f"flush_interval must be >= 0, got {flush_interval}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.database = database
        self.flush_interval = flush_interval
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[_Item | _Flush | _Stop] = queue.SimpleQueue()
        # Set when something queued cannot wait for the end of the batch's window (a flush,
        # a call, close, a full batch): see _collect.
        self._urgent = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Counters, written by the writer thread only (for tests, logs and /metrics).
        self.batches = 0
        self.written = 0
        self.dropped = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("recorder already started")
        self._thread = threading.Thread(target=self._loop, name="batchscope-db-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 10) -> None:
        """Write everything queued so far, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        self._queue.put(_Stop())
        self._urgent.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("database writer did not finish within %.1f s; unwritten events are lost",
                        timeout)

    def flush(self, timeout: float = 5) -> bool:
        """Block until everything queued so far has been through the writer; False on timeout
        or when the writer is not running.

        Through means written, or dropped as bad, or held back because its run's row has not
        been queued yet (see retry_window).
        """
        if not self.running:
            return False
        marker = _Flush()
        self._queue.put(marker)
        self._urgent.set()
        return marker.done.wait(timeout)

    # ---- producers (any thread, never block) -----------------------------------------------
    def start_session(self, model: str, weights: str, kernel_policy: str, config: dict) -> int:
        """Record a server start and return its id (synchronous: called once at startup)."""
        row = {"started_at": time.time(), "model": model, "weights": weights,
               "kernel_policy": kernel_policy, "config_json": config}

        def write(conn: Connection) -> int:
            return conn.execute(insert(EngineSession).values(**row)).inserted_primary_key[0]

        if not self.running:  # no writer yet: nobody to race with
            with self.database.write_engine.begin() as conn:
                session_id = write(conn)
        else:
            future: Future = Future()
            self._queue.put(_Item("call", write, future=future))
            self._urgent.set()
            session_id = future.result(timeout=30)
        # Live while this server runs: a shared database's other servers leave its runs be.
        self.database.hold_session(session_id)
        return session_id

    def run_started(self, run_id: str, *, session_id: int, source: str, endpoint: str, model: str,
                    weights: str, kernel_policy: str, prompt_text: str, messages: list | None,
                    prompt_token_ids: list[int], params: dict, queued_at: float) -> None:
        self._put("run", {
            "id": run_id, "session_id": session_id, "created_at": time.time(), "source": source,
            "endpoint": endpoint, "model": model, "weights": weights,
            "kernel_policy": kernel_policy, "prompt_text": prompt_text, "messages_json": messages,
            "prompt_token_ids_json": list(prompt_token_ids), "params_json": params,
            "status": "running", "output_text": "", "prompt_tokens": len(prompt_token_ids),
            "completion_tokens": 0, "queued_at": queued_at,
        })

    def token(self, event) -> None:
        """An engine.events.TokenEvent."""
        self._put("token", event)

    def run_finished(self, event) -> None:
        """An engine.events.FinishEvent."""
        self._put("finish", event)

    def step(self, session_id: int, record) -> None:
        """An engine.telemetry.StepRecord (converted on the writer thread, not here)."""
        self._put("step", (session_id, record))

    def _put(self, kind: str, payload: Any) -> None:
        if self._closed:
            log.debug("recorder closed; dropping a %s event", kind)
            return
        self._queue.put(_Item(kind, payload))
        if self._queue.qsize() >= self.max_batch:
            self._urgent.set()

    # ---- the writer thread -----------------------------------------------------------------
    def _loop(self) -> None:
        held: list[_Item] = []  # waiting for their run's row
        stopping = False
        while not stopping:
            batch, markers, stopping = self._collect(wait=None if not held else self.retry_delay)
            items = held + batch
            held = []
            if items:
                try:
                    held = self._write_batch(items)
                except Exception as e:  # never let the writer die
                    log.exception("database writer: unexpected failure; %d items lost",
                                  len(items))
                    self.dropped += len(items)
                    for item in items:
                        if item.future is not None and not item.future.done():
                            item.future.set_exception(e)
            for marker in markers:
                marker.done.set()
        for item in held:
            self._drop(item, MissingRunError(f"no run {item.run_id!r} was ever recorded"))

    @property
    def retry_delay(self) -> float:
        return max(self.flush_interval, 0.05)

    def _collect(self, wait: float | None) -> tuple[list[_Item], list[_Flush], bool]:
        """Block for a first item, then gather more until the batch is full or its time is up.

        Once the queue is empty the writer sleeps out the batch's window rather than waking
        for every item (a token, a step: each wake-up takes the GIL from the engine and the
        event loop); a producer whose item cannot wait sets `_urgent`, which ends the sleep."""
        batch: list[_Item] = []
        markers: list[_Flush] = []
        try:
            first = self._queue.get(timeout=wait)
        except queue.Empty:
            return batch, markers, False
        # An item whose producer set it is already queued: the loop below reads it.
        self._urgent.clear()
        deadline = time.monotonic() + self.flush_interval
        item = first
        while True:
            if isinstance(item, _Stop):
                # Whatever is still queued was queued before close(): write it too.
                while True:
                    try:
                        rest = self._queue.get_nowait()
                    except queue.Empty:
                        return batch, markers, True
                    if isinstance(rest, _Item):
                        batch.append(rest)
                    elif isinstance(rest, _Flush):
                        markers.append(rest)
            if isinstance(item, _Flush):
                markers.append(item)
                return batch, markers, False  # write now: someone is waiting
            batch.append(item)
            if item.future is not None or len(batch) >= self.max_batch:
                return batch, markers, False
            try:
                item = self._queue.get_nowait()
                continue
            except queue.Empty:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return batch, markers, False
            self._urgent.wait(remaining)
            self._urgent.clear()
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, markers, False

    def _write_batch(self, items: list[_Item]) -> list[_Item]:
        """Write items in one transaction, or one by one if that fails. Returns items held back."""
        items.sort(key=lambda it: _KIND_ORDER[it.kind])  # stable: keeps arrival order per kind
        self.batches += 1
        try:
            self._transaction(items)
            self.written += len(items)
            return []
        except Exception as e:
            if len(items) == 1:
                return self._failed(items[0], e)
            log.warning("database writer: a batch of %d items failed (%s); retrying one by one",
                        len(items), _short(e))
        held: list[_Item] = []
        for item in items:
            try:
                self._transaction([item])
                self.written += 1
            except Exception as e:
                held.extend(self._failed(item, e))
        return held

    def _transaction(self, items: list[_Item]) -> None:
        results: list[tuple[Future, Any]] = []
        with self.database.write_engine.begin() as conn:
            _write(conn, items, results)
        for future, result in results:  # only once committed
            future.set_result(result)

    def _failed(self, item: _Item, error: Exception) -> list[_Item]:
        if (item.needs_run and time.monotonic() - item.queued < self.retry_window
                and not self._run_exists(item.run_id)):
            return [item]  # its run_started may still be on its way
        self._drop(item, error)
        return []

    def _drop(self, item: _Item, error: Exception) -> None:
        self.dropped += 1
        if item.future is not None:
            item.future.set_exception(error)
        log.error("database writer: dropped a %s item%s: %s", item.kind,
                  f" for run {item.run_id!r}" if item.run_id else "", _short(error))

    def _run_exists(self, run_id: str) -> bool:
        try:
            with self.database.read() as conn:
                return conn.execute(select(Run.id).where(Run.id == run_id)).first() is not None
        except Exception:
            return False


def _short(error: Exception) -> str:
    """The first line of an error: SQLAlchemy's messages go on to list every parameter."""
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:300]


def _write(conn: Connection, items: list[_Item], results: list[tuple[Future, Any]]) -> None:
    """The statements for a batch (already sorted by _KIND_ORDER), on one connection."""
    by_kind: dict[str, list[_Item]] = defaultdict(list)
    for item in items:
        by_kind[item.kind].append(item)
    for item in by_kind["call"]:
        fn: Callable[[Connection], Any] = item.payload
        results.append((item.future, fn(conn)))
    if by_kind["run"]:
        conn.execute(_INSERT_RUN, [item.payload for item in by_kind["run"]])
    if by_kind["token"]:
        _write_tokens(conn, [item.payload for item in by_kind["token"]])
    for item in by_kind["finish"]:
        _write_finish(conn, item.payload)
    if by_kind["step"]:
        write_steps(conn, [item.payload for item in by_kind["step"]])


def _write_tokens(conn: Connection, events: list) -> None:
    conn.execute(_INSERT_TOKEN, [
        {"run_id": e.request_id, "idx": e.index, "token_id": e.token_id, "text": e.text,
         "logprob": e.logprob, "t": e.time, "step": e.step,
         "drafted": bool(getattr(e, "drafted", False)),
         "top_logprobs_json": [list(pair) for pair in e.top_logprobs] or None}
        for e in events])
    # One UPDATE per run per batch keeps runs.output_text current, so a run whose finish
    # never arrives (the server died) still shows the text it had.
    per_run: dict[str, list] = defaultdict(list)
    for e in events:
        per_run[e.request_id].append(e)
    progress = _PROGRESS[conn.dialect.name]
    for run_id, evs in per_run.items():
        evs.sort(key=lambda e: e.index)
        result = conn.execute(progress, {"run": run_id, "text": "".join(e.text for e in evs),
                                         "count": evs[-1].index + 1, "first": evs[0].time})
        if result.rowcount == 0:
            raise MissingRunError(f"no run {run_id!r}")


def _write_finish(conn: Connection, e) -> None:
    result = conn.execute(update(Run).where(Run.id == e.request_id).values(
        status="interrupted" if e.interrupted else "finished", finish_reason=e.reason,
        error=e.error, output_text=e.text,
        output_token_ids_json=list(e.token_ids), prompt_tokens=e.prompt_tokens,
        completion_tokens=e.completion_tokens, cached_prompt_tokens=e.cached_prompt_tokens,
        preemptions=e.preemptions, first_scheduled_at=e.first_scheduled_time,
        first_token_at=e.first_token_time, finished_at=e.finish_time))
    if result.rowcount == 0:
        raise MissingRunError(f"no run {e.request_id!r}")


def write_steps(conn: Connection, payloads: list[tuple[int, Any]]) -> None:
    """Insert (session id, StepRecord or its to_dict()) pairs into steps and step_entries:
    the writer thread's steps, and app/db/experiments.py's for an experiment's sides."""
    if not payloads:
        return
    steps: list[dict] = []
    entries: list[dict] = []
    for session_id, record in payloads:
        row = step_row(record)
        steps.append({"session_id": session_id, **row})
        entries += [{"session_id": session_id, "step": row["step"], **entry}
                    for entry in entry_rows(record)]
    conn.execute(_INSERT_STEP, steps)
    if entries:
        conn.execute(_INSERT_ENTRY, entries)
