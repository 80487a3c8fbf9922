"""`batchscope db ...`: database maintenance commands."""

from __future__ import annotations

import argparse
import sys

from app.settings import DEFAULT_DB, ENV_DB, resolve_db_path


def add_db_commands(subparsers) -> None:
    """Add `db upgrade [--db PATH|URL]` to the `batchscope` subparsers."""
    db = subparsers.add_parser("db", help="runs database maintenance")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    up = db_sub.add_parser("upgrade", help="create the database or migrate it to the latest "
                                           "schema (the server also does this when it starts)")
    up.add_argument("--db", default=None, metavar="PATH|URL",
                    help="a SQLite file or a postgresql+psycopg:// URL (default: "
                         f"${ENV_DB}, else {DEFAULT_DB})")
    up.set_defaults(func=cmd_db_upgrade)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from app.db.database import DatabaseError, open_database

    path = resolve_db_path(args.db)
    try:
        with open_database(path) as db:
            revision = current_revision(db)
            name = db.path  # a URL's password masked
    except DatabaseError as e:
        print(f"batchscope: error: {e}", file=sys.stderr)
        return 2
    print(f"{name}: at schema revision {revision}")
    return 0


def current_revision(db) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with db.read() as conn:
        return MigrationContext.configure(conn).get_current_revision()
