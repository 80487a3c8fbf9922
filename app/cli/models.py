"""`batchscope models`: the model families the engine computes, and how each differs from llama.

    batchscope models [--json]
"""

from __future__ import annotations

import argparse
import json

TESTED = ("each is checked against mlx-lm's own greedy generation on tiny random-weight "
          "folders (float32 and 4-bit), batched against alone, with a prefix-cache hit and a "
          "preemption: tests/engine/test_family_*.py")


def add_models_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "models", help="list the supported model families (config.json model_type values)",
        description="The model families the engine computes exactly as mlx-lm does. A folder "
                    "of any other model_type is refused at load, by name.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_models)
    return p


def cmd_models(args: argparse.Namespace) -> int:
    from engine.models import FAMILIES

    rows = [{"family": f.name, "model_types": list(f.model_types), "differs": f.differs,
             "mlx_lm_class": f"{f.model_class.__module__}.{f.model_class.__qualname__}"}
            for f in FAMILIES]
    if args.json:
        print(json.dumps({"families": rows, "tested": TESTED}, indent=2))
        return 0
    width = max(len(", ".join(r["model_types"])) for r in rows)
    print(f"{'model_type':<{width}}  how it differs from llama")
    for r in rows:
        print(f"{', '.join(r['model_types']):<{width}}  {r['differs']}")
    print(f"\nTests: {TESTED}.")
    return 0
