"""`batchscope serve` and `batchscope db upgrade` on a database they cannot use: one clear line
naming the path and the problem, exit status 2, no traceback, and (serve) before loading the model.

The tests run as root here, for whom chmod does not stop a write. A read-only file or directory
is therefore made immutable (`chattr +i`), which the kernel enforces for root too; as another
user plain chmod is used. Either way the test first checks that a write really fails, and skips
(saying why) only when the system cannot produce the condition.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.db import open_database

ROOT = Path(__file__).resolve().parents[3]


def batchscope(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True)


COMMANDS = {
    # --port 9: nothing is ever bound, serve must stop before it gets that far.
    "serve": lambda db: ("serve", "--db", str(db), "--port", "9", "--weights", "q4"),
    "db upgrade": lambda db: ("db", "upgrade", "--db", str(db)),
}


def assert_clear_failure(command: str, db: Path, problem: str) -> None:
    started = time.monotonic()
    result = batchscope(*COMMANDS[command](db))
    elapsed = time.monotonic() - started
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("batchscope: error")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert str(db) in errors[0] and problem in errors[0], errors[0]
    if command == "serve":
        assert "KV pool allocated" not in result.stderr  # the model was never loaded
        assert elapsed < 30


@contextlib.contextmanager
def read_only(path: Path):
    """Make `path` (file or directory) really refuse writes, then restore it."""
    mode = path.stat().st_mode
    if os.geteuid() == 0:
        made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot make {path.name} read-only for root: chattr +i failed "
                        f"({made.stderr.strip()}); chmod does not bind root")
        undo = ["chattr", "-i", str(path)]
    else:
        os.chmod(path, mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        undo = None
    try:
        probe = path / "probe" if path.is_dir() else path
        with pytest.raises(PermissionError):  # the condition really holds
            with open(probe, "ab"):
                pass
        yield
    finally:
        if undo:
            subprocess.run(undo, check=True)
        os.chmod(path, mode)


def migrated(tmp_path: Path) -> Path:
    path = tmp_path / "runs.db"
    open_database(path).close()
    return path


# `serve` starts the whole server process (~3 s each): the slow tier, which CI runs.
@pytest.fixture(params=[pytest.param(c, marks=pytest.mark.slow) if c == "serve" else c
                        for c in sorted(COMMANDS)])
def command(request) -> str:
    return request.param


def test_missing_directory(tmp_path, command):
    assert_clear_failure(command, tmp_path / "no" / "such" / "runs.db", "does not exist")


def test_directory_not_writable_for_a_new_database(tmp_path, command):
    folder = tmp_path / "ro"
    folder.mkdir()
    with read_only(folder):
        assert_clear_failure(command, folder / "runs.db", "is not writable")
    assert not (folder / "runs.db").exists()


def test_existing_database_in_a_read_only_directory(tmp_path, command):
    """WAL mode creates runs.db-wal and runs.db-shm next to the file: the folder must be
    writable even when the file is."""
    folder = tmp_path / "ro"
    folder.mkdir()
    path = migrated(folder)
    assert not (folder / "runs.db-wal").exists()  # closed cleanly: SQLite removed them
    with read_only(folder):
        assert_clear_failure(command, path, "is not writable")


def test_read_only_database_file(tmp_path, command):
    path = migrated(tmp_path)
    with read_only(path):
        assert_clear_failure(command, path, "read-only")


def test_chmod_444_database_file(tmp_path, command):
    """Mode bits without write permission count as read-only even for root, whom the kernel
    would let write: the owner's intent, not only the kernel's verdict."""
    path = migrated(tmp_path)
    os.chmod(path, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    try:
        assert_clear_failure(command, path, "read-only")
    finally:
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


def test_not_a_database(tmp_path, command):
    path = tmp_path / "runs.db"
    path.write_bytes(b"this is not sqlite\n" * 200)
    assert_clear_failure(command, path, "not a valid SQLite database")


def test_schema_from_a_newer_version(tmp_path, command):
    path = migrated(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    assert_clear_failure(command, path, "newer batchscope")


@pytest.mark.slow  # waits out the 5 s busy timeout, twice
def test_database_locked_by_another_process(tmp_path, command):
    path = migrated(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sqlite3, sys\n"
         "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
         "c.execute('BEGIN EXCLUSIVE')\n"
         "print('locked', flush=True)\n"
         "sys.stdin.read()\n", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert_clear_failure(command, path, "locked by another process")
    finally:
        holder.stdin.close()
        holder.wait(10)
        holder.stdout.close()
    # Once the other process lets go, the same command works.
    result = batchscope("db", "upgrade", "--db", str(path))
    assert result.returncode == 0, result.stderr


def test_an_unusable_postgresql_url(postgres_cluster, command):
    """A database missing on the server: one line naming the URL, its password masked."""
    url = postgres_cluster.url("no_such_db").replace("postgres@", "postgres:secret@")
    result = batchscope(*COMMANDS[command](url))
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "secret" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("batchscope: error")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "postgres:***@/no_such_db" in errors[0], errors[0]
    assert 'database "no_such_db" does not exist' in errors[0], errors[0]
