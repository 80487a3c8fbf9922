"""batchscope against llama.cpp on the very GGUF the embedded model loads, in one run.

llama.cpp is optional: ./scripts/build-llama-cpp.sh builds llama-bench, llama-batched-bench and
llama-server (a long C++ build, cached outside the repository; BATCHSCOPE_LLAMA_CPP names
another build). Without it this script says so and exits with code 3.

    .venv/bin/python benchmarks/llama_cpp_peer.py [--sections decode serve1 serve] [--threads 2]

decode  the engine's aggregate decode tok/s (weights q4 and f32, and q4 with int8 activations;
        benchmarks/engine_batching.py's prompts and method: decode from the extra time of a
        33-token call) at 1, 4, 8 and 16 sequences, against `llama-batched-bench -npp 64
        -ntg 32 -npl 1,4,8,16` (its S_TG), in --repeats rounds of llama.cpp then each engine
        (started once): medians of the rounds, and each ratio the median of the rounds' own.
serve1  one person's view: `batchscope serve`, `batchscope serve --activations int8` (an
        option: activations rounded to 8 bits, as llama.cpp's Q4 matmuls do) and
        `llama-server` (-np 1), all started, each driven once cold, then in --repeats warm
        rounds (the three in turn, the first of a round rotating) by `batchscope bench serve
        --num-prompts 12 --max-concurrency 1 --seed 0 --ignore-eos on`, one request at a time:
        output tok/s, median TPOT, median TTFT; warm rates are the rounds' medians, the warm
        ratio the median of the rounds' own. The goal is the default's.
serve   8 streams: `batchscope serve` (its default weights: q4 where the native kernel is
        built) and `llama-server -np 8` on the GGUF, as serve1 (both started, once cold, then
        --repeats warm rounds in turn; warm: llama-server's prompt cache and batchscope's
        prefix cache hold the prompts) with `batchscope bench serve --num-prompts 32
        --max-concurrency 8 --seed 0 --ignore-eos on`; then `mlx_lm.server` alone, once cold
        and once warm, on the folder `batchscope export-model --weights f32` writes (its
        fastest format on the CPU: at q4 MLX's CPU quantized matmul takes one row at a time,
        benchmarks/results/decode_quantized.md): output tok/s, median TPOT, p99 TTFT.

Writes llama_cpp.md and llama_cpp.json to --out-dir (benchmarks/results); a run of one section
keeps the other's last results (each section is one run of its own, with its date and host: the
CPU's model, its cores, and how llama.cpp was built: its version, compiler and instruction-set
options, AMX on or off). Progress on stderr.

The full remeasure is `.venv/bin/python benchmarks/llama_cpp_peer.py`; `--sections decode
--repeats 1` is the quickest run that measures something.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
import engine_batching as eb  # benchmarks/engine_batching.py (the script directory is on sys.path)
from peers import free_port, running_server, server_commands  # benchmarks/peers.py
# isort: on

from engine import native
from engine.engine import Engine
from engine.model_loader import embedded_gguf_path
from engine.platform import backend_info, blas_text

SEQUENCES = (1, 4, 8, 16)
# Goals of the 4-bit kernel work: engine decode at q4 / llama-batched-bench's S_TG.
DECODE_GOAL = {1: 1.0, 4: 1.3, 8: 1.3, 16: 1.3}  # the open goal: ahead at every batch size
SERVE_STREAMS = 8
SERVE_GOAL = 1.6  # batchscope / llama-server at 8 streams
BENCH_SERVE = ["--num-prompts", "32", "--max-concurrency", str(SERVE_STREAMS), "--seed", "0",
               "--ignore-eos", "on"]
# One stream: fewer prompts, each served alone (the goal: batchscope / llama-server >= 1.3).
SERVE_ONE_PROMPTS = 12
BENCH_SERVE_ONE = ["--num-prompts", str(SERVE_ONE_PROMPTS), "--max-concurrency", "1", "--seed",
                   "0", "--ignore-eos", "on"]
SERVE_ONE_GOAL = 1.3
TOOLS = ("llama-bench", "llama-batched-bench", "llama-server")


def llama_cpp_bin() -> Path | None:
    """The folder holding the built llama.cpp tools, or None when they are not built."""
    root = os.environ.get("BATCHSCOPE_LLAMA_CPP") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchscope" / "llama.cpp"
    bin_dir = Path(root) / "build" / "bin"
    return bin_dir if all((bin_dir / t).is_file() for t in TOOLS) else None


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# ---- the host ---------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model string: /proc/cpuinfo's on Linux, sysctl's on macOS."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        done = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                              text=True)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    return platform.processor() or "CPU model unknown"  # e.g. Linux on Arm: no model name


# The CMake options that choose llama.cpp's instruction sets (build-llama-cpp.sh sets them).
_ISA_OPTION = re.compile(r"^GGML_(NATIVE|AVX\w*|FMA|F16C|BMI2|AMX_\w+):BOOL=(ON|OFF)$", re.M)


def llama_cpp_build(bin_dir: Path) -> dict:
    """How the llama.cpp tools in bin_dir were built: the sdist they come from, llama.cpp's own
    version line (its build number, and the compiler) and the instruction-set options in the
    CMake cache, AMX among them."""
    cache = bin_dir.parent / "CMakeCache.txt"
    if not cache.is_file():
        raise RuntimeError(f"{cache} is missing: the llama.cpp build's options cannot be named "
                           "(./scripts/build-llama-cpp.sh builds it)")
    options = dict(_ISA_OPTION.findall(cache.read_text()))
    if "NATIVE" not in options:
        raise RuntimeError(f"{cache} names no GGML_NATIVE: not a llama.cpp build")
    done = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True,
                          text=True, timeout=60)
    version = " ".join((done.stdout + done.stderr).split())
    if done.returncode != 0 or "version:" not in version:
        raise RuntimeError(f"llama-server --version printed no version: {version[-500:]!r}")
    return {"llama_cpp_python": llama_cpp_python_version(bin_dir),
            "version": version[version.index("version:"):], "options": options}


def isa_text(options: dict[str, str]) -> str:
    """The instruction-set options in words: 'GGML_NATIVE=OFF; AVX, AVX2 ... on; AMX off'."""
    if options["NATIVE"] == "ON":
        return "GGML_NATIVE=ON (every instruction set of the CPU it was built on)"
    on = [k for k, v in options.items() if v == "ON" and k != "NATIVE"]
    amx = [k for k in options if k.startswith("AMX_")]
    amx_state = ("AMX off" if all(options[k] == "OFF" for k in amx) else
                 "AMX " + ", ".join(f"{k}={options[k]}" for k in amx))
    return f"GGML_NATIVE=OFF; {', '.join(on) or 'no instruction set'} on; {amx_state}"


def host_info(bin_dir: Path, threads: int) -> dict:
    """What a section's numbers depend on beyond the code: the CPU, the engine's backend and
    BLAS, the llama.cpp build and its threads."""
    info = backend_info()
    return {"cpu": cpu_model(), "cores": os.cpu_count(),
            "system": f"{platform.system()} {platform.machine()}", "backend": info["backend"],
            "blas": blas_text(info),
            "quantized_isa": native.decode_quantized_isa(), "threads": threads,
            "llama_cpp": llama_cpp_build(bin_dir)}


def legacy_host(previous: dict) -> dict:
    """A section from before hosts were recorded per section: what its file said of the run that
    wrote it last, the CPU model and llama.cpp's build options left unknown."""
    machine = previous["machine"]
    return {"cpu": None, "cores": machine["cpus"], "system": None,
            "backend": machine["backend"], "blas": machine["blas"],
            "quantized_isa": machine["quantized_isa"], "threads": previous["threads"],
            "llama_cpp": {"llama_cpp_python": previous["llama_cpp_python"], "version": None,
                          "options": None}}


def host_text(host: dict) -> str:
    build = host["llama_cpp"]
    peer = f"llama.cpp from the llama-cpp-python {build['llama_cpp_python']} sdist"
    if host["cpu"] is None:
        return (f"host not recorded with this section (it predates that): the file named "
                f"backend {host['backend']}, BLAS {host['blas']}, native quantized path "
                f"{host['quantized_isa']}, {host['cores']} CPUs, {host['threads']} llama.cpp "
                f"threads, {peer}, its build options not recorded")
    return (f"{host['cpu']}, {host['cores']} cores ({host['system']}); batchscope: backend "
            f"{host['backend']}, BLAS {host['blas']}, native quantized path "
            f"{host['quantized_isa']}; {peer} ({build['version']}), "
            f"{isa_text(build['options'])}, {host['threads']} threads")


# ---- decode -----------------------------------------------------------------------------------


def batched_bench(bin_dir: Path, gguf: Path, threads: int) -> dict[int, float]:
    """llama-batched-bench's aggregate decode tok/s (S_TG) by number of sequences."""
    npl = ",".join(map(str, SEQUENCES))
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", "8192", "-b", "2048",
           "-ub", "512", "-npp", "64", "-ntg", "32", "-npl", npl, "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rates = {}
    # Rows: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].isdigit():
            rates[int(cells[2])] = float(cells[7])
    if set(rates) != set(SEQUENCES):
        raise RuntimeError(f"could not read llama-batched-bench's table:\n{out[-2000:]}")
    return rates


# The engines measured against llama.cpp: key -> (weights, activations).
ENGINES = {"q4": ("q4", "float32"), "f32": ("f32", "float32"), "q4_int8": ("q4", "int8")}


def start_engine(weights: str, activations: str) -> Engine:
    config = eb.engine_config(weights, list(SEQUENCES))
    config.activations = activations
    eng = Engine(config).start()
    eb.run_engine(eng, eb.make_prompts(eng.loaded.tokenizer, 2), 4)  # warm-up
    return eng


def engine_rates(eng: Engine) -> dict[int, float]:
    """The engine's aggregate decode tok/s at each sequence count, one measurement each."""
    tokenizer = eng.loaded.tokenizer
    return {n: eb.rates(eb.measure(lambda p, k: eb.run_engine(eng, p, k),
                                   eb.make_prompts(tokenizer, n), 32))["decode_tps"]
            for n in SEQUENCES}


def section_decode(bin_dir: Path, gguf: Path, threads: int, rounds: int) -> dict:
    # Rounds of llama-batched-bench then each engine (started once, kept warm), so that the
    # machine's drift (runs of one build differ by up to ~15% on a shared host) hits both sides
    # of a round alike: a ratio is the median of the rounds' own ratios.
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    engines = {}
    try:
        for key, (weights, activations) in ENGINES.items():
            log(f"decode: starting the engine, {weights}, {activations} activations...")
            engines[key] = start_engine(weights, activations)
        runs = []
        for r in range(1, rounds + 1):
            log(f"decode: round {r} of {rounds}: llama-batched-bench...")
            run = {"llama_cpp": batched_bench(bin_dir, gguf, threads)}
            for key, eng in engines.items():
                run[key] = engine_rates(eng)
            log(f"decode: round {r}: " + "; ".join(
                f"{key} " + ", ".join(f"{run[key][n]:.1f}" for n in SEQUENCES)
                for key in ("llama_cpp", *ENGINES)) + f" tok/s at {SEQUENCES} sequences")
            runs.append(run)
        row_kernels = engines["q4"].row_kernels
    finally:
        for eng in engines.values():
            eng.stop()
    rows = []
    for n in SEQUENCES:
        row = {"sequences": n, "llama_cpp_runs": [run["llama_cpp"][n] for run in runs]}
        row["llama_cpp"] = statistics.median(row["llama_cpp_runs"])
        for key in ENGINES:
            row[f"{key}_runs"] = [run[key][n] for run in runs]
            row[key] = statistics.median(row[f"{key}_runs"])
        for key, name in (("q4", "ratio"), ("q4_int8", "int8_ratio")):
            row[f"{name}_runs"] = [run[key][n] / run["llama_cpp"][n] for run in runs]
            row[name] = statistics.median(row[f"{name}_runs"])
        row |= {"goal": DECODE_GOAL[n], "goal_met": row["ratio"] >= DECODE_GOAL[n]}
        rows.append(row)
    return {"rows": rows, "engines": {"q4": {"row_kernels": row_kernels}}, "repeats": rounds,
            "started": started}


# ---- serve ------------------------------------------------------------------------------------


def llama_server_command(bin_dir: Path, gguf: Path, port: int, threads: int,
                         slots: int = SERVE_STREAMS) -> list[str]:
    return [str(bin_dir / "llama-server"), "-m", str(gguf), "-np", str(slots), "-c",
            "16384", "-t", str(threads), "--host", "127.0.0.1", "--port", str(port)]


def bench_serve(url: str, out: Path, flags: list[str] = BENCH_SERVE) -> dict:
    cmd = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())",
           "bench", "serve", "--url", url, *flags, "--no-record", "--save-result", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    s = json.loads(out.read_text())["summary"]
    return {"output_tps": s["output_throughput"], "output_tokens": s["total_output_tokens"],
            "tpot_median_ms": s["tpot"]["median_ms"], "ttft_p99_ms": s["ttft"]["p99_ms"],
            "ttft_median_ms": s["ttft"]["median_ms"], "failed": s["failed"]}


# The batchscope server with 8-bit activations (--activations int8: the arithmetic of
# llama.cpp's own Q4 matmuls, activations rounded to 8 bits per block), an option beside the
# default; serve1 measures it too.
INT8_SERVER = "batchscope, int8 activations"


def against_goal(ratio: float, goal: float) -> str:
    """A ratio beside its goal: two decimals, more where two would round it onto the goal's
    other side (1.29999 is not 1.30x and met)."""
    for digits in (2, 3, 4, 6):
        text = f"{ratio:.{digits}f}"
        if (float(text) >= goal) == (ratio >= goal):
            return text + "x"
    return f"{ratio!r}x"


def _ratios(ours: dict, peer: dict) -> dict:
    """Cold and warm ratios of two servers' runs: warm the median of the rounds' own."""
    warm = [a["output_tps"] / b["output_tps"]
            for a, b in zip(ours["warm"], peer["warm"], strict=True)]
    return {"cold": ours["cold"]["output_tps"] / peer["cold"]["output_tps"],
            "warm": statistics.median(warm), "warm_rounds": warm}


def serve_in_rounds(bin_dir: Path, gguf: Path, threads: int, workdir: Path, rounds: int,
                    flags: list[str], slots: int, tag: str, int8: bool = False) -> dict:
    """batchscope serve and llama-server (-np `slots`), both started (and batchscope with
    int8 activations when asked): each driven once cold, then in `rounds` warm rounds of them
    in turn, the first of a round rotating, so that a shared host's drift hits all alike.
    Returns each server's runs and the ratios against llama-server: cold, warm (the median of
    the rounds' own) and each warm round's."""
    names = ["batchscope", *([INT8_SERVER] if int8 else []), "llama-server"]
    with contextlib.ExitStack() as stack:
        urls = {}
        for name in names:
            port = free_port()
            if name == "llama-server":
                cmd = llama_server_command(bin_dir, gguf, port, threads, slots=slots)
            else:
                cmd = server_commands("batchscope", port, "auto", workdir,
                                      workdir / f"{tag}-{len(urls)}.db")
                if name == INT8_SERVER:
                    cmd += ["--activations", "int8"]
            urls[name], _ = stack.enter_context(
                running_server(name, cmd, port, workdir / f"server-{len(urls)}-{tag}.log", log))

        def drive(name: str, label: str) -> dict:
            log(f"{tag}: {name}, {label}...")
            run = bench_serve(urls[name], workdir / f"run-{tag}.json", flags)
            log(f"{tag}: {name}, {label}: {run['output_tps']:.1f} output tok/s, p99 TTFT "
                f"{run['ttft_p99_ms']:.0f} ms")
            return run

        servers = {name: {"cold": drive(name, "cold"), "warm": []} for name in names}
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:
                servers[name]["warm"].append(drive(name, f"warm {i + 1}/{rounds}"))
    peer = servers["llama-server"]
    section = {"servers": servers, "ratios": _ratios(servers["batchscope"], peer),
               "rounds": rounds}
    if int8:
        section["ratios_int8"] = _ratios(servers[INT8_SERVER], peer)
    return section


def section_serve_one(bin_dir: Path, gguf: Path, threads: int, workdir: Path,
                      rounds: int) -> dict:
    """batchscope serve and llama-server, one request at a time (see the module docstring)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    return serve_in_rounds(bin_dir, gguf, threads, workdir, rounds, BENCH_SERVE_ONE, 1,
                           "serve1", int8=True) | {"started": started}


def _median_run(runs: list[dict]) -> dict:
    """Each figure of `runs` (a server's warm rounds) at its median over the rounds."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def _cold_and_warm(runs: dict) -> tuple[tuple[str, dict], tuple[str, dict]]:
    """A server's table rows: its cold run, and its warm rounds' medians (failed: their sum)."""
    warm = _median_run(runs["warm"]) | {"failed": sum(r["failed"] for r in runs["warm"])}
    return ("cold", runs["cold"]), ("warm", warm)


def section_serve(bin_dir: Path, gguf: Path, threads: int, workdir: Path, rounds: int) -> dict:
    """8 streams: batchscope serve and llama-server in rounds (serve_in_rounds), then
    mlx_lm.server alone, cold and once warm (see the module docstring)."""
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    section = serve_in_rounds(bin_dir, gguf, threads, workdir, rounds, BENCH_SERVE,
                              SERVE_STREAMS, "serve")
    model_dir = workdir / "model"
    subprocess.run([sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main())",
                    "export-model", str(model_dir), "--weights", "f32"], check=True,
                   stdout=subprocess.DEVNULL)
    port = free_port()
    cmd = server_commands("mlx_lm.server", port, "auto", model_dir, workdir / "mlx.db")
    with running_server("mlx_lm.server", cmd, port, workdir / "mlx_lm.server.log", log) as (
            url, _):
        runs = {}
        for phase in ("cold", "warm"):
            log(f"serve: mlx_lm.server, {phase}...")
            runs[phase] = bench_serve(url, workdir / f"mlx_lm.server-{phase}.json")
            log(f"serve: mlx_lm.server, {phase}: {runs[phase]['output_tps']:.1f} output tok/s")
    section["servers"]["mlx_lm.server"] = {"cold": runs["cold"], "warm": [runs["warm"]]}
    ours = section["servers"]["batchscope"]
    peer = section["servers"]["llama-server"]
    section["ttft_p99_lower"] = {
        "cold": ours["cold"]["ttft_p99_ms"] < peer["cold"]["ttft_p99_ms"],
        "warm": (_median_run(ours["warm"])["ttft_p99_ms"]
                 < _median_run(peer["warm"])["ttft_p99_ms"])}
    section["vs_mlx_lm_server"] = {
        "cold": ours["cold"]["output_tps"] / runs["cold"]["output_tps"],
        "warm": _median_run(ours["warm"])["output_tps"] / runs["warm"]["output_tps"]}
    return section | {"started": started}


# ---- output -----------------------------------------------------------------------------------


def render(data: dict) -> str:
    lines = [f"# batchscope and llama.cpp on {data['gguf']}", "",
             "`.venv/bin/python benchmarks/llama_cpp_peer.py` (llama.cpp built by "
             "`./scripts/build-llama-cpp.sh`); each section is a run of its own "
             "(`--sections decode serve1 serve`), on the host it names.", ""]
    if "decode" in data:
        d = data["decode"]
        q4 = d["engines"]["q4"]
        kernels = q4.get("row_kernels") or q4["decode_matmul"]  # the key of older results
        rounds = "ratio_runs" in d["rows"][0]  # each round's ratios: measured in rounds
        if rounds:
            method = (f"llama.cpp (`llama-batched-bench -npp 64 -ntg 32`, its S_TG) and the "
                      f"engines in process (prompts of 20-120 tokens, decode from the extra time "
                      f"of a 33-token call) measured in turn, {d['repeats']} rounds: each rate "
                      f"is the median of the rounds, each ratio the median of the rounds' own "
                      f"ratios (each round's are below the table)")
        else:  # results from before the rounds
            method = ("llama.cpp: `llama-batched-bench -npp 64 -ntg 32` (S_TG, the better of a "
                      "run before and one after the engine's). batchscope: the engine in "
                      "process, prompts of 20-120 tokens, decode from the extra time of a "
                      f"33-token call, median of {d['repeats']}")
        lines += ["## Decode, aggregate tok/s", "",
                  f"Run {d['started']}: {host_text(d['host'])}.", "",
                  f"{method}. Row kernels at q4: {kernels}.", "",
                  "| sequences | llama.cpp | batchscope q4 | batchscope f32 | q4 / llama.cpp "
                  "| goal | batchscope q4, int8 activations | int8 / llama.cpp |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in d["rows"]:
            # int8: --activations int8 (llama.cpp's own 8-bit activations), runs before it
            int8 = (f"{r['q4_int8']:.1f} | {r['int8_ratio']:.2f}x" if "q4_int8" in r
                    else "not measured | -")
            lines.append(f"| {r['sequences']} | {r['llama_cpp']:.1f} | {r['q4']:.1f} | "
                         f"{r['f32']:.1f} | {against_goal(r['ratio'], r['goal'])} | "
                         f">= {r['goal']:.1f}x: "
                         f"{'met' if r['goal_met'] else 'not met'} | {int8} |")
        if rounds:
            lines += ["", "| sequences | q4 / llama.cpp, each round | int8 / llama.cpp, each "
                      "round |", "|---|---|---|"]
            for r in d["rows"]:
                lines.append(f"| {r['sequences']} | "
                             + " | ".join(", ".join(f"{x:.2f}" for x in r[f"{name}_runs"])
                                          for name in ("ratio", "int8_ratio")) + " |")
        lines.append("")
    if "serve1" in data:
        s = data["serve1"]
        int8 = s.get("ratios_int8")  # measured since the option was added
        servers = ("`batchscope serve` (its default weights, q4; and with `--activations "
                   "int8`, an option: activations rounded to 8 bits, as llama.cpp's Q4 "
                   "matmuls do) and `llama-server -np 1` on the Q4_1 GGUF, all three running"
                   if int8 else "`batchscope serve` (its default weights, q4) and "
                   "`llama-server -np 1` on the Q4_1 GGUF, both running")
        lines += ["## Serving, one stream", "", f"Run {s['started']}: {host_text(s['host'])}.",
                  "", f"`batchscope bench serve {' '.join(BENCH_SERVE_ONE)}` against "
                  f"{servers}: once each cold, then {s['rounds']} warm "
                  f"round{'s' if s['rounds'] != 1 else ''} of the "
                  f"{'three' if int8 else 'two'} in turn. Warm figures "
                  "are the rounds' medians (failed: their sum); the warm ratio is the median "
                  "of the rounds' own.", "",
                  "| server | run | output tok/s | median TPOT ms | median TTFT ms | failed |",
                  "|---|---|---|---|---|---|"]
        for name, runs in s["servers"].items():
            for phase, r in _cold_and_warm(runs):
                lines.append(f"| {name} | {phase} | {r['output_tps']:.1f} | "
                             f"{r['tpot_median_ms']:.1f} | {r['ttft_median_ms']:.0f} | "
                             f"{r['failed']} |")
        lines += ["", "| run | batchscope / llama-server | goal (the default) |"
                  + (" int8 activations / llama-server |" if int8 else ""),
                  "|---|---|---|" + ("---|" if int8 else "")]
        for phase in ("cold", "warm"):
            ratio = s["ratios"][phase]
            lines.append(f"| {phase} | {against_goal(ratio, SERVE_ONE_GOAL)} | "
                         f">= {SERVE_ONE_GOAL:.1f}x: "
                         f"{'met' if ratio >= SERVE_ONE_GOAL else 'not met'} |"
                         + (f" {int8[phase]:.2f}x |" if int8 else ""))
        lines += ["", "Warm ratio per round: "
                  + ", ".join(f"{x:.2f}x" for x in s["ratios"]["warm_rounds"]) + "."
                  + (" Int8 activations: "
                     + ", ".join(f"{x:.2f}x" for x in int8["warm_rounds"]) + "."
                     if int8 else "")]
        lines.append("")
    if "serve" in data:
        s = data["serve"]
        lines += ["## Serving, 8 streams", "", f"Run {s['started']}: {host_text(s['host'])}.",
                  "", f"`batchscope bench serve {' '.join(BENCH_SERVE)}` against "
                  "`batchscope serve` (its default weights, q4) and `llama-server -np 8` on the "
                  f"Q4_1 GGUF, both running: once each cold, then {s['rounds']} warm "
                  f"round{'s' if s['rounds'] != 1 else ''} of the two in turn (warm: "
                  "llama-server's prompt cache and batchscope's prefix cache hold the prompts). "
                  "Then mlx_lm.server alone, once cold and once warm, on the model exported at "
                  "f32 (its fastest format on the CPU). Warm figures are the rounds' medians "
                  "(failed: their sum); the warm ratio is the median of the rounds' own.", "",
                  "| server | run | output tok/s | output tokens | median TPOT ms | p99 TTFT ms "
                  "| failed |", "|---|---|---|---|---|---|---|"]
        for name, runs in s["servers"].items():
            for phase, r in _cold_and_warm(runs):
                lines.append(f"| {name} | {phase} | {r['output_tps']:.1f} | "
                             f"{r['output_tokens']:.0f} | {r['tpot_median_ms']:.0f} | "
                             f"{r['ttft_p99_ms']:.0f} | {r['failed']} |")
        lines += ["", "| run | batchscope / llama-server | p99 TTFT lower | batchscope / "
                  "mlx_lm.server |", "|---|---|---|---|"]
        for phase in ("cold", "warm"):
            ratio = s["ratios"][phase]
            lines.append(f"| {phase} | {against_goal(ratio, SERVE_GOAL)} (goal >= "
                         f"{SERVE_GOAL:.1f}: "
                         f"{'met' if ratio >= SERVE_GOAL else 'not met'}) | "
                         f"{'yes' if s['ttft_p99_lower'][phase] else 'no'} | "
                         f"{s['vs_mlx_lm_server'][phase]:.2f}x (goal >= 1.5) |")
        lines += ["", "Warm ratio per round (batchscope / llama-server): "
                  + ", ".join(f"{x:.2f}x" for x in s["ratios"]["warm_rounds"]) + "."]
        lines.append("")
    return "\n".join(lines)


def llama_cpp_python_version(bin_dir: Path) -> str:
    sdist = list((bin_dir.parent.parent / "sdist").glob("llama_cpp_python-*.tar.gz"))
    m = re.search(r"llama_cpp_python-(.+)\.tar\.gz", sdist[0].name) if sdist else None
    return m.group(1) if m else "unknown"


def kept_sections(saved: Path) -> dict:
    """The sections of an earlier llama_cpp.json, each with its host (see legacy_host)."""
    if not saved.is_file():
        return {}
    previous = json.loads(saved.read_text())
    kept = {k: previous[k] for k in ("decode", "serve1", "serve") if k in previous}
    for name, section in kept.items():
        if "host" not in section:  # written before sections recorded their host
            section["host"] = legacy_host(previous)
            if name == "decode":
                section.setdefault("repeats", previous["repeats"])
    serve1 = kept.get("serve1")
    if serve1 is not None and "rounds" not in serve1:  # written as one warm run a server
        for runs in serve1["servers"].values():
            runs["warm"] = [runs["warm"]]
        serve1["rounds"] = 1
        serve1["ratios"]["warm_rounds"] = [serve1["ratios"]["warm"]]
    serve = kept.get("serve")
    if serve is not None and "rounds" not in serve:  # written as one cold and one warm run
        for runs in serve["servers"].values():
            runs["warm"] = [runs["warm"]]
        goals = serve.pop("goals")
        serve["rounds"] = 1
        serve["ratios"] = {"cold": goals["cold"]["vs_llama_server"],
                           "warm": goals["warm"]["vs_llama_server"],
                           "warm_rounds": [goals["warm"]["vs_llama_server"]]}
        serve["ttft_p99_lower"] = {k: g["ttft_p99_lower"] for k, g in goals.items()}
        serve["vs_mlx_lm_server"] = {k: g["vs_mlx_lm_server"] for k, g in goals.items()}
    return kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=["decode", "serve1", "serve"],
                    choices=["decode", "serve1", "serve"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="llama.cpp threads (default: all CPUs, as the engine uses)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="decode: rounds of llama.cpp and the engines in turn; serve1 and "
                    "serve: warm rounds of batchscope and llama-server in turn (default 5)")
    ap.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    bin_dir = llama_cpp_bin()
    if bin_dir is None:
        print("llama.cpp is not built: ./scripts/build-llama-cpp.sh builds it (a long C++ "
              "build); nothing was measured", file=sys.stderr)
        return 3
    gguf = embedded_gguf_path()
    host = host_info(bin_dir, args.threads)
    log(f"host: {host_text(host)}")
    data = {"gguf": gguf.name}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    saved = out / "llama_cpp.json"
    data.update(kept_sections(saved))  # the sections not run now keep their last results
    if "decode" in args.sections:
        data["decode"] = section_decode(bin_dir, gguf, args.threads, args.repeats) | {
            "host": host}
        saved.write_text(json.dumps(data, indent=1) + "\n")
    if "serve1" in args.sections:
        with tempfile.TemporaryDirectory(prefix="batchscope-llama-cpp-") as tmp:
            data["serve1"] = section_serve_one(bin_dir, gguf, args.threads, Path(tmp),
                                               args.repeats) | {"host": host}
        saved.write_text(json.dumps(data, indent=1) + "\n")
    if "serve" in args.sections:
        with tempfile.TemporaryDirectory(prefix="batchscope-llama-cpp-") as tmp:
            data["serve"] = section_serve(bin_dir, gguf, args.threads, Path(tmp),
                                          args.repeats) | {"host": host}
        saved.write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    (out / "llama_cpp.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
