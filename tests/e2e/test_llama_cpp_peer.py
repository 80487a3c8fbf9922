"""benchmarks/llama_cpp_peer.py without a llama.cpp build: it says how to build it, measures
nothing and writes nothing; the table it reads from llama-batched-bench is parsed as printed; the
host it records (the CPU, llama.cpp's version and instruction-set options) is read from the build;
and with llama.cpp built (./scripts/build-llama-cpp.sh), its quickest run measures and names the
host."""

from __future__ import annotations

import json
import os
import re
import statistics
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

# Lines of a CMake cache as build-llama-cpp.sh leaves it where AMX faults.
CMAKE_CACHE = """\
CMAKE_BUILD_TYPE:STRING=Release
GGML_AMX_BF16:BOOL=OFF
GGML_AMX_INT8:BOOL=OFF
GGML_AMX_TILE:BOOL=OFF
GGML_AVX:BOOL=ON
GGML_AVX2:BOOL=ON
GGML_AVX512:BOOL=ON
GGML_AVX512_VNNI:BOOL=ON
GGML_CUDA:BOOL=OFF
GGML_FMA:BOOL=ON
GGML_NATIVE:BOOL=OFF
"""


@pytest.fixture
def peer():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import llama_cpp_peer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return llama_cpp_peer


def test_without_a_build_it_says_how_to_build_it_and_exits_3(tmp_path):
    env = dict(os.environ, BATCHSCOPE_LLAMA_CPP=str(tmp_path / "none"))
    out = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, "benchmarks/llama_cpp_peer.py", "--out-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert "llama.cpp is not built: ./scripts/build-llama-cpp.sh builds it" in result.stderr
    assert not out.exists()


def test_the_batched_bench_table_is_read_as_printed(peer, monkeypatch, tmp_path):
    class Done:
        stdout = TABLE

    monkeypatch.setattr(peer.subprocess, "run", lambda *a, **k: Done())
    assert peer.batched_bench(tmp_path, tmp_path / "model.gguf", 2) == {
        1: 107.46, 4: 154.58, 8: 207.62, 16: 207.56}
    Done.stdout = TABLE.replace("|   16 |", "|   32 |")
    with pytest.raises(RuntimeError, match="could not read llama-batched-bench's table"):
        peer.batched_bench(tmp_path, tmp_path / "model.gguf", 2)


def fake_build(root: Path, cache: str, version: str) -> Path:
    """A build folder as build-llama-cpp.sh leaves it, its llama-server a script printing
    `version` as llama.cpp's --version does (on stderr)."""
    bin_dir = root / "build" / "bin"
    bin_dir.mkdir(parents=True)
    (root / "build" / "CMakeCache.txt").write_text(cache)
    (root / "sdist").mkdir()
    (root / "sdist" / "llama_cpp_python-0.3.36.tar.gz").write_bytes(b"")
    server = bin_dir / "llama-server"
    server.write_text(f"#!/bin/sh\necho '{version}' >&2\n")
    server.chmod(0o755)
    return bin_dir


def test_the_build_is_named_by_its_version_and_options(peer, tmp_path):
    line = "version: 0 (unknown)\nbuilt with cc (Debian 12.2.0-14) 12.2.0 for x86_64-linux-gnu"
    build = peer.llama_cpp_build(fake_build(tmp_path, CMAKE_CACHE, line))
    assert build == {
        "llama_cpp_python": "0.3.36",
        "version": "version: 0 (unknown) built with cc (Debian 12.2.0-14) 12.2.0 for "
                   "x86_64-linux-gnu",
        "options": {"AMX_BF16": "OFF", "AMX_INT8": "OFF", "AMX_TILE": "OFF", "AVX": "ON",
                    "AVX2": "ON", "AVX512": "ON", "AVX512_VNNI": "ON", "FMA": "ON",
                    "NATIVE": "OFF"}}
    assert peer.isa_text(build["options"]) == (
        "GGML_NATIVE=OFF; AVX, AVX2, AVX512, AVX512_VNNI, FMA on; AMX off")
    amx = dict(build["options"], AMX_TILE="ON", AMX_INT8="ON")
    assert peer.isa_text(amx).endswith("; AMX AMX_BF16=OFF, AMX_INT8=ON, AMX_TILE=ON")
    assert peer.isa_text({"NATIVE": "ON", "AVX": "OFF"}).startswith("GGML_NATIVE=ON (")


def test_a_build_it_cannot_name_is_refused(peer, tmp_path):
    bin_dir = fake_build(tmp_path / "a", CMAKE_CACHE, "no version here")
    with pytest.raises(RuntimeError, match="llama-server --version printed no version"):
        peer.llama_cpp_build(bin_dir)
    bin_dir = fake_build(tmp_path / "b", "CMAKE_BUILD_TYPE:STRING=Release\n", "version: 1 (x)")
    with pytest.raises(RuntimeError, match="names no GGML_NATIVE"):
        peer.llama_cpp_build(bin_dir)
    (bin_dir.parent / "CMakeCache.txt").unlink()
    with pytest.raises(RuntimeError, match="CMakeCache.txt is missing"):
        peer.llama_cpp_build(bin_dir)


def test_sections_from_before_hosts_were_recorded_say_so(peer, tmp_path):
    saved = tmp_path / "llama_cpp.json"
    rows = [{"sequences": n, "llama_cpp": 100.0, "llama_cpp_runs": [99.0, 100.0], "q4": 90.0,
             "f32": 50.0, "ratio": 0.9, "goal": 0.8, "goal_met": True} for n in peer.SEQUENCES]
    saved.write_text(json.dumps({
        "gguf": "model.gguf", "threads": 2, "repeats": 3, "llama_cpp_python": "0.3.36",
        "machine": {"backend": "cpu", "blas": "bundled", "quantized_isa": "avx512", "cpus": 2},
        "decode": {"rows": rows, "engines": {"q4": {"row_kernels": "native"}},
                   "started": "2026-12-02 11:46:09"}}))
    kept = peer.kept_sections(saved)
    assert set(kept) == {"decode"} and kept["decode"]["repeats"] == 3
    md = peer.render({"gguf": "model.gguf", **kept})
    assert ("Run 2026-12-02 11:46:09: host not recorded with this section (it predates that): "
            "the file named backend cpu, BLAS bundled, native quantized path avx512, 2 CPUs, "
            "2 llama.cpp threads, llama.cpp from the llama-cpp-python 0.3.36 sdist, its build "
            "options not recorded.") in md
    assert "| 1 | 100.0 | 90.0 | 50.0 | 0.90x | >= 0.8x: met |" in md


HOST = {"cpu": "a CPU", "cores": 2, "system": "Linux x86_64", "backend": "cpu",
        "blas": "bundled", "quantized_isa": "avx512", "threads": 2,
        "llama_cpp": {"llama_cpp_python": "0.3.36", "version": "version: 1 (x)",
                      "options": {"NATIVE": "OFF"}}}


# One bench serve run's figures as bench_serve returns them (the tests' own values).
ONE_STREAM_RUN = {"output_tps": 100.0, "output_tokens": 1536, "tpot_median_ms": 9.5,
                  "ttft_p99_ms": 40.0, "ttft_median_ms": 21.0, "failed": 0}
EIGHT_STREAM_RUN = dict(ONE_STREAM_RUN, output_tokens=3530, tpot_median_ms=40.0,
                        ttft_p99_ms=300.0, ttft_median_ms=90.0)


def rounds_section(ours_cold: dict, theirs_cold: dict, ours: list[dict], theirs: list[dict],
                   cold_ratio: float, started: str, **more) -> dict:
    """A serve section as serve_in_rounds records it: each warm round's ratio from its two
    runs' output tok/s, the warm ratio their median."""
    rounds = [a["output_tps"] / b["output_tps"] for a, b in zip(ours, theirs, strict=True)]
    return {"servers": {"batchscope": {"cold": ours_cold, "warm": ours},
                        "llama-server": {"cold": theirs_cold, "warm": theirs}},
            "ratios": {"cold": cold_ratio, "warm": statistics.median(rounds),
                       "warm_rounds": rounds},
            "rounds": len(rounds), "started": started, "host": HOST, **more}


def test_the_one_stream_section_gives_each_run_and_the_goal(peer):
    run = ONE_STREAM_RUN
    ours = [dict(run, output_tps=x) for x in (100.0, 90.0, 130.0)]
    theirs = [dict(run, output_tps=x, tpot_median_ms=t) for x, t in ((70.0, 8), (80.0, 9),
                                                                      (60.0, 12))]
    section = rounds_section(run, dict(run, output_tps=80.0), ours, theirs, 1.25,
                             "2026-12-03 17:00:00")
    md = peer.render({"gguf": "model.gguf", "serve1": section})
    assert "## Serving, one stream" in md
    assert "then 3 warm rounds of the two in turn" in md
    assert "| llama-server | warm | 70.0 | 9.0 | 21 | 0 |" in md  # the rounds' medians
    assert "| batchscope | warm | 100.0 | 9.5 | 21 | 0 |" in md
    assert "| cold | 1.25x | >= 1.3x: not met |" in md
    assert "| warm | 1.43x | >= 1.3x: met |" in md
    assert "Warm ratio per round: 1.43x, 1.12x, 2.17x." in md


def test_a_ratio_just_short_of_its_goal_is_not_printed_as_the_goal(peer):
    assert peer.against_goal(1.2999952, 1.3) == "1.299995x"
    assert peer.against_goal(1.2951, 1.3) == "1.295x"
    assert peer.against_goal(1.3, 1.3) == "1.30x"
    assert peer.against_goal(1.3049, 1.3) == "1.30x"  # met: two decimals say it
    assert peer.against_goal(1.2849, 1.3) == "1.28x"
    run = ONE_STREAM_RUN
    section = rounds_section(run, dict(run, output_tps=80.0),
                             [dict(run, output_tps=129.99952)],
                             [dict(run, output_tps=100.0)], 1.5, "2026-12-05 12:12:13")
    md = peer.render({"gguf": "model.gguf", "serve1": section})
    assert "| warm | 1.299995x | >= 1.3x: not met |" in md


def test_the_one_stream_section_gives_the_int8_option_beside_the_default(peer):
    run = ONE_STREAM_RUN
    ours = [dict(run, output_tps=x) for x in (100.0, 90.0)]
    int8 = [dict(run, output_tps=x) for x in (140.0, 120.0)]
    theirs = [dict(run, output_tps=x) for x in (100.0, 80.0)]
    section = rounds_section(run, dict(run, output_tps=80.0), ours, theirs, 1.25,
                             "2026-12-04 23:00:00")
    section["servers"] = {"batchscope": section["servers"]["batchscope"],
                          peer.INT8_SERVER: {"cold": dict(run, output_tps=120.0), "warm": int8},
                          "llama-server": section["servers"]["llama-server"]}
    section["ratios_int8"] = peer._ratios(section["servers"][peer.INT8_SERVER],
                                          section["servers"]["llama-server"])
    md = peer.render({"gguf": "model.gguf", "serve1": section})
    assert "then 2 warm rounds of the three in turn" in md and "--activations int8" in md
    assert "| batchscope, int8 activations | warm | 130.0 |" in md  # the rounds' median
    # the goal is the default's; the option's ratio stands beside it
    assert "| cold | 1.25x | >= 1.3x: not met | 1.50x |" in md
    assert "| warm | 1.06x | >= 1.3x: not met | 1.45x |" in md
    assert "Int8 activations: 1.40x, 1.50x." in md


def test_a_one_stream_section_of_one_warm_run_still_renders(peer, tmp_path):
    run = ONE_STREAM_RUN
    saved = tmp_path / "llama_cpp.json"
    saved.write_text(json.dumps({"serve1": {
        "servers": {"batchscope": {"cold": run, "warm": run},
                    "llama-server": {"cold": run, "warm": dict(run, output_tps=80.0)}},
        "ratios": {"cold": 1.0, "warm": 1.25}, "started": "2026-12-04 12:24:24",
        "host": HOST}}))
    md = peer.render({"gguf": "model.gguf", **peer.kept_sections(saved)})
    assert "then 1 warm round of" in md and "| llama-server | warm | 80.0 |" in md
    assert "Warm ratio per round: 1.25x." in md


@pytest.mark.slow
def test_its_quickest_run_measures_against_the_build_and_names_the_host(peer, tmp_path):
    bin_dir = peer.llama_cpp_bin()
    if bin_dir is None:
        pytest.skip("llama.cpp is not built (./scripts/build-llama-cpp.sh)")
    out = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, "benchmarks/llama_cpp_peer.py", "--sections", "decode", "--repeats",
         "1", "--out-dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "# decode: round 1 of 1: llama-batched-bench..." in result.stderr  # progress
    md = (out / "llama_cpp.md").read_text()
    data = json.loads((out / "llama_cpp.json").read_text())
    assert "## Serving" not in md and "serve" not in data  # only the section asked for
    host = data["decode"]["host"]
    assert host["cpu"] == peer.cpu_model() and host["cores"] == os.cpu_count()
    build = host["llama_cpp"]
    assert build["options"] == dict(peer._ISA_OPTION.findall(
        (bin_dir.parent / "CMakeCache.txt").read_text()))
    stamp = bin_dir.parent / "batchscope-isa.txt"  # what build-llama-cpp.sh built
    if stamp.is_file() and "-DGGML_NATIVE=OFF" in stamp.read_text():
        assert build["options"]["NATIVE"] == "OFF"
        assert all(build["options"][k] == "OFF" for k in ("AMX_TILE", "AMX_INT8", "AMX_BF16"))
    assert f"Run {data['decode']['started']}: {host['cpu']}, {host['cores']} cores" in md
    assert peer.isa_text(build["options"]) in md and build["version"] in md
    for n in peer.SEQUENCES:
        assert re.search(rf"^\| {n} \| \d+\.\d \| \d+\.\d \| \d+\.\d \| \d+\.\d\dx \|", md,
                         re.M), md
    assert str(tmp_path) not in md and str(Path.home()) not in md  # no paths of this machine


def test_the_eight_stream_section_gives_rounds_and_the_goal(peer):
    run = EIGHT_STREAM_RUN
    ours = [dict(run, output_tps=x, ttft_p99_ms=200.0) for x in (200.0, 150.0, 260.0)]
    theirs = [dict(run, output_tps=x) for x in (120.0, 100.0, 130.0)]
    section = rounds_section(dict(run, output_tps=170.0), run, ours, theirs, 1.7,
                             "2026-12-04 17:00:00",
                             ttft_p99_lower={"cold": False, "warm": True},
                             vs_mlx_lm_server={"cold": 170 / 30, "warm": 200 / 40})
    section["servers"]["mlx_lm.server"] = {"cold": dict(run, output_tps=30.0),
                                           "warm": [dict(run, output_tps=40.0)]}
    md = peer.render({"gguf": "model.gguf", "serve": section})
    assert "## Serving, 8 streams" in md and "then 3 warm rounds of the two in turn" in md
    assert "| batchscope | warm | 200.0 | 3530 | 40 | 200 | 0 |" in md  # the rounds' medians
    assert "| llama-server | warm | 120.0 | 3530 | 40 | 300 | 0 |" in md
    assert "| cold | 1.70x (goal >= 1.6: met) | no | 5.67x (goal >= 1.5) |" in md
    assert "| warm | 1.67x (goal >= 1.6: met) | yes | 5.00x (goal >= 1.5) |" in md
    assert "Warm ratio per round (batchscope / llama-server): 1.67x, 1.50x, 2.00x." in md


def test_an_eight_stream_section_of_one_cold_and_one_warm_run_still_renders(peer, tmp_path):
    run = EIGHT_STREAM_RUN
    goals = {phase: {"vs_llama_server": 1.5, "ttft_p99_lower": True, "vs_mlx_lm_server": 4.0}
             for phase in ("cold", "warm")}
    saved = tmp_path / "llama_cpp.json"
    saved.write_text(json.dumps({"serve": {
        "servers": {name: {"cold": run, "warm": run}
                    for name in ("batchscope", "llama-server", "mlx_lm.server")},
        "goals": goals, "started": "2026-12-04 14:32:07", "host": HOST}}))
    md = peer.render({"gguf": "model.gguf", **peer.kept_sections(saved)})
    assert "then 1 warm round of" in md
    assert "| warm | 1.50x (goal >= 1.6: not met) | yes | 4.00x (goal >= 1.5) |" in md
