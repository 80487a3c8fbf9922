"""A short soak (scripts/soak.py): 8 concurrent clients for 25 s against `batchscope serve`,
with streams dropped mid-way and requests abandoned, then the audit (recorded text equals the
streamed text, drops recorded as cancelled, no 5xx, no KV block held, RSS growth under 10%,
SQLite integrity). The server gets a small batch and waiting queue (4 + 2), so some requests
are refused with 429 and retried after Retry-After: an expected outcome, not a failure.
The full run is `scripts/soak.py` with its defaults (32 clients, 300 s)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_passes_its_audit():
    result = subprocess.run(
        [sys.executable, "scripts/soak.py", "--clients", "8", "--duration", "25",
         "--warmup", "10", "--seed", "1",
         "--server-args=--num-kv-blocks 256 --max-num-seqs 4 --max-waiting-requests 2"],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert "\nOK" in result.stdout
    requests = int(re.search(r"^requests\s+(\d+)", result.stdout, re.M).group(1))
    completed = int(re.search(r"^completed\s+(\d+)", result.stdout, re.M).group(1))
    cancelled = int(re.search(r"^cancelled \(db\)\s+(\d+)", result.stdout, re.M).group(1))
    assert requests >= 8 and completed >= 4, out  # it really did something
    assert cancelled >= 1, out  # and the disconnect path was exercised
    assert re.search(r"leaked 0,", result.stdout)
    assert int(re.search(r"429 retried (\d+)", result.stdout).group(1)) >= 1, out
