"""`batchscope serve` as a subprocess, for tests (the same helper the soak script uses)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SOAK = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"
_spec = importlib.util.spec_from_file_location("batchscope_soak", _SOAK)
soak = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = soak  # dataclasses look their module up there
_spec.loader.exec_module(soak)

ServerProcess = soak.ServerProcess
rss_kib = soak.rss_kib

__all__ = ["ServerProcess", "rss_kib", "soak"]
