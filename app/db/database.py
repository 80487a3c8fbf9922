"""Opening the runs database, migrated to head on open: a SQLite file in WAL mode with foreign
keys on (the default), or a PostgreSQL database given as a URL (app/db/postgres.py).

We issue BEGIN ourselves (pysqlite's implicit transactions are turned off) so that writers can
take the write lock up front with BEGIN IMMEDIATE: a deferred transaction that reads and then
writes can fail with "database is locked" without waiting, whatever busy_timeout says.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy.exc
from sqlalchemy import Connection, Engine, create_engine, event, or_, update

from app.assets import migrations_dir
from app.db import postgres
from app.db.errors import DatabaseError
from app.db.models import Run

log = logging.getLogger(__name__)


def create_sqlite_engine(path: str | os.PathLike, busy_timeout: float = 5.0) -> Engine:
    """An engine whose connections use WAL, foreign keys and a busy timeout.

    Connections begin with plain BEGIN; `engine.execution_options(begin_immediate=True)` gives
    an engine (sharing the same pool) whose transactions begin with BEGIN IMMEDIATE.
    """
    engine = create_engine(f"sqlite:///{os.fspath(path)}",
                           connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # no implicit BEGIN: see the module docstring
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.execute("PRAGMA journal_mode = WAL")  # persistent; re-asserting it is a no-op
        cur.execute("PRAGMA synchronous = NORMAL")  # durable enough with WAL, far fewer fsyncs
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get("begin_immediate", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def create_database_engine(target: str | os.PathLike, busy_timeout: float = 5.0) -> Engine:
    """The engine for a `--db` value: a PostgreSQL URL, else a SQLite file's path."""
    if postgres.is_url(target):
        return postgres.create_postgres_engine(str(target), busy_timeout)
    return create_sqlite_engine(target, busy_timeout)


class Database:
    """The engine for one runs database. Reads: `read()`. Writes: `write_engine` (the recorder).

    `path` is what messages name: the SQLite file, or the URL with its password masked.
    """

    def __init__(self, path: Path | str, engine: Engine):
        self.path = path
        self.engine = engine
        self.postgres = engine.dialect.name == "postgresql"
        # Writers take SQLite's write lock up front; on PostgreSQL, READ COMMITTED suffices
        # (app/db/postgres.py) while reads keep the engine's REPEATABLE READ snapshot.
        self.write_engine = (engine.execution_options(isolation_level="READ COMMITTED")
                             if self.postgres else engine.execution_options(begin_immediate=True))
        self._held: tuple[int, Connection] | None = None  # PostgreSQL: hold_session()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection for reads; everything read through it sees one snapshot."""
        with self.engine.connect() as conn:
            yield conn

    def hold_session(self, session_id: int) -> None:
        """Mark this engine session live until close(): on PostgreSQL another server's
        mark_interrupted() leaves its runs alone. A SQLite file has one server at a time."""
        if self.postgres and self._held is None:
            self._held = (session_id, postgres.hold_session(self.engine, session_id))

    def mark_interrupted(self) -> int:
        """Mark runs left "running" by an earlier server as "interrupted"; call before serving.

        On PostgreSQL only runs of sessions no live server holds (hold_session). Their text
        and tokens stay as written: output_text is appended to with every token.
        """
        unfinished = Run.status == "running"
        if self.postgres:
            unfinished &= or_(Run.session_id.is_(None), ~postgres.session_is_live(Run.session_id))
        try:
            with self.write_engine.begin() as conn:
                result = conn.execute(update(Run).where(unfinished).values(status="interrupted"))
        except sqlalchemy.exc.DBAPIError as e:
            raise self.error(e) from e
        if result.rowcount:
            log.info("marked %d unfinished runs as interrupted", result.rowcount)
        return result.rowcount

    def upgrade(self) -> None:
        """Apply every migration not yet applied (idempotent)."""
        from alembic.util import CommandError

        try:
            run_migrations(self.engine)
        except sqlalchemy.exc.DBAPIError as e:
            raise self.error(e) from e
        except CommandError as e:  # e.g. a revision this version does not know (a newer one)
            raise DatabaseError(f"cannot migrate database {self.path}: {e} (was it written by "
                                "a newer batchscope?)") from e

    def error(self, e: sqlalchemy.exc.DBAPIError, waited: float | None = None) -> DatabaseError:
        """A DatabaseError naming this database and what went wrong."""
        problem = (postgres.problem(e, waited) if self.postgres
                   else _sqlite_problem(e, waited))
        return DatabaseError(f"cannot use database {self.path}: {problem}")

    def close(self) -> None:
        if self._held is not None:
            session_id, conn = self._held
            self._held = None
            try:
                postgres.release_session(conn, session_id)
            except sqlalchemy.exc.DBAPIError as e:  # the server is gone: so is the lock
                log.warning("could not release engine session %d: %s", session_id, e)
        self.engine.dispose()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def alembic_config():
    from alembic.config import Config

    config = Config()
    # Alembic reads a real directory: migrations/ in a checkout, the wheel's copy installed.
    config.set_main_option("script_location", str(migrations_dir()))
    return config


def run_migrations(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    config = alembic_config()
    if engine.dialect.name == "postgresql":
        # READ COMMITTED: once the lock is ours, the other server's migration is visible.
        with engine.connect() as conn, conn.execution_options(
                isolation_level="READ COMMITTED").begin():
            postgres.lock_migrations(conn)
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
        return
    with engine.connect() as conn:
        # Batch migrations rebuild tables (copy, drop, rename); with foreign keys on, dropping
        # a parent would cascade into its children. The pragma is a no-op inside a
        # transaction, so it is set before BEGIN, on the raw connection.
        raw = conn.connection.dbapi_connection
        raw.execute("PRAGMA foreign_keys = OFF")
        try:
            with conn.execution_options(begin_immediate=True).begin():
                config.attributes["connection"] = conn
                command.upgrade(config, revision)
                problems = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                if problems:
                    raise DatabaseError(f"migration left broken foreign keys: {problems[:5]}")
        finally:
            raw.execute("PRAGMA foreign_keys = ON")


def open_database(path: str | os.PathLike, *, busy_timeout: float = 5.0,
                  migrate: bool = True) -> Database:
    """Open the runs database at `path` and migrate it to head: a SQLite file (created if
    needed), or a PostgreSQL URL (the database must exist; its tables are created).

    Raises DatabaseError, naming the path (or the URL, password masked), when the directory is
    missing, the file is read-only or not a database, the URL's scheme or driver is not
    supported, the server cannot be reached, or another process holds the database locked for
    longer than busy_timeout.
    """
    if postgres.is_url(path):
        db = Database(postgres.masked(str(path)),
                      postgres.create_postgres_engine(str(path), busy_timeout))
    else:
        path = Path(path)
        _check_path(path)
        db = Database(path, create_sqlite_engine(path, busy_timeout))
    started = time.monotonic()
    try:
        if migrate:
            db.upgrade()
        else:
            with db.read() as conn:
                conn.exec_driver_sql("SELECT 1")
    except sqlalchemy.exc.DBAPIError as e:
        db.close()
        raise db.error(e, time.monotonic() - started) from e
    except DatabaseError:
        db.close()
        raise
    return db


def _check_path(path: Path) -> None:
    """Fail early with a plain message for what SQLite would report obscurely (or not at all)."""
    parent = path.parent
    if not parent.exists():
        raise DatabaseError(f"cannot open database {path}: directory {parent} does not exist")
    if not parent.is_dir():
        raise DatabaseError(f"cannot open database {path}: {parent} is not a directory")
    if path.exists():
        if path.is_dir():
            raise DatabaseError(f"cannot open database {path}: it is a directory")
        mode = path.stat().st_mode
        # Checking the mode bits as well as access() so a read-only file counts as read-only
        # even for root, whom the kernel lets write anyway.
        if not os.access(path, os.W_OK) or not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
            raise DatabaseError(f"cannot open database {path}: the file is read-only")
    if not os.access(parent, os.W_OK | os.X_OK):
        # SQLite creates the file, and in WAL mode its -wal and -shm companions, next to it.
        raise DatabaseError(f"cannot open database {path}: directory {parent} is not writable")


def _sqlite_problem(e: sqlalchemy.exc.DBAPIError, waited: float | None = None) -> str:
    message = str(e.orig) if e.orig is not None else str(e)
    lowered = message.lower()
    if "locked" in lowered or "busy" in lowered:
        after = f" (waited {waited:.1f} s)" if waited is not None else ""
        return f"the database is locked by another process{after}"
    if "readonly" in lowered or "read-only" in lowered:
        return "the database is read-only"
    if "not a database" in lowered or "malformed" in lowered:
        return "the file is not a valid SQLite database"
    if "unable to open" in lowered:
        return "SQLite cannot open the file"
    return message
