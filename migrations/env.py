"""Alembic environment for the runs database.

Programmatic use (app start, `batchscope db upgrade`) passes an open connection in
config.attributes["connection"]; the `alembic` command line (alembic.ini at the repo root) gets
a SQLite path or a PostgreSQL URL instead, e.g.
`alembic -x db=path/to/batchscope.db revision --autogenerate -m "..."`.
"""

from __future__ import annotations

from alembic import context

from app.db.database import create_database_engine
from app.db.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(**kwargs) -> None:
    # SQLite can alter little in place: batch mode rebuilds tables instead (on PostgreSQL it
    # alters them in place). We issue BEGIN ourselves on SQLite (see app/db/database.py), so
    # DDL is transactional there as on PostgreSQL.
    context.configure(target_metadata=target_metadata, render_as_batch=True,
                      transactional_ddl=True, compare_type=True, **kwargs)


def run_offline() -> None:
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    path = context.get_x_argument(as_dictionary=True).get("db", "batchscope.db")
    engine = create_database_engine(path)
    try:
        with engine.connect() as connection:
            _configure(connection=connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
