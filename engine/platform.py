"""Platform setup: bind MLX to an optimized BLAS on Linux, and describe the backend.

The `mlx[cpu]` wheel on Linux bundles the reference (netlib) BLAS, which runs float32
matmuls far slower than OpenBLAS (benchmarks/weights_speed.py measures both; its table is in
docs/weights.md). Loading libopenblas with RTLD_GLOBAL *before* the first
`import mlx.core` makes MLX's BLAS symbols resolve to OpenBLAS instead. This module must
therefore never import mlx at module level.

OpenBLAS (a DYNAMIC_ARCH build, as distributions ship it) picks its kernels by the CPU's model
number, and a release older than the CPU may not know the model: OpenBLAS 0.3.21 (Debian 12's)
takes Prescott's SSE3 kernels on Emerald Rapids, where its float32 matmuls then run 2-5x
slower than on its SkylakeX kernels (benchmarks/blas_kernels.py). preload_blas() then selects the
kernels the CPU's instruction sets run, as OPENBLAS_CORETYPE would; a set OPENBLAS_CORETYPE is
left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform as _platform
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

# Set to "1" to keep MLX on its bundled BLAS (tests and benchmarks that compare the two).
NO_BLAS_ENV = "BATCHSCOPE_NO_BLAS"

# MLX's switch for TensorFloat-32 (10-bit mantissas) in float32 matmuls on CUDA and Metal; on
# by default in MLX, read once, at a GPU's first float32 matmul. The CPU never uses it.
TF32_ENV = "MLX_ENABLE_TF32"

_SONAME = "libopenblas.so.0"

# OpenBLAS's own switch of kernels, read when it (re)selects them.
CORETYPE_ENV = "OPENBLAS_CORETYPE"
# The kernels OpenBLAS's x86-64 selection falls back to for a CPU model it does not know.
UNKNOWN_CPU_KERNELS = "Prescott"
# Kernels OpenBLAS can take instead, most capable first, with the instruction sets they need
# (OpenBLAS's own checks for SkylakeX and Haswell).
_KERNELS_NEED = (("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
                 ("Haswell", {"avx2", "fma"}))

# What preload_blas() loaded in this process (None: nothing yet, or nothing found).
_loaded: str | None = None
_attempted = False
# The loaded OpenBLAS's kernels, and the ones it had taken where preload_blas() replaced them.
_kernels: str | None = None
_replaced_kernels: str | None = None


def _candidate_paths() -> list[str]:
    """Places a Debian/Ubuntu/Fedora-style system keeps libopenblas, most specific first."""
    arches = []
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        arches.append(multiarch)
    guess = f"{_platform.machine()}-linux-gnu"
    if guess not in arches:
        arches.append(guess)

    paths: list[str] = []
    for arch in arches:
        base = Path("/usr/lib") / arch
        paths += [
            str(base / _SONAME),
            str(base / "openblas-pthread" / _SONAME),
            str(base / "openblas-openmp" / _SONAME),
            str(base / "openblas-serial" / _SONAME),
        ]
    paths += [f"/usr/lib64/{_SONAME}", f"/usr/lib/{_SONAME}", f"/usr/local/lib/{_SONAME}"]
    return paths


def find_openblas() -> list[str]:
    """Candidates to try in order: the dynamic loader's answer, then well-known paths."""
    found: list[str] = []
    name = ctypes.util.find_library("openblas")
    if name:
        found.append(name)
    found += [p for p in _candidate_paths() if os.path.exists(p)]
    return found


def preload_blas() -> str | None:
    """Load an optimized BLAS globally so MLX binds to it; return what was loaded.

    Only acts on Linux, only before `mlx.core` is imported (afterwards MLX has already
    resolved its BLAS symbols, so loading one would change nothing), and not when
    BATCHSCOPE_NO_BLAS=1. Idempotent: later calls return the first call's result.
    """
    global _loaded, _attempted
    if _attempted:
        return _loaded
    if not sys.platform.startswith("linux"):
        return None
    if os.environ.get(NO_BLAS_ENV, "") not in ("", "0"):
        return None
    if "mlx.core" in sys.modules:
        return None

    _attempted = True
    for candidate in find_openblas():
        try:
            lib = ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _loaded = _resolve_loaded_path(candidate)
        _select_kernels(lib, _cpu_flags)
        break
    return _loaded


def kernels_for(flags: set[str]) -> str | None:
    """The most capable OpenBLAS kernels a CPU with these /proc/cpuinfo flags runs, among
    those worth taking over Prescott's; None: none of them."""
    return next((name for name, needs in _KERNELS_NEED if needs <= flags), None)


def _select_kernels(lib, flags: Callable[[], set[str]]) -> None:
    """Note the kernels OpenBLAS took and, where it fell back to Prescott's for a CPU it does
    not know and the CPU runs better ones, select those (before any BLAS call: MLX is not
    imported yet). flags: the CPU's instruction sets, read only then. A build without these
    entry points is left as it is."""
    global _kernels, _replaced_kernels
    try:
        corename = lib.openblas_get_corename
        corename.restype = ctypes.c_char_p
        took = corename().decode()
    except (AttributeError, UnicodeDecodeError):
        return
    _kernels = took
    if took != UNKNOWN_CPU_KERNELS or CORETYPE_ENV in os.environ:
        return
    better = kernels_for(flags())
    if better is None:
        return
    try:
        quit_kernels, init_kernels = lib.gotoblas_dynamic_quit, lib.gotoblas_dynamic_init
    except AttributeError:  # not a DYNAMIC_ARCH build: its kernels are built in
        return
    os.environ[CORETYPE_ENV] = better  # what init reads; child processes select it too
    quit_kernels()
    init_kernels()
    _kernels, _replaced_kernels = corename().decode(), took


def _cpu_flags() -> set[str]:
    """The CPU's instruction-set flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def keep_float32_exact() -> None:
    """Float32 weights mean float32 matmuls: TF32 off unless the environment turns it on.

    On MLX's CUDA backend TF32 gave float32 matmuls a relative error of 3.4e-4 (1.4e-6 on the
    CPU) and moved greedy logprobs 3e-3 from mlx-lm's on the same weights (docs/gpu.md). Set
    MLX_ENABLE_TF32=1 to trade that precision for speed; the start-up log says which holds."""
    os.environ.setdefault(TF32_ENV, "0")


def float32_matmuls(backend: str) -> str:
    """How float32 matmuls run on `backend`: "float32", or "tf32" where MLX_ENABLE_TF32 turns
    TensorFloat-32 on (a GPU backend only)."""
    if backend == "cpu":
        return "float32"
    try:
        return "tf32" if int(os.environ.get(TF32_ENV, "1")) else "float32"
    except ValueError:  # MLX reads the variable as an integer too
        return "tf32"


def _resolve_loaded_path(name: str) -> str:
    """Turn a soname like "libopenblas.so.0" into the file the loader actually mapped."""
    if os.path.isabs(name):
        return name
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libopenblas"):
                    return path
    except OSError:
        pass
    return name


def blas_loaded() -> str | None:
    """The BLAS library preload_blas() loaded in this process, or None."""
    return _loaded


def blas_text(info: dict) -> str:
    """backend_info()'s BLAS in words: the library's file name and its kernels, or
    "bundled" (MLX's own reference BLAS)."""
    name = blas_name(info.get("blas"))
    if name is None:
        return "bundled"
    kernels, replaced = info.get("blas_kernels"), info.get("blas_kernels_replaced")
    if not kernels:
        return name
    if replaced:
        return (f"{name}, {kernels} kernels (OpenBLAS took {replaced}'s for this CPU, which "
                "it does not know)")
    return f"{name}, {kernels} kernels"


def blas_name(path: str | None) -> str | None:
    """The BLAS library's file name from backend_info()["blas"]: results and reports name the
    library, not where it lives on one machine."""
    return Path(path).name if path else None


def backend_info() -> dict:
    """Describe where MLX runs: backend ("metal", "cuda" or "cpu"), versions and BLAS."""
    import mlx.core as mx

    # Where the engine's arrays go (the default device), not merely what is installed: with
    # the CPU as default on a GPU machine, the engine runs, and picks its settings, as on a CPU.
    cuda = getattr(mx, "cuda", None)
    is_available = getattr(cuda, "is_available", None)
    if mx.default_device() == mx.cpu:
        backend = "cpu"
    elif mx.metal.is_available():
        backend = "metal"
    else:
        backend = "cuda" if is_available is not None and is_available() else "gpu"

    return {
        "backend": backend,
        "float32_matmuls": float32_matmuls(backend),
        "mlx_version": mx.__version__,
        "blas": _loaded,
        "blas_kernels": _kernels,
        "blas_kernels_replaced": _replaced_kernels,
        "platform": sys.platform,
        "machine": _platform.machine(),
    }


def available_memory() -> int | None:
    """Bytes of memory a new allocation can use now: MemAvailable on Linux, the physical
    memory elsewhere (macOS shares it with the GPU); None where neither can be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
