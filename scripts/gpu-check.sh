#!/usr/bin/env bash
# Checks batchscope on MLX's CUDA backend in one run and writes report.md and report.json
# (docs/gpu.md). On a Linux machine with an NVIDIA GPU and its driver:
#
#   ./scripts/gpu-check.sh                 # installs mlx[cuda] at the pinned MLX version
#   ./scripts/gpu-check.sh --out DIR       # default: ./gpu-check-<UTC time>, made fresh
#   ./scripts/gpu-check.sh --no-install    # the .venv as it is (a second run)
#   ./scripts/gpu-check.sh --cpu           # MLX's CPU backend, small sizes: what CI runs
#   ./scripts/gpu-check.sh --no-install --steps device,tests --tests 'f32 or preemption'
#                                          # a rerun of chosen steps; --tests: pytest's -k
#
# Steps, each under its own time limit (timeout); a failed step is recorded and the next runs:
#   install    scripts/setup.sh; then, unless --cpu, mlx[cuda] in place of mlx[cpu], and a
#              GPU must be what MLX sees (no nvidia-smi, a failed import or a CPU default
#              device end the check here)
#   device     the device MLX sees, its numerics (float32 matmul error, whether a row's bits
#              hold among other rows) and what `auto` picks there on the embedded model; on a GPU
#              the native CPU kernels must not be loaded
#   tests      the engine's reference tests: greedy ids against mlx-lm on the exported model,
#              batched against alone, prefix cache, preemption, speculation, every family's
#              tiny folder (--cpu: a subset, run on MLX's own ops as on a GPU)
#   calibrate  `batchscope calibrate`, short
#   diverge    `batchscope diverge --search` (gemm against gemv), a few prompts
#   batching   benchmarks/engine_batching.py: decode tok/s at 1, 4, 8 and 16 sequences
#   serve      `batchscope serve` against `mlx_lm.server` on one exported folder, 8 streams,
#              with the load client of `batchscope bench serve` (benchmarks/peers.py)
# The exit code is 0 only when every step passed (steps left out by --steps: not_run, and the
# report says PARTIAL). On a GPU the limits after the install add
# up to 10 minutes. Needs bash 5, GNU timeout and the package index (or a pip cache) for the
# install.
set -euo pipefail

if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the comment above, nothing run
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 0
fi

MODE=gpu
INSTALL=1
OUT=""
CHOSEN=""
TESTS_K=""
NAMES=(install device tests calibrate diverge batching serve)
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) MODE=cpu ;;
        --no-install) INSTALL=0 ;;
        --out) [ $# -ge 2 ] || { echo "error: --out needs a folder" >&2; exit 2; }
               OUT="$2"; shift ;;
        --steps) [ $# -ge 2 ] || { echo "error: --steps needs names, e.g. device,tests" >&2; exit 2; }
                 CHOSEN=",$2,"; shift ;;
        --tests) [ $# -ge 2 ] || { echo "error: --tests needs a pytest -k expression" >&2; exit 2; }
                 TESTS_K="$2"; shift ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
for name in ${CHOSEN//,/ }; do
    case " ${NAMES[*]:1} " in
        *" $name "*) ;;
        *) echo "error: --steps: no step $name (steps: ${NAMES[*]:1}; the install: --no-install)" >&2
           exit 2 ;;
    esac
done
OUT="${OUT:-gpu-check-$(date -u +%Y%m%d-%H%M%S)}"
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then
    echo "error: $OUT is not empty: give a new or empty folder" >&2
    exit 2
fi
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
command -v timeout >/dev/null || { echo "error: GNU timeout not found" >&2; exit 2; }
cd "$(dirname "$0")/.."

PY=.venv/bin/python
MLX_VERSION="$(sed -n 's/^ *"mlx==\([^"]*\)".*/\1/p' pyproject.toml | head -n 1)"
# Nothing from this machine's own calibrations: the engine reads, and calibrate writes, here.
export BATCHSCOPE_CALIBRATION_DIR="$OUT/calibration"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# Which tests: the reference checks of the engine (tests/engine, tests/e2e; docs/gpu.md).
# The references against mlx-lm first, then batched against alone: a GPU's first run compiles
# kernels as it goes, and may reach its limit before the end.
TEST_FILES=(tests/e2e/test_reference.py tests/engine/test_family_*.py tests/engine/test_engine.py
            tests/engine/test_speculative.py tests/engine/test_draft.py)
ENGINE_TESTS="eight_requests_together_equal_each_alone or chunked_prefill_mixed_with_decode \
or preemption_and_resume or prefix_cache_hits or float32_model_gives_the_same_tokens_batched \
or greedy_with_drafts_equals_greedy_without or prompt_lookup_gives_the_same_tokens \
or preemption_mid_verification or greedy_with_draft_model_equals"
if [ "$MODE" = gpu ]; then
    TESTS="$ENGINE_TESTS or greedy_equals_mlx_lm or batched_equals_alone \
or cli_greedy_tokens_equal_mlx_lm or chat_prompt_matches or batched_engine_equals_mlx_lm \
or long_prompt_in_several_chunks"
    PER_TEST=120
    CALIBRATE=(--concurrency 1 4 8 16 --max-tokens 16)
    DIVERGE=(--limit 8 --max-tokens 32)
    BATCHING=(--concurrency 1 4 8 16 --max-tokens 32)
    SERVE=()
    # seconds: install, device, tests, calibrate, diverge, batching, serve (600 after install);
    # the first GPU run took over 40 s to start the engine (kernels compiled on first use)
    LIMITS=(900 120 200 60 40 80 100)
else
    # On the CPU a GPU's `auto` is emulated: MLX's own ops for attention and the row kernels
    # (tests/conftest.py), and only the families' 4-bit greedy check and one real-model prompt.
    export BATCHSCOPE_TEST_KERNELS=mlx
    TESTS="$ENGINE_TESTS or greedy_equals_mlx_lm_q4 \
or (cli_greedy_tokens_equal_mlx_lm and capital)"
    PER_TEST=300
    CALIBRATE=(--concurrency 1 4 --max-tokens 4)
    DIVERGE=(--limit 2 --max-tokens 8)
    # float32: at q4 mlx-lm's side (batch_generate, serial) takes MLX's CPU quantized matmul,
    # one row at a time, and alone outlasts five minutes at 8 and 16 sequences.
    BATCHING=(--weights f32 --concurrency 1 4 --max-tokens 8)
    SERVE=(--quick)
    LIMITS=(900 120 600 180 180 300 420)
fi
TESTS="${TESTS_K:-$TESTS}"

# NAME LIMIT_S COMMAND...: run it under a time limit with its output in logs/NAME.log, and
# record how it went in steps.tsv (name, status, exit code, seconds, limit).
run_step() {
    local name="$1" limit="$2" rc=0 status start seconds
    shift 2
    echo "==> $name (limit ${limit} s)"
    start=$EPOCHREALTIME
    # SIGINT first: pytest then prints its failures so far, and Python unwinds (servers stop).
    timeout --signal=INT --kill-after=30 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1 || rc=$?
    seconds=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    case $rc in
        0) status=passed ;;
        124|137) status=timed_out ;;
        *) status=failed ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$seconds" "$limit" >>"$OUT/steps.tsv"
    echo "    $status in ${seconds} s (logs/$name.log)"
    if [ "$status" != passed ]; then
        tail -n 15 "$OUT/logs/$name.log" | sed 's/^/    | /'
    fi
    [ "$status" = passed ]
}

skip_step() {  # NAME LIMIT_S [STATUS]: not run (skipped: the install failed)
    printf '%s\t%s\t\t0\t%s\n' "$1" "${3:-skipped}" "$2" >>"$OUT/steps.tsv"
}

chosen() {  # NAME LIMIT_S: whether --steps (or its absence) runs this step; if not, recorded
    if [ -z "$CHOSEN" ] || [[ "$CHOSEN" == *",$1,"* ]]; then return 0; fi
    skip_step "$1" "$2" not_run
    return 1
}

install() {
    set -euo pipefail  # a function run by `bash -c` does not inherit this shell's options
    if [ "$MODE" = gpu ] && ! command -v nvidia-smi >/dev/null; then
        echo "no GPU here: nvidia-smi not found (install the NVIDIA driver, or run --cpu)"
        return 1
    fi
    ./scripts/setup.sh
    if [ "$MODE" = gpu ]; then
        # mlx[cpu] and mlx[cuda] write the same library files: setup.sh has just installed
        # the CPU one, so both go and the CUDA one comes back alone (the same on a rerun).
        local installed
        installed=$("$PY" -m pip list --format=freeze | grep -ioE '^mlx[-_]c(pu|uda[-_0-9]*)==' \
                    | tr -d '=' || true)
        # shellcheck disable=SC2086
        [ -z "$installed" ] || "$PY" -m pip uninstall -y -q $installed
        "$PY" -m pip install -q "mlx[cuda]==$MLX_VERSION"
    fi
    "$PY" - "$MODE" <<'PY'
import sys

import mlx.core as mx

device = mx.default_device()
print(f"MLX {mx.__version__}: default device {device}")
if sys.argv[1] == "gpu" and device.type != mx.gpu:
    sys.exit("MLX's default device is not a GPU: the CUDA wheel does not fit this driver or "
             "GPU (try: python -c 'import mlx.core as mx; mx.ones(1, stream=mx.gpu)')")
PY
}

echo "gpu-check ($MODE, MLX $MLX_VERSION) -> $OUT"
if [ "$MODE" = gpu ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        >"$OUT/nvidia-smi.txt" 2>&1 || true
fi
ok=1
if [ "$INSTALL" = 1 ]; then
    export -f install
    export MODE PY OUT MLX_VERSION
    run_step install "${LIMITS[0]}" bash -c install || ok=0
else
    printf 'install\toff\t\t0\t%s\n' "${LIMITS[0]}" >>"$OUT/steps.tsv"  # --no-install
fi
if [ "$ok" = 0 ]; then
    echo "the install failed: nothing else is checked"
    for i in 1 2 3 4 5 6; do skip_step "${NAMES[$i]}" "${LIMITS[$i]}"; done
else
    require=(); [ "$MODE" = gpu ] && require=(--require-gpu)
    chosen device "${LIMITS[1]}" && { run_step device "${LIMITS[1]}" "$PY" scripts/gpu_check.py \
        device "$OUT" "${require[@]}" || true; }
    chosen tests "${LIMITS[2]}" && { run_step tests "${LIMITS[2]}" "$PY" -m pytest -q \
        -p no:cacheprovider -rfE --timeout "$PER_TEST" --junitxml "$OUT/tests.xml" \
        -k "$TESTS" "${TEST_FILES[@]}" || true; }
    chosen calibrate "${LIMITS[3]}" && { run_step calibrate "${LIMITS[3]}" \
        .venv/bin/batchscope calibrate "${CALIBRATE[@]}" --repeats 1 \
        --out "$OUT/calibration" || true; }
    chosen diverge "${LIMITS[4]}" && { run_step diverge "${LIMITS[4]}" bash -c '"$@" > "$0"' \
        "$OUT/diverge.json" .venv/bin/batchscope diverge --search "${DIVERGE[@]}" --json || true; }
    chosen batching "${LIMITS[5]}" && { run_step batching "${LIMITS[5]}" "$PY" \
        benchmarks/engine_batching.py "${BATCHING[@]}" --repeats 1 \
        --out "$OUT/engine_batching.json" || true; }
    chosen serve "${LIMITS[6]}" && { run_step serve "${LIMITS[6]}" "$PY" scripts/gpu_check.py \
        serve "$OUT" "${SERVE[@]}" || true; }
fi

# The report reads what the steps left; it needs no MLX (an install may have failed).
PYREPORT="$PY"; [ -x "$PYREPORT" ] || PYREPORT=python3
"$PYREPORT" scripts/gpu_check.py report "$OUT" --mode "$MODE"
