from __future__ import annotations

import pytest

from app.db import open_database


@pytest.fixture
def db(tmp_path):
    """A migrated SQLite runs database in a temporary folder."""
    database = open_database(tmp_path / "runs.db")
    yield database
    database.close()
