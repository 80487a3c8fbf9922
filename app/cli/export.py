"""`batchscope export-model DIR`: the embedded model as an mlx-lm folder."""

from __future__ import annotations

import argparse


def add_export_command(sub: argparse._SubParsersAction) -> None:
    exp = sub.add_parser("export-model", help="write the embedded model as an mlx-lm folder")
    exp.add_argument("dir")
    exp.add_argument("--weights", default="q4", choices=["q4", "f32", "bf16"])
    exp.set_defaults(func=cmd_export_model)



def cmd_export_model(args: argparse.Namespace) -> int:
    from engine.export import export_model

    path = export_model(args.dir, weights=args.weights)
    print(f"wrote an mlx-lm model folder to {path}; try: mlx_lm.generate --model {path} "
          "--prompt hello")
    return 0
