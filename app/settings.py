"""Server settings: one dataclass, built from CLI flags with environment variables as defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.config import EngineConfig

# Environment variables that override the built-in defaults (CLI flags override both).
ENV_HOST = "BATCHSCOPE_HOST"
ENV_PORT = "BATCHSCOPE_PORT"
ENV_DB = "BATCHSCOPE_DB"
ENV_API_KEY = "BATCHSCOPE_API_KEY"


@dataclass
class Settings:
    host: str = "127.0.0.1"  # loopback by default: without api_key nothing is authenticated
    port: int = 8000
    db_path: str = "./batchscope.db"
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_body_bytes: int = 1 << 20  # larger request bodies get a 413 before being parsed
    # Requests waiting beyond the max_num_seqs the engine runs at once; more get a 429.
    max_waiting_requests: int = 256
    max_tokens_limit: int | None = None  # most new tokens per request (None: the context window)
    log_level: str = "info"
    # When set, the API and the pages need it (app/web/security.py). Kept out of repr and logs.
    api_key: str | None = field(default=None, repr=False)
    # Host-header check against DNS rebinding (app/web/security.py): None, no check; a tuple,
    # loopback names plus these. `from_args` turns it on for a keyless loopback server.
    allowed_hosts: tuple[str, ...] | None = None

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

    @classmethod
    def from_args(cls, args: argparse.Namespace,
                  environ: Mapping[str, str] | None = None) -> Settings:
        """Flags left unset (None) fall back to the environment, then to the defaults."""
        from app.cli import engine_config

        env = os.environ if environ is None else environ
        defaults = cls.__dataclass_fields__
        port = args.port if args.port is not None else env.get(ENV_PORT)
        try:
            port = int(port) if port is not None else defaults["port"].default
        except ValueError:
            raise ValueError(f"{ENV_PORT} must be an integer, got {port!r}") from None
        settings = cls(
            host=args.host or env.get(ENV_HOST) or defaults["host"].default,
            port=port,
            db_path=args.db or env.get(ENV_DB) or defaults["db_path"].default,
            engine=engine_config(args),
            max_body_bytes=(getattr(args, "max_body_bytes", None)
                            or defaults["max_body_bytes"].default),
            max_waiting_requests=_given(args, "max_waiting_requests",
                                        defaults["max_waiting_requests"].default),
            max_tokens_limit=getattr(args, "max_tokens_limit", None),
            log_level="debug" if getattr(args, "verbose", False) else "info",
            api_key=getattr(args, "api_key", None) or env.get(ENV_API_KEY) or None,
        )
        settings.allowed_hosts = host_check(settings.host, settings.api_key,
                                            getattr(args, "allowed_host", None) or [])
        return settings


def _given(args: argparse.Namespace, name: str, default: object) -> object:
    value = getattr(args, name, None)
    return default if value is None else value


def host_check(host: str, api_key: str | None, extra: list[str]) -> tuple[str, ...] | None:
    """The Host names a server accepts besides loopback ones, or None for no check.

    A keyless server on loopback checks (a page on a domain that resolves to 127.0.0.1 could
    otherwise read it: DNS rebinding); with a key, the key protects it; a keyless server bound
    elsewhere was warned about and serves whatever names reach it, unless --allowed-host."""
    names = tuple(name.strip().lower() for name in extra if name.strip())
    if names:
        return names
    if api_key is None and is_loopback_host(host):
        return ()
    return None


def is_loopback_host(host: str) -> bool:
    from app.web.security import is_loopback

    return is_loopback(host)
