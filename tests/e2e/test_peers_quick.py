"""benchmarks/peers.py --quick: every section runs (engine vs batch_generate vs serial,
batchscope serve vs mlx_lm.server over HTTP, static vs continuous, the max_num_seqs sweep) and
writes its markdown, JSON and SVG files, with numbers in every table row.

mlx_lm.server must start offline from the folder `batchscope export-model` writes: when it
cannot, this test fails (it does not skip), saying so."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"\d+(\.\d+)?")


def table_rows(md: str) -> list[list[str]]:
    """Body rows of every markdown table (header and separator lines left out)."""
    rows, lines = [], md.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|") or re.fullmatch(r"\|(-+\|)+", line):
            continue
        if i + 1 < len(lines) and re.fullmatch(r"\|(-+\|)+", lines[i + 1]):
            continue  # a header
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_peers_quick_writes_every_table_with_numbers(tmp_path):
    out = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, "benchmarks/peers.py", "--quick", "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=420)
    log = result.stdout + result.stderr
    if result.returncode != 0 and re.search(r"mlx_lm\.server (exited .* before it was ready|"
                                            r"was not ready after)", log):
        pytest.fail("mlx_lm.server could not start offline from the exported model folder "
                    "(HF_HUB_OFFLINE=1):\n" + log[-4000:])
    assert result.returncode == 0, log[-6000:]
    assert "[peers" in result.stderr  # progress lines on stderr

    md = (out / "peers.md").read_text()
    data = json.loads((out / "peers.json").read_text())
    for name in ("peers_http_throughput.svg", "peers_sweep.svg"):
        svg = (out / name).read_text()
        assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
        assert "<circle" in svg  # measured points

    for title in ("## Goals", "## 1. Offline", "## 2. Over HTTP", "## 3. Continuous vs static",
                  "## 4. max_num_seqs sweep"):
        assert title in md
    assert str(tmp_path) not in md  # no paths of this machine in the results
    rows = table_rows(md)
    assert len(rows) >= 3 + 2 + 2 + 2 + 2  # goals, offline, http, static, sweep
    for row in rows:
        if row[0].startswith("`batchscope serve`") and "not measured" in row[-1]:
            continue  # the 8-stream goal: --quick runs 1 and 4 streams only
        assert any(NUMBER.search(cell) for cell in row[1:]), row

    # Raw numbers: both servers at both concurrencies, no failures, sane ratios.
    servers = data["http"]["servers"]
    assert set(servers) == {"batchscope", "mlx_lm.server"}
    for sv in servers.values():
        assert [r["concurrency"] for r in sv["runs"]] == [1, 4]
        for r in sv["runs"]:
            assert r["summary"]["failed"] == 0 and r["summary"]["output_throughput"] > 0
    assert "BatchGenerator" in data["http"]["mlx_lm_server_batching"]
    assert [r["concurrency"] for r in data["offline"]["rows"]] == [1, 4]
    static = data["static"]
    assert static["static"]["useful_tokens"] == static["continuous"]["useful_tokens"]
    assert static["static"]["generated_tokens"] >= static["continuous"]["generated_tokens"]
    assert static["continuous"]["all_reached_target"]
    assert [r["max_num_seqs"] for r in data["sweep"]["rows"]] == [1, 4]
    assert data["sweep"]["knee"] in (1, 4)
    assert len(data["goals"]) == 3
