"""The one error the runs database raises for what a person must fix (app/db/database.py,
app/db/postgres.py)."""

from __future__ import annotations


class DatabaseError(RuntimeError):
    """The database cannot be opened or written; the message names it (a path, or a URL with
    its password masked) and the problem."""
