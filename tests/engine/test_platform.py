"""engine/platform.py: float32 weights keep float32 matmuls on a GPU (TF32 off unless the
environment turns it on), and backend_info says which holds; OpenBLAS runs the kernels the CPU
can run, not its fallback for a CPU it does not know."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import platform
from engine.platform import (
    CORETYPE_ENV,
    TF32_ENV,
    UNKNOWN_CPU_KERNELS,
    backend_info,
    blas_text,
    float32_matmuls,
    kernels_for,
)

AVX512 = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "sse3"}


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


def test_kernels_for_names_what_the_instruction_sets_run():
    assert kernels_for(AVX512) == "SkylakeX"
    assert kernels_for(AVX512 - {"avx512bw"}) == "Haswell"
    assert kernels_for({"avx2", "fma", "sse3"}) == "Haswell"
    assert kernels_for({"avx", "sse3"}) is None


class FakeOpenBLAS:
    """The entry points preload_blas() uses: kernels chosen at load, and re-selected from
    OPENBLAS_CORETYPE as a DYNAMIC_ARCH build does."""

    def __init__(self, took: str, dynamic: bool = True):
        self.kernels = took

        def corename():
            return self.kernels.encode()

        self.openblas_get_corename = corename
        if dynamic:
            self.gotoblas_dynamic_quit = lambda: setattr(self, "kernels", "")
            self.gotoblas_dynamic_init = lambda: setattr(self, "kernels",
                                                         os.environ[CORETYPE_ENV])


@pytest.fixture
def fresh_kernels(monkeypatch):
    """preload_blas()'s record of the kernels, and OPENBLAS_CORETYPE, as before a load."""
    monkeypatch.setattr(platform, "_kernels", None)
    monkeypatch.setattr(platform, "_replaced_kernels", None)
    monkeypatch.delenv(CORETYPE_ENV, raising=False)


@pytest.mark.usefixtures("fresh_kernels")
def test_a_fallback_to_prescott_is_replaced_by_what_the_cpu_runs():
    lib = FakeOpenBLAS(UNKNOWN_CPU_KERNELS)
    platform._select_kernels(lib, lambda: AVX512)
    assert lib.kernels == "SkylakeX"
    assert os.environ[CORETYPE_ENV] == "SkylakeX"  # child processes select the same
    assert (platform._kernels, platform._replaced_kernels) == ("SkylakeX", "Prescott")
    info = {"blas": "/usr/lib/libopenblas.so.0", "blas_kernels": "SkylakeX",
            "blas_kernels_replaced": "Prescott"}
    assert blas_text(info) == ("libopenblas.so.0, SkylakeX kernels (OpenBLAS took "
                               "Prescott's for this CPU, which it does not know)")


@pytest.mark.usefixtures("fresh_kernels")
@pytest.mark.parametrize(("took", "flags", "dynamic", "coretype"), [
    ("Haswell", AVX512, True, None),  # a CPU OpenBLAS knows: its choice stands
    ("Prescott", {"sse3"}, True, None),  # Prescott is what this CPU runs
    ("Prescott", AVX512, False, None),  # no re-selection in a build for one CPU
    ("Prescott", AVX512, True, "Prescott"),  # the user's OPENBLAS_CORETYPE stands
])
def test_other_kernels_are_left_as_openblas_took_them(monkeypatch, took, flags, dynamic,
                                                      coretype):
    if coretype is not None:
        monkeypatch.setenv(CORETYPE_ENV, coretype)
    lib = FakeOpenBLAS(took, dynamic)
    platform._select_kernels(lib, lambda: flags)
    assert lib.kernels == took
    assert (platform._kernels, platform._replaced_kernels) == (took, None)
    assert os.environ.get(CORETYPE_ENV) == coretype


def _blas_after_import(env: dict) -> dict:
    code = ("import json, engine; from engine.platform import backend_info; "
            "print(json.dumps(backend_info()))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)


def test_the_loaded_openblas_runs_kernels_this_cpu_can_run():
    """On this machine, as a user's process starts: an OpenBLAS that falls back to Prescott's
    kernels on a CPU it does not know (0.3.21 on Emerald Rapids) runs better ones."""
    env = {k: v for k, v in os.environ.items() if k != CORETYPE_ENV}
    info = _blas_after_import(env)
    if info["blas"] is None or info["blas_kernels"] is None:
        pytest.skip("no OpenBLAS that names its kernels is loaded here")
    better = kernels_for(platform._cpu_flags())
    if better is not None:
        assert info["blas_kernels"] != UNKNOWN_CPU_KERNELS
    if info["blas_kernels_replaced"] is not None:
        assert info["blas_kernels"] == better
    if better is not None:  # an x86-64 CPU with AVX2, which Haswell's kernels run on
        # OPENBLAS_CORETYPE set by the user is what runs, and nothing is replaced.
        chosen = _blas_after_import({**env, CORETYPE_ENV: "Haswell"})
        assert (chosen["blas_kernels"], chosen["blas_kernels_replaced"]) == ("Haswell", None)
