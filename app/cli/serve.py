"""`batchscope serve`: the web app and the OpenAI-compatible API, with the runs database."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Mapping

from app.cli.engine_flags import add_engine_args, engine_config, run_launched_rank
from app.settings import ENV_API_KEY, ENV_HOST, ENV_PORT, Settings, resolve_db_path
from app.web.api.tool_calls import PARSERS


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser("serve", help="serve the web app and the OpenAI-compatible API")
    srv.add_argument("--host", default=None,
                     help="address to bind (default 127.0.0.1, or $BATCHSCOPE_HOST)")
    srv.add_argument("--port", type=int, default=None,
                     help="port to bind (default 8000, or $BATCHSCOPE_PORT)")
    srv.add_argument("--db", default=None,
                     help="runs database: a SQLite file, or a postgresql+psycopg:// URL "
                          "that several servers share (default ./batchscope.db, or "
                          "$BATCHSCOPE_DB)")
    srv.add_argument("--max-body-bytes", type=int, default=None,
                     help="largest request body accepted (default 1 MiB)")
    srv.add_argument("--api-key", default=None, metavar="KEY",
                     help="require this key: `Authorization: Bearer KEY` for the API, a login "
                          "for the pages (default: $BATCHSCOPE_API_KEY, else none: keep the "
                          "server on loopback)")
    srv.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                     help="a host name the server answers to besides loopback ones (repeat "
                          "for more); without a key on loopback, any other Host header gets a "
                          "403 (protection against DNS rebinding)")
    srv.add_argument("--max-waiting-requests", type=int, default=None,
                     help="requests that may wait beyond the --max-num-seqs running; more get "
                          "HTTP 429 (default 256)")
    srv.add_argument("--max-tokens-limit", type=int, default=None,
                     help="most new tokens one API request may ask for (default: the context "
                          "window)")
    srv.add_argument("--tool-call-parser", choices=PARSERS, default="auto",
                     help="the format tool calls are read in (and forced calls written in): "
                          "auto (default) picks it from the chat template; hermes also for a "
                          "template without tools (docs/api.md, Tool calls)")
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)



@contextlib.contextmanager
def runs_recorder(settings):
    """The runs database at settings.db_path (a SQLite file or a PostgreSQL URL) and its
    writer thread, for the app's lifespan."""
    from app.db import Recorder, open_database

    with open_database(settings.db_path) as db:
        db.mark_interrupted()  # runs an earlier server left open will never finish
        recorder = Recorder(db)
        recorder.start()
        try:
            yield recorder
        finally:
            recorder.close()


def check_database(path: str) -> str | None:
    """Open (create, migrate) the runs database once; what is wrong with it, or None."""
    from app.db import DatabaseError, open_database

    try:
        open_database(path).close()
    except DatabaseError as e:
        return str(e)
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.web.app import create_app
    from app.web.security import exposure_warning

    launched = run_launched_rank(args)  # mlx.launch: ranks > 0 serve rank 0's plans
    if launched is not None:
        return launched
    settings = settings_from_args(args)
    # Before loading the model: a database that cannot be used is one clear line, not a
    # traceback out of the app's lifespan after seconds of loading.
    problem = check_database(settings.db_path)
    if problem is not None:
        print(f"batchscope: error: {problem}", file=sys.stderr)
        return 2
    app = create_app(settings, recorder_factory=runs_recorder)
    warning = exposure_warning(settings.host, settings.api_key)
    if warning:
        logging.getLogger("batchscope").warning(warning)
    logging.getLogger("batchscope").info(
        "batchscope serving at %s (OpenAI-compatible API at %s/v1)", settings.url, settings.url)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                lifespan="on", timeout_graceful_shutdown=10)
    return 0


def settings_from_args(args: argparse.Namespace,
                       environ: Mapping[str, str] | None = None) -> Settings:
    """Flags left unset (None) fall back to the environment, then to the defaults."""
    from app.web.security import host_check

    env = os.environ if environ is None else environ
    defaults = Settings.__dataclass_fields__
    port = args.port if args.port is not None else env.get(ENV_PORT)
    try:
        port = int(port) if port is not None else defaults["port"].default
    except ValueError:
        raise ValueError(f"{ENV_PORT} must be an integer, got {port!r}") from None
    settings = Settings(
        host=args.host or env.get(ENV_HOST) or defaults["host"].default,
        port=port,
        db_path=resolve_db_path(args.db, env),
        engine=engine_config(args),
        max_body_bytes=args.max_body_bytes or defaults["max_body_bytes"].default,
        max_waiting_requests=(defaults["max_waiting_requests"].default
                              if args.max_waiting_requests is None
                              else args.max_waiting_requests),
        max_tokens_limit=args.max_tokens_limit,
        log_level="debug" if getattr(args, "verbose", False) else "info",
        api_key=args.api_key or env.get(ENV_API_KEY) or None,
        tool_call_parser=args.tool_call_parser,
    )
    settings.allowed_hosts = host_check(settings.host, settings.api_key, args.allowed_host or [])
    return settings
