from __future__ import annotations

import pytest

from app.db import open_database
from tests.postgres import cluster


@pytest.fixture(scope="session")
def postgres_cluster():
    """One throwaway PostgreSQL cluster for the session (tests/postgres.py)."""
    with cluster() as running:
        yield running


@pytest.fixture(params=["sqlite", "postgresql"])
def db_target(request, tmp_path):
    """The --db of a new, empty runs database: a SQLite file's path in a temporary folder, or
    a fresh database of the session's PostgreSQL cluster (dropped afterwards)."""
    if request.param == "sqlite":
        yield str(tmp_path / "runs.db")
        return
    postgres = request.getfixturevalue("postgres_cluster")
    url = postgres.create_database()
    yield url
    postgres.drop_database(url)


@pytest.fixture
def db(db_target):
    """A migrated runs database, on SQLite and on PostgreSQL (db_target)."""
    database = open_database(db_target)
    yield database
    database.close()
