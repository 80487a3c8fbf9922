"""engine/platform.py: float32 weights keep float32 matmuls on a GPU (TF32 off unless the
environment turns it on), and backend_info says which holds."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.platform import TF32_ENV, backend_info, float32_matmuls


def _tf32_after_import(env: dict) -> str:
    code = f"import os, engine; print(os.environ.get({TF32_ENV!r}, 'unset'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    return done.stdout.strip()


def test_importing_the_engine_turns_tf32_off_unless_asked_for():
    env = {k: v for k, v in os.environ.items() if k != TF32_ENV}
    assert _tf32_after_import(env) == "0"
    assert _tf32_after_import({**env, TF32_ENV: "1"}) == "1"  # the user's choice stands


def test_float32_matmuls_names_tf32_on_a_gpu_only(monkeypatch):
    monkeypatch.delenv(TF32_ENV, raising=False)
    assert float32_matmuls("cuda") == "tf32"  # MLX's own default
    assert float32_matmuls("cpu") == "float32"
    monkeypatch.setenv(TF32_ENV, "0")
    assert float32_matmuls("metal") == "float32"
    monkeypatch.setenv(TF32_ENV, "1")
    assert float32_matmuls("cuda") == "tf32"
    assert float32_matmuls("cpu") == "float32"


def test_backend_info_reports_float32_matmuls():
    info = backend_info()
    assert info["float32_matmuls"] == float32_matmuls(info["backend"])
