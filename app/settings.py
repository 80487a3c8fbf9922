"""Server settings: one dataclass of plain data (`batchscope serve` builds it from its flags,
with environment variables as defaults: app/cli/serve.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.config import EngineConfig

# Environment variables that override the built-in defaults (CLI flags override both).
ENV_HOST = "BATCHSCOPE_HOST"
ENV_PORT = "BATCHSCOPE_PORT"
ENV_DB = "BATCHSCOPE_DB"
ENV_API_KEY = "BATCHSCOPE_API_KEY"
DEFAULT_DB = "./batchscope.db"


@dataclass
class Settings:
    host: str = "127.0.0.1"  # loopback by default: without api_key nothing is authenticated
    port: int = 8000
    db_path: str = DEFAULT_DB  # a SQLite file's path or a PostgreSQL URL
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_body_bytes: int = 1 << 20  # larger request bodies get a 413 before being parsed
    # Requests waiting beyond the max_num_seqs the engine runs at once; more get a 429.
    max_waiting_requests: int = 256
    max_tokens_limit: int | None = None  # most new tokens per request (None: the context window)
    log_level: str = "info"
    # When set, the API and the pages need it (app/web/security.py). Kept out of repr and logs.
    api_key: str | None = field(default=None, repr=False)
    # Host-header check against DNS rebinding (app/web/security.py): None, no check; a tuple,
    # loopback names plus these. `batchscope serve` turns it on for a keyless loopback server.
    allowed_hosts: tuple[str, ...] | None = None
    # The format tool calls are parsed in (app/web/api/tool_calls.py): "auto", the template's.
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an integer from 0 to 65535, got {self.port!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(
                f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}")
        for name, lo in (("max_waiting_requests", 0), ("max_tokens_limit", 1)):
            value = getattr(self, name)
            if (value is not None or name == "max_waiting_requests") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < lo):
                raise ValueError(f"{name} must be an integer of at least {lo}, got {value!r}")
        if not self.host:
            raise ValueError("host must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key must not be empty")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def resolve_db_path(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The runs database every command uses: --db, else $BATCHSCOPE_DB, else ./batchscope.db.

    A SQLite file's path or a SQLAlchemy URL (postgresql+psycopg://...): app/db/database.py's
    open_database() tells them apart."""
    env = os.environ if environ is None else environ
    return flag or env.get(ENV_DB) or DEFAULT_DB
