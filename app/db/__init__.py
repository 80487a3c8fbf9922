"""The runs database: models, opening and migrating, the single writer thread, the read side."""

from app.db.database import Database, DatabaseError, open_database
from app.db.recorder import Recorder

__all__ = ["Database", "DatabaseError", "Recorder", "open_database"]
