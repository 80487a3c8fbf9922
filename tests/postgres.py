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
