"""benchmarks/llama_cpp_peer.py without a llama.cpp build: it says how to build it, measures
nothing and writes nothing; and the table it reads from llama-batched-bench is parsed as
printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# llama-batched-bench's table as llama.cpp (llama-cpp-python 0.3.36) prints it.
TABLE = """
main: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    64 |     32 |    1 |     96 |    0.260 |   246.05 |    0.298 |   107.46 |    0.558 |   172.07 |
|    64 |     32 |    4 |    384 |    0.977 |   262.00 |    0.828 |   154.58 |    1.805 |   212.73 |
|    64 |     32 |    8 |    768 |    1.943 |   263.45 |    1.233 |   207.62 |    3.176 |   241.78 |
|    64 |     32 |   16 |   1536 |    4.034 |   253.85 |    2.467 |   207.56 |    6.501 |   236.29 |
"""


def test_without_a_build_it_says_how_to_build_it_and_exits_3(tmp_path):
    env = dict(os.environ, BATCHSCOPE_LLAMA_CPP=str(tmp_path / "none"))
    out = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, "benchmarks/llama_cpp_peer.py", "--out-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert "llama.cpp is not built: ./scripts/build-llama-cpp.sh builds it" in result.stderr
    assert not out.exists()


def test_the_batched_bench_table_is_read_as_printed(monkeypatch, tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import llama_cpp_peer as peer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    class Done:
        stdout = TABLE

    monkeypatch.setattr(peer.subprocess, "run", lambda *a, **k: Done())
    assert peer.batched_bench(tmp_path, tmp_path / "model.gguf", 2) == {
        1: 107.46, 4: 154.58, 8: 207.62, 16: 207.56}
    Done.stdout = TABLE.replace("|   16 |", "|   32 |")
    with pytest.raises(RuntimeError, match="could not read llama-batched-bench's table"):
        peer.batched_bench(tmp_path, tmp_path / "model.gguf", 2)
