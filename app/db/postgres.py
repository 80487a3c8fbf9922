"""PostgreSQL as the runs database: `--db postgresql+psycopg://USER:PASSWORD@HOST/NAME`, so
several servers record into one history (docs/engine.md, "A shared runs database").

What one SQLite file and BEGIN IMMEDIATE give, made explicit for several servers:

- Migrations: every server migrates on open, inside a transaction (PostgreSQL's DDL is
  transactional) that first takes an advisory lock, so a second server waits for the first's
  migration and then finds nothing left to do.
- Writers: run ids are the engine's request ids; engine sessions and benchmark runs take theirs
  from sequences (SERIAL), which never hand one number to two transactions; every other write
  touches only its own server's rows, in single-row statements (UPDATE ... SET output_text =
  output_text || ...). READ COMMITTED is enough for that, and never fails to serialize.
- Reads: REPEATABLE READ, so everything one read() returns comes from one snapshot.
- Interrupted runs: a server holds a session-level advisory lock on its engine session for as
  long as it runs; at start-up only the running runs of sessions nobody holds are marked
  interrupted, never those of another server that is still serving.
- Text: PostgreSQL's text cannot hold NUL (U+0000), which a byte-level token's text can be;
  every string a statement sends has it as U+2400 (SYMBOL FOR NULL) instead, so the run is
  kept, its text shows where the NUL was, and its token ids stay exact.
"""

from __future__ import annotations

import math
import re

import sqlalchemy.exc
from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Engine,
    cast,
    column,
    create_engine,
    event,
    exists,
    func,
    select,
    table,
    text,
)
from sqlalchemy.engine import make_url

from app.db.errors import DatabaseError

DRIVER = "postgresql+psycopg"
SCHEMES = (DRIVER, "postgresql")  # psycopg 3 either way: SQLAlchemy's default is psycopg2
CONNECT_TIMEOUT = 10  # seconds to reach the server before the URL is reported unreachable
# Advisory lock keys (two int4s): batchscope's class for migrations, and one for sessions
# whose second key is the engine session's id.
MIGRATION_LOCK = 0x62730000
SESSION_LOCK = MIGRATION_LOCK + 1
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_PG_LOCKS = table("pg_locks", column("locktype"), column("database"), column("classid"),
                  column("objid"), column("objsubid"), column("granted"))
_PG_DATABASE = table("pg_database", column("oid"), column("datname"))


def is_url(target: object) -> bool:
    """A `--db` value that is a SQLAlchemy URL rather than a SQLite file's path."""
    return isinstance(target, str) and _URL.match(target) is not None


def masked(url: str) -> str:
    """The URL as messages and logs may show it: the password as ***."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (sqlalchemy.exc.ArgumentError, ValueError):  # unparsable: mask "user:...@" anyway
        return re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", url)


def create_postgres_engine(url: str, busy_timeout: float = 5.0) -> Engine:
    """An engine on psycopg 3 whose connections read in REPEATABLE READ and wait at most
    busy_timeout for a lock (as SQLite's busy timeout); writers use READ COMMITTED
    (Database.write_engine). Raises DatabaseError for a URL batchscope cannot use."""
    name = masked(url)
    try:
        parsed = make_url(url)
    except (sqlalchemy.exc.ArgumentError, ValueError) as e:
        raise DatabaseError(f"cannot use database {name}: not a valid URL ({e})") from e
    if parsed.drivername not in SCHEMES:
        raise DatabaseError(
            f"cannot use database {name}: {parsed.drivername}:// is not supported; give a "
            f"SQLite file's path or a {DRIVER}:// URL")
    if not parsed.database:
        raise DatabaseError(f"cannot use database {name}: the URL names no database")
    try:
        engine = create_engine(
            parsed.set(drivername=DRIVER), pool_pre_ping=True,
            isolation_level="REPEATABLE READ",
            connect_args={"connect_timeout": CONNECT_TIMEOUT,
                          "options": f"-c lock_timeout={math.ceil(busy_timeout * 1000)}"})
    except ImportError as e:
        raise DatabaseError(
            f"cannot use database {name}: the PostgreSQL driver is missing ({e}); install "
            "it with pip install 'batchscope[postgres]'") from e

    @event.listens_for(engine, "before_cursor_execute", retval=True)
    def _no_nul(conn, cursor, statement, parameters, context, executemany):
        return statement, without_nul(parameters)

    return engine


def without_nul(value):
    """`value` (a statement's parameters: strings, or dicts and sequences of them) with every
    NUL in its strings as U+2400; the same object where there is none."""
    if isinstance(value, str):
        return value.replace("\x00", "\u2400") if "\x00" in value else value
    if isinstance(value, dict | list | tuple):
        items = value.values() if isinstance(value, dict) else value
        if all(without_nul(v) is v for v in items):
            return value
        if isinstance(value, dict):
            return {k: without_nul(v) for k, v in value.items()}
        return type(value)(without_nul(v) for v in value)
    return value


def lock_migrations(conn: Connection) -> None:
    """Wait (up to the lock timeout) until no other server is migrating; held until commit."""
    conn.execute(text("SELECT pg_advisory_xact_lock(:k, 0)"), {"k": MIGRATION_LOCK})


def hold_session(engine: Engine, session_id: int) -> Connection:
    """A connection that holds the session's advisory lock until release_session()."""
    conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    try:
        conn.execute(text("SELECT pg_advisory_lock(:k, :id)"),
                     {"k": SESSION_LOCK, "id": session_id})
    except BaseException:
        conn.close()
        raise
    return conn


def release_session(conn: Connection, session_id: int) -> None:
    # A pooled connection would keep a session-level lock: release it before returning it.
    try:
        conn.execute(text("SELECT pg_advisory_unlock(:k, :id)"),
                     {"k": SESSION_LOCK, "id": session_id})
    finally:
        conn.close()


def session_is_live(session_id: ColumnElement) -> ColumnElement[bool]:
    """Whether a connection to this database holds the session's lock (hold_session)."""
    here = select(_PG_DATABASE.c.oid).where(_PG_DATABASE.c.datname == func.current_database())
    return exists().where(
        _PG_LOCKS.c.locktype == "advisory", _PG_LOCKS.c.granted.is_(True),
        _PG_LOCKS.c.database == here.scalar_subquery(),
        cast(_PG_LOCKS.c.classid, BigInteger) == SESSION_LOCK,
        cast(_PG_LOCKS.c.objid, BigInteger) == session_id,
        _PG_LOCKS.c.objsubid == 2)  # the two-key form of the lock functions


def problem(e: sqlalchemy.exc.DBAPIError, waited: float | None = None) -> str:
    """PostgreSQL's (or the driver's) message on one line; a lock timeout said plainly."""
    message = " ".join(str(e.orig if e.orig is not None else e).split())
    if "lock timeout" in message:
        after = f" (waited {waited:.1f} s)" if waited is not None else ""
        return f"the database is locked by another process{after}"
    return message
