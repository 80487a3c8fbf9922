#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-batched-bench and llama-server, the peer that
# benchmarks/llama_cpp_peer.py measures on the embedded model's own GGUF. The sources come from
# PyPI's llama-cpp-python sdist (it vendors llama.cpp), so nothing but the package registry is
# reached. A long C++ build, cached outside the repository:
#
#   ./scripts/build-llama-cpp.sh            # builds into ~/.cache/batchscope/llama.cpp
#   BATCHSCOPE_LLAMA_CPP=DIR ./scripts/build-llama-cpp.sh
#
# Needs cmake and a C++ compiler (apt-get install cmake g++).
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the comment above, nothing built
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 0
fi

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${BATCHSCOPE_LLAMA_CPP:-${XDG_CACHE_HOME:-$HOME/.cache}/batchscope/llama.cpp}"
BIN="$ROOT/build/bin"
TARGETS=(llama-bench llama-batched-bench llama-server)

if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-batched-bench" ] && [ -x "$BIN/llama-server" ]; then
    echo "llama.cpp already built in $BIN"
    exit 0
fi
for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found (apt-get install cmake g++)" >&2; exit 1; }
done
PIP="${PIP:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/pip}"
[ -x "$PIP" ] || PIP=pip

mkdir -p "$ROOT"
cd "$ROOT"
if [ ! -d src ]; then
    echo "# downloading the llama-cpp-python $VERSION sdist"
    "$PIP" download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d sdist
    mkdir -p src.tmp
    tar -xzf sdist/llama_cpp_python-"$VERSION".tar.gz -C src.tmp
    mv src.tmp/llama_cpp_python-"$VERSION"/vendor/llama.cpp src
    rm -rf src.tmp
fi
echo "# configuring (GGML_NATIVE: the kernels this CPU has)"
cmake -S src -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
echo "# building ${TARGETS[*]} (a long C++ build)"
cmake --build build --config Release -j "$(nproc)" --target "${TARGETS[@]}"
echo "llama.cpp built in $BIN"
