"""The `batchscope` command: one module per subcommand (serve, generate, models, calibrate,
diverge, bench serve, export-model, db upgrade); engine_flags holds the engine's flags."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    from app.cli.bench import add_bench_command
    from app.cli.calibrate import add_calibrate_command
    from app.cli.db import add_db_commands
    from app.cli.diverge import add_diverge_command
    from app.cli.export import add_export_command
    from app.cli.generate import add_generate_command
    from app.cli.models import add_models_command
    from app.cli.serve import add_serve_command

    parser = argparse.ArgumentParser(prog="batchscope", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_generate_command, add_serve_command, add_export_command,
                add_calibrate_command, add_diverge_command, add_models_command, add_db_commands,
                add_bench_command):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # one line per migration is enough
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"batchscope: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


