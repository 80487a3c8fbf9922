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

# Whether an AMX tile instruction runs here (Linux grants the tile state on request).
amx_works() {
    local dir
    dir="$(mktemp -d)"
    cat > "$dir/probe.c" <<'C'
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;
    unsigned char cfg[64] = {0};
    cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;  /* palette 1; tile 0: 16 rows of 64 bytes */
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    return 0;
}
C
    local ok=1
    # Run by a shell of its own whose stderr is dropped: it, not this one, reports the fault.
    if cc -O1 -mamx-tile "$dir/probe.c" -o "$dir/probe" 2>/dev/null \
            && bash -c '"$0"; exit $?' "$dir/probe" 2>/dev/null; then
        ok=0
    fi
    rm -rf "$dir"
    return $ok
}

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
# GGML_NATIVE builds for every instruction set the CPU advertises. Some virtual machines
# advertise AMX but fault on its first tile instruction, and every tool would then die with
# "Illegal instruction": where the CPU says amx_tile, a probe runs one, and if it faults the
# build names the other instruction sets the CPU has, AMX left out.
ISA=(-DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && ! amx_works; then
    echo "# this CPU advertises AMX but faults on it: building without AMX"
    ISA=(-DGGML_NATIVE=OFF)
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI \
                avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
                avx512_bf16:AVX512_BF16; do
        flag="${pair%%:*}"
        grep -qw "$flag" /proc/cpuinfo && ISA+=("-DGGML_${pair#*:}=ON")
    done
fi
echo "# configuring (${ISA[*]})"
cmake -S src -B build -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON >/dev/null
echo "# building ${TARGETS[*]} (a long C++ build)"
cmake --build build --config Release -j "$(nproc)" --target "${TARGETS[@]}"
echo "llama.cpp built in $BIN"
