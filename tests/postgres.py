"""A throwaway PostgreSQL cluster (Debian's postgresql package) for the runs-database tests.

initdb in a fresh temporary folder, the server on a unix socket in that folder only (no TCP),
trust authentication for the superuser `postgres`; stopped and removed afterwards. initdb and
pg_ctl refuse to run as root, so as root they run as the `postgres` user, which then owns the
folder. Outside CI a missing PostgreSQL or psycopg skips what needs them; in CI (CI set) it
fails, since a skip there would pass without checking anything (as tests/headless_chromium.py).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import uuid4

import pytest

MISSING = ("Debian's postgresql and the psycopg driver are needed (make test installs them: "
           "scripts/setup.sh)")
SUPERUSER = "postgres"


def server_bin() -> Path | None:
    """The newest installed PostgreSQL's bin folder (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit()
                   else 0)
    return found[-1].parent if found else None


def require_postgres() -> Path:
    """The server's bin folder, or a skip (a RuntimeError in CI)."""
    bin_dir = server_bin()
    try:
        import psycopg  # noqa: F401
    except ImportError:
        bin_dir = None
    if bin_dir is None:
        if os.environ.get("CI"):
            raise RuntimeError(MISSING)
        pytest.skip(MISSING)
    return bin_dir


class Cluster:
    """A running cluster; `url(name)` is a batchscope --db URL for one of its databases."""

    def __init__(self, root: Path, port: int):
        self.root = root
        self.port = port

    def url(self, name: str) -> str:
        return f"postgresql+psycopg://{SUPERUSER}@/{name}?host={self.root}&port={self.port}"

    def create_database(self) -> str:
        """A new empty database (C collation, as SQLite compares text); returns its URL."""
        name = f"t_{uuid4().hex[:12]}"
        self.sql(f"CREATE DATABASE {name} TEMPLATE template0 ENCODING 'UTF8' LOCALE 'C'")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        from sqlalchemy.engine import make_url

        name = make_url(url).database
        self.sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def sql(self, statement: str) -> None:
        import psycopg

        with psycopg.connect(host=str(self.root), port=self.port, user=SUPERUSER,
                             dbname="postgres", autocommit=True) as conn:
            conn.execute(statement)


def _free_port() -> int:
    # The socket lives in the cluster's own folder, so the port only names it; a free TCP
    # port still keeps two clusters' names apart in logs.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def cluster() -> Iterator[Cluster]:
    """Start a cluster in a new temporary folder; stop it and remove the folder afterwards."""
    bin_dir = require_postgres()
    # Under /tmp (not pytest's 0700 tree) so the postgres user can reach it; short, since a
    # unix socket's path is limited to about 100 bytes.
    root = Path(tempfile.mkdtemp(prefix="bs-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        postgres = pwd.getpwnam(SUPERUSER)
        os.chown(root, postgres.pw_uid, postgres.pw_gid)
        as_user = ["runuser", "-u", SUPERUSER, "--"]
    data, port = root / "data", _free_port()

    def run(*args: str) -> None:
        done = subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")

    started = False
    try:
        run(str(bin_dir / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust",
            "--no-locale", "-E", "UTF8", "--no-sync")
        options = (f"-p {port} -k {root} -c listen_addresses='' -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=50")
        run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"),
            "-o", options, "-w", "-t", "60", "start")
        started = True
        yield Cluster(root, port)
    finally:
        if started:
            run(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def record_as_a_server(url: str, name: str, runs: int, barrier, out) -> None:
    """A server's recording, in its own process: open the database at `url` (migrating it),
    start an engine session, record `runs` finished runs (tokens, steps) through the real
    Recorder, then, once every process has recorded, put (name, session id, every run id
    listed, each run's output text) on `out`, read as the pages read them (app/db/runs.py)."""
    import time

    from app.db import Recorder, open_database
    from app.db.runs import get_run, list_runs
    from engine.events import FinishEvent, TokenEvent
    from engine.telemetry import StepEntry, StepRecord

    barrier.wait(60)  # open and migrate together
    with open_database(url) as db:
        recorder = Recorder(db, flush_interval=0.005)
        recorder.start()
        try:
            session = recorder.start_session(name, "q4", "auto", {"server": name})
            barrier.wait(60)  # record together
            for k in range(runs):
                run_id = f"{name}-{k}"
                recorder.run_started(
                    run_id, session_id=session, source="api", endpoint="completions",
                    model=name, weights="q4", kernel_policy="auto", prompt_text=f"hi {k}",
                    messages=None, prompt_token_ids=[1, 2], params={"max_tokens": 3},
                    queued_at=time.time())
                for i in range(3):
                    recorder.token(TokenEvent(run_id, i, 10 + i, f"{name}{i} ", -0.5, [],
                                              time.time(), k + 1))
                recorder.step(session, StepRecord(
                    step=k + 1, started_at=time.time(), wall_time=0.01, model_time=0.01,
                    scheduler_time=0.0, entries=[StepEntry(run_id, "decode", 1, 3, 1, True)],
                    total_rows=1, prefill_rows=0, decode_rows=1, kv_blocks_total=8,
                    kv_blocks_used=1, kv_blocks_free=7, kv_blocks_cached=0, num_running=1,
                    num_waiting=0))
                recorder.run_finished(FinishEvent(
                    request_id=run_id, reason="length", text=f"{name}0 {name}1 {name}2 ",
                    text_delta="", token_ids=[10, 11, 12], prompt_tokens=2,
                    completion_tokens=3, cached_prompt_tokens=0, preemptions=0,
                    arrival_time=time.time(), first_scheduled_time=None,
                    first_token_time=None, finish_time=time.time()))
            assert recorder.flush(30) and recorder.dropped == 0
            barrier.wait(60)  # everyone's runs are written
            listed = [r["id"] for r in list_runs(db, per_page=500)["runs"]]
            texts = {run_id: (get_run(db, run_id) or {}).get("output_text")
                     for run_id in listed}
            out.put((name, session, listed, texts))
        finally:
            recorder.close()
