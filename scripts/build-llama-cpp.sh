#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-batched-bench and llama-server, the peer that
# benchmarks/llama_cpp_peer.py measures on the embedded model's own GGUF. The sources come from
# PyPI's llama-cpp-python sdist (it vendors llama.cpp), so nothing but the package registry is
# reached. A long C++ build (12 minutes on 2 cores of an x86 virtual machine), cached outside the
# repository; its progress and any missing tool or option are printed:
#
#   ./scripts/build-llama-cpp.sh            # builds into ~/.cache/batchscope/llama.cpp
#   BATCHSCOPE_LLAMA_CPP=DIR ./scripts/build-llama-cpp.sh
#   LLAMA_CPP_PYTHON_VERSION=X.Y.Z ./scripts/build-llama-cpp.sh   # another sdist (default 0.3.36)
#
# Instruction sets: GGML_NATIVE, all the CPU has, except where the CPU advertises AMX (amx_tile
# in /proc/cpuinfo) and a probe that runs one tile instruction faults, as it does on some
# virtual machines: a native build would then die with "Illegal instruction" in
# ggml_backend_amx_mul_mat, so the build turns GGML_NATIVE off and names the CPU's other sets
# (AVX, AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX-512 F/VBMI/VNNI/BF16), AMX off. The flags are kept
# in build/batchscope-isa.txt (the peer benchmark names them from build/CMakeCache.txt); a build
# with other flags than this host wants is built again.
#
# Needs cmake, a C and a C++ compiler and pip (apt-get install cmake gcc g++).
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the comment above, nothing built
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 0
fi

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${BATCHSCOPE_LLAMA_CPP:-${XDG_CACHE_HOME:-$HOME/.cache}/batchscope/llama.cpp}"
BIN="$ROOT/build/bin"
STAMP="$ROOT/build/batchscope-isa.txt"
TARGETS=(llama-bench llama-batched-bench llama-server)
START=$SECONDS

die() { echo "error: $*" >&2; exit 1; }
step() { echo "# [$(( (SECONDS - START) / 60 ))m$(( (SECONDS - START) % 60 ))s] $*"; }

for tool in cmake cc c++ tar; do
    command -v "$tool" >/dev/null || die "$tool not found: the build needs cmake, a C and a C++ compiler and tar (apt-get install cmake gcc g++)"
done
PIP="${PIP:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/pip}"
[ -x "$PIP" ] || PIP="$(command -v pip || command -v pip3 || true)"
[ -n "$PIP" ] || die "pip not found (the project's .venv/bin/pip, pip or pip3): it downloads the llama-cpp-python sdist"
JOBS="$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2)"

# 0: an AMX tile instruction runs here (Linux grants the tile state on request); 1: it faults;
# 2: the compiler cannot build the probe (-mamx-tile): nothing is known, AMX is left out.
amx_probe() {
    local dir status
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
    if ! cc -O1 -mamx-tile "$dir/probe.c" -o "$dir/probe" 2>/dev/null; then
        status=2
    # Run by a shell of its own whose stderr is dropped: it, not this one, reports the fault.
    elif bash -c '"$0"; exit $?' "$dir/probe" 2>/dev/null; then
        status=0
    else
        status=1
    fi
    rm -rf "$dir"
    return $status
}

# The instruction sets: GGML_NATIVE unless AMX is advertised and does not run (see the header).
ISA=(-DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    amx=0
    amx_probe || amx=$?
    if [ "$amx" != 0 ]; then
        if [ "$amx" = 2 ]; then
            step "this CPU advertises AMX, but cc cannot compile the AMX probe (-mamx-tile): building without AMX"
        else
            step "this CPU advertises AMX but faults on its first tile instruction: building without AMX"
        fi
        ISA=(-DGGML_NATIVE=OFF)
        for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI \
                    avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
                    avx512_bf16:AVX512_BF16; do
            grep -qw "${pair%%:*}" /proc/cpuinfo && ISA+=("-DGGML_${pair#*:}=ON")
        done
        ISA+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    else
        step "AMX runs on this CPU: a native build"
    fi
fi

if [ -x "$BIN/llama-bench" ] && [ -x "$BIN/llama-batched-bench" ] && [ -x "$BIN/llama-server" ] \
        && [ "$(cat "$STAMP" 2>/dev/null)" = "llama-cpp-python $VERSION ${ISA[*]}" ]; then
    echo "llama.cpp already built in $BIN (llama-cpp-python $VERSION, ${ISA[*]})"
    exit 0
fi

mkdir -p "$ROOT"
cd "$ROOT"
if [ -d src ] && [ ! -f "sdist/llama_cpp_python-$VERSION.tar.gz" ]; then
    die "$ROOT/src holds another llama-cpp-python version's sources than $VERSION: remove $ROOT to build $VERSION"
fi
if [ ! -d src ]; then
    step "downloading the llama-cpp-python $VERSION sdist"
    "$PIP" download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d sdist \
        || die "pip could not download the llama-cpp-python $VERSION sdist"
    rm -rf src.tmp && mkdir -p src.tmp
    tar -xzf "sdist/llama_cpp_python-$VERSION.tar.gz" -C src.tmp
    [ -d "src.tmp/llama_cpp_python-$VERSION/vendor/llama.cpp/ggml" ] \
        || die "the llama-cpp-python $VERSION sdist has no vendor/llama.cpp"
    mv "src.tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" src
    rm -rf src.tmp
fi
step "configuring (${ISA[*]})"
cmake -S src -B build -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON \
    > build-configure.log 2>&1 || { tail -n 30 build-configure.log >&2; die "cmake could not configure llama.cpp (the whole log: $ROOT/build-configure.log)"; }
# An option this llama.cpp does not have is only a warning to cmake: refuse it here.
for def in "${ISA[@]}"; do
    name="${def#-D}"
    grep -qx "${name%%=*}:BOOL=${name#*=}" build/CMakeCache.txt \
        || die "llama.cpp (llama-cpp-python $VERSION) has no build option ${name%%=*}"
done
step "building ${TARGETS[*]} with $JOBS jobs (a long C++ build; cmake prints its progress)"
cmake --build build --config Release -j "$JOBS" --target "${TARGETS[@]}" \
    || die "the llama.cpp build failed (see the compiler's message above)"
for tool in "${TARGETS[@]}"; do
    "$BIN/$tool" --help >/dev/null 2>&1 || die "$BIN/$tool was built but does not run (--help)"
done
echo "llama-cpp-python $VERSION ${ISA[*]}" > "$STAMP"
step "llama.cpp built in $BIN"
