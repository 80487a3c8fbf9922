"""The divergence lab's job queue: experiments (app/lab/divergence/) run from the browser, one at
a time, in one worker thread with engines of their own (the server's engine is busy serving).

Queued and running experiments live in memory on app.state (the Lab). A finished or failed one
is written to the runs database by the worker thread (app/db/experiments.py: the record, and
its two sides as runs with their tokens, shown on /runs and /compare), then dropped from memory:
the page lists and loads it from the database, so it survives a restart. Without a database
(or when writing fails) finished experiments stay in memory, the latest MAX_KEEP.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any

from app.db import experiments as store
from app.lab.divergence import DivergenceRecord, DivergenceRunner, SideConfig

log = logging.getLogger("batchscope.divergence")

MAX_KEEP = 32  # finished experiments kept in memory (without a database)
MAX_PENDING = 4  # queued or running; more get a 503
MAX_PROGRESS = 50


class LabBusy(RuntimeError):
    pass


class Lab:
    """Experiments by id (queued, running; finished ones without a database) and the worker
    thread that runs them and saves what finishes into `database` (None: memory only)."""

    def __init__(self, model: str = "embedded", loader: Any = None, database: Any = None):
        self.model = model
        self.loader = loader  # weights -> LoadedModel; None: the engine's loader (tests: tiny)
        self.database = database
        self._items: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._ids = itertools.count(1)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker (the app's lifespan does, at shutdown): it ends after the experiment
        it is running; one still running after `timeout` is left to finish on its daemon
        thread, and its result is not saved."""
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def submit(self, params: dict) -> str:
        with self._lock:
            if self._closed:
                raise LabBusy("the server is shutting down")
            pending = sum(1 for e in self._items.values() if e["status"] in ("queued", "running"))
            if pending >= MAX_PENDING:
                raise LabBusy(f"{pending} experiments are queued or running; try again later")
            exp_id = self._new_id()
            self._items[exp_id] = _entry(exp_id, "queued", params)
            self._trim()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="batchscope-divergence",
                                                daemon=True)
                self._thread.start()
        self._queue.put(exp_id)
        return exp_id

    def add_record(self, record: DivergenceRecord, params: dict | None = None) -> str:
        """Keep an already finished record (tests, or a record computed elsewhere)."""
        with self._lock:
            exp_id = self._new_id()
            now = time.time()
            self._items[exp_id] = _entry(exp_id, "done", params or {}, started=now,
                                         finished=now, record=record)
        self._finished(exp_id)
        return exp_id

    def get(self, exp_id: str) -> dict | None:
        """An experiment held in memory (not one already saved: see store.get_experiment)."""
        with self._lock:
            entry = self._items.get(exp_id)
            return None if entry is None else {**entry, "progress": list(entry["progress"])}

    def recent(self) -> list[dict]:
        with self._lock:
            entries = list(self._items.values())
        return [_summary(e) for e in reversed(entries)]

    def _finished(self, exp_id: str) -> None:
        """Save a finished or failed experiment, then let the database hold it; kept in memory
        when there is no database or the write fails (the page shows why)."""
        if self.database is not None:
            entry = self.get(exp_id)
            try:
                store.save_experiment(self.database, entry)
            except Exception as e:  # kept in memory instead; the worker carries on
                log.error("divergence experiment %s not saved: %s", exp_id, e)
                self._update(exp_id, save_error=str(e))
            else:
                # Dropped only once committed: a reader finds it in memory or in the database.
                with self._lock:
                    self._items.pop(exp_id, None)
                return
        with self._lock:
            self._trim()

    def _new_id(self) -> str:
        return f"div-{next(self._ids)}-{uuid.uuid4().hex[:6]}"

    def _trim(self) -> None:
        done = [k for k, e in self._items.items() if e["status"] in ("done", "error")]
        for k in done[:max(0, len(done) - MAX_KEEP)]:
            del self._items[k]

    def _update(self, exp_id: str, **changes: Any) -> None:
        with self._lock:
            entry = self._items.get(exp_id)
            if entry is not None:
                entry.update(changes)

    def _work(self) -> None:
        while True:
            exp_id = self._queue.get()
            if exp_id is None:  # close()
                return
            entry = self.get(exp_id)
            if entry is None:
                continue
            self._update(exp_id, status="running", started=time.time())

            def progress(message: str, exp_id: str = exp_id) -> None:
                with self._lock:
                    log = self._items.get(exp_id, {}).get("progress")
                    if log is not None and len(log) < MAX_PROGRESS:
                        log.append(message)

            p = entry["params"]
            try:
                with DivergenceRunner(self.loader, self.model, progress) as runner:
                    record = runner.run(p["prompt"], SideConfig.from_dict(p["a"]),
                                        SideConfig.from_dict(p["b"]), p["max_tokens"],
                                        top_k=p["top_k"], chat=p["chat"])
                self._update(exp_id, status="done", finished=time.time(), record=record)
            except Exception as e:  # shown on the page; the worker carries on
                self._update(exp_id, status="error", finished=time.time(),
                             error=f"{type(e).__name__}: {e}")
            self._finished(exp_id)


def _entry(exp_id: str, status: str, params: dict, **fields: Any) -> dict:
    """An experiment as the Lab holds it (store.get_experiment returns the same shape)."""
    return {"id": exp_id, "status": status, "created": time.time(), "started": None,
            "finished": None, "params": params, "progress": [], "record": None, "error": None,
            "source": "web", "runs": None, "saved": False, "save_error": None, **fields}


def _summary(e: dict) -> dict:
    params, record = e["params"], e["record"]

    sides = dict(record.sides.items()) if record is not None else {}

    def label(s: str) -> str | None:
        return params.get(s, {}).get("label") or (sides[s].label if s in sides else None)

    prompt = params.get("prompt") or (record.prompt if record is not None else None) or ""
    return {"id": e["id"], "status": e["status"], "created": e["created"], "source": "web",
            "prompt": prompt[:store.PROMPT_PREVIEW], "a": label("a"), "b": label("b"),
            "verdict": (record.verdict if record is not None else None) or e["error"],
            "verdict_kind": store.verdict_kind(record) if record is not None else None,
            "fork_token_index": record.fork.token_index if record and record.fork else None,
            "runs": None, "saved": False}


def lab_for(app: Any) -> Lab:
    """The app's Lab (made and closed by the lifespan: app/web/app.py)."""
    return app.state.divergence_lab


