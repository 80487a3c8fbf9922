"""benchmarks/context_length.py without running a model: llama-bench's JSON is read as printed,
and the table, goal lines and plot are rendered from a result dict."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import context_length as cl
finally:
    sys.path.remove(str(ROOT / "benchmarks"))

# `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -p 16 -n 0 -t 2 -r 1 -o json` (llama.cpp of
# llama-cpp-python 0.3.36), fields not read left out.
PP_JSON = """[
  {
    "build_commit": "unknown",
    "backends": "CPU",
    "model_type": "llama 256M Q4_1",
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "type_k": "f16",
    "type_v": "f16",
    "flash_attn": -1,
    "n_prompt": 16,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-02T00:55:40Z",
    "avg_ns": 60587826,
    "stddev_ns": 0,
    "avg_ts": 264.079454,
    "stddev_ts": 0.000000,
    "samples_ns": [ 60587826 ],
    "samples_ts": [ 264.079 ]
  }
]
"""
# ... -p 0 -n 4 -d 16 -r 2: generation after 16 tokens in the cache.
TG_JSON = PP_JSON.replace('"n_prompt": 16', '"n_prompt": 0').replace(
    '"n_gen": 0', '"n_gen": 4').replace('"n_depth": 0', '"n_depth": 16').replace(
    '"avg_ts": 264.079454', '"avg_ts": 111.978211').replace(
    '"samples_ts": [ 264.079 ]', '"samples_ts": [ 107.325, 116.632 ]')


def both_settings(one_test: str, other_ts: float) -> str:
    """`-fa 0,1` output: the test with flash attention off, then the same on at other_ts."""
    test = one_test.strip()[1:-1].strip()
    on = test.replace('"flash_attn": -1', '"flash_attn": 1')
    on = on[:on.index('"avg_ts"')] + f'"avg_ts": {other_ts},' + on[on.index('"stddev_ts"') - 1:]
    return "[" + test.replace('"flash_attn": -1', '"flash_attn": 0') + ",\n" + on + "]"


def test_llama_bench_json_is_read_as_printed():
    assert cl.parse_llama_bench(PP_JSON, 16, 0, 0) == {
        "tps": 264.079454, "samples_tps": [264.079], "flash_attn": -1,
        "tps_by_flash_attn": {-1: 264.079454}}
    assert cl.parse_llama_bench(TG_JSON, 0, 4, 16) == {
        "tps": 111.978211, "samples_tps": [107.325, 116.632], "flash_attn": -1,
        "tps_by_flash_attn": {-1: 111.978211}}
    # -fa 0,1: the faster setting counts, whichever it is.
    faster_on = cl.parse_llama_bench(both_settings(PP_JSON, 300.5), 16, 0, 0)
    assert faster_on["tps"] == 300.5 and faster_on["flash_attn"] == 1
    assert faster_on["tps_by_flash_attn"] == {0: 264.079454, 1: 300.5}
    faster_off = cl.parse_llama_bench(both_settings(TG_JSON, 50.0), 0, 4, 16)
    assert faster_off["tps"] == 111.978211 and faster_off["flash_attn"] == 0
    assert faster_off["samples_tps"] == [107.325, 116.632]
    with pytest.raises(RuntimeError, match=r"llama-bench ran p/n/d \(16, 0, 0\)"):
        cl.parse_llama_bench(PP_JSON, 32, 0, 0)
    with pytest.raises(RuntimeError, match="could not read llama-bench's JSON"):
        cl.parse_llama_bench("main: error: failed to load model\n", 16, 0, 0)
    with pytest.raises(RuntimeError, match="could not read llama-bench's JSON"):
        cl.parse_llama_bench(PP_JSON.replace('"avg_ts"', '"mean_ts"'), 16, 0, 0)


def row(n: int, ttft: float, decode: float, llama_pp: float | None = None,
        llama_tg: float | None = None, requested: int | None = None,
        kv: str = "auto (float32)") -> dict:
    r = {"requested": requested or n, "prompt_tokens": n, "kv": kv, "ttft_s": ttft,
         "prefill_tps": n / ttft, "decode_tps": decode, "ms_per_token": 1000 / decode}
    if llama_pp is not None:
        r |= {"llama_pp_tps": llama_pp, "llama_ttft_s": n / llama_pp, "llama_tg_tps": llama_tg,
              "llama_ms_per_token": 1000 / llama_tg,
              "ttft_ratio": (n / llama_pp) / ttft, "decode_ratio": decode / llama_tg}
    return r


def result(rows: list[dict], llama: bool = True) -> dict:
    data = {"command": ".venv/bin/python benchmarks/context_length.py", "started": "now",
            "gguf": "model.gguf", "weights": "q4", "weights_asked": "auto",
            "decode_tokens": 64, "repeats": 1, "max_num_batched_tokens": 512,
            "llama_cpp": llama, "threads": 2, "llama_repetitions": 2,
            "llama_cpp_python": "0.3.36" if llama else None,
            "machine": {"backend": "cpu", "blas": "openblas", "quantized_isa": "avx512",
                        "cpus": 2},
            "rows": rows}
    data["goals"] = cl.goals(data)
    return data


F32 = "(KV auto (float32))"  # how a goal line names the KV dtype of the rows it judges


def test_the_table_and_goals_render_met_and_not_met():
    # 4096: ours 20 s against llama.cpp's 4096 / 250 = 16.4 s; prefill 4096 / 20 = 205 tok/s
    # keeps 205 / 256 = 80% of the rate at 512 (512 / 2 s).
    data = result([row(512, 2.0, 60.0, 250.0, 70.0), row(4096, 20.0, 40.0, 250.0, 50.0),
                   row(8127, 50.0, 30.0, 200.0, 40.0, requested=8192)])
    data["rows"][2] |= {"llama_pp_fa": 1, "llama_tg_fa": 0}
    text = cl.render(data)
    assert "`.venv/bin/python benchmarks/context_length.py`" in text
    assert ("| 8127 (asked 8192) | auto (float32) | 50.000 | 163 | 200 (fa 1) | 0.81x | 30.0 | "
            "40.0 (fa 0) |") in text
    assert "backend cpu, BLAS openblas" in text and "2 CPUs" in text
    assert "| 512 | auto (float32) | 2.000 | 256 | 250 | 1.02x | 60.0 | 70.0 | 0.86x |" in text
    assert "| 4096 | auto (float32) | 20.000 | 205 | 250 | 0.82x | 40.0 | 50.0 | 0.80x |" in text
    assert (f"- TTFT at 4k <= llama.cpp's {F32}: not met (batchscope 20.00 s, llama.cpp 16.38 s "
            "(0.82x))") in text
    assert (f"- prefill rate at 4096 within 30% of the rate at 512 {F32}: met (205 vs 256 tok/s "
            "(80% of it; goal >= 70%))") in text
    assert (f"- decode at depth 4k >= llama.cpp's tg {F32}: not met (batchscope 40.0 tok/s, "
            "llama.cpp 50.0 (0.80x))") in text

    faster = result([row(512, 2.0, 60.0, 250.0, 70.0), row(4096, 40.0, 40.0, 90.0, 50.0)])
    text = cl.render(faster)
    assert f"- TTFT at 4k <= llama.cpp's {F32}: met (batchscope 40.00 s, llama.cpp 45.51 s" in text
    assert f"- prefill rate at 4096 within 30% of the rate at 512 {F32}: not met (102 vs" in text
    assert f"- decode at depth 4k >= llama.cpp's tg {F32}: not met" in text
    keeps_up = result([row(512, 2.0, 60.0, 250.0, 70.0), row(4096, 20.0, 50.0, 250.0, 50.0)])
    met = f"- decode at depth 4k >= llama.cpp's tg {F32}: met (batchscope 50.0 tok/s"
    assert met in cl.render(keeps_up)


def test_without_llama_cpp_or_the_goal_lengths_no_goal_is_claimed():
    data = result([row(512, 2.0, 60.0), row(4096, 20.0, 40.0)], llama=False)
    data["engine_paths"] = {"attention": "native paged attention", "row_kernels": "mlx"}
    text = cl.render(data)
    assert "llama.cpp not built" in text
    assert ", attention native paged attention, row kernels mlx;" in text
    assert "| 4096 | auto (float32) | 20.000 | 205 | – | – | 40.0 | – | – |" in text
    assert "TTFT at 4k" not in text
    assert f"prefill rate at 4096 within 30% of the rate at 512 {F32}: met" in text
    assert cl.goals(result([row(256, 1.0, 60.0, 250.0, 70.0), row(512, 2.0, 60.0, 250.0,
                                                                   70.0)])) == []


def test_the_plot_has_both_panels_and_both_systems():
    svg = cl.plot(result([row(512, 2.0, 60.0, 250.0, 70.0), row(1024, 5.0, 50.0, 240.0, 60.0)]))
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert "Time to first token" in svg and "ms per decoded token" in svg
    assert svg.count("<polyline") == 4
    assert "1024 tokens: 5 s" in svg and "512 tokens: 14.3 ms" in svg
    only_ours = cl.plot(result([row(512, 2.0, 60.0)], llama=False))
    assert "llama.cpp" not in only_ours.split("</title>", 1)[1]


def test_each_kv_dtype_gets_its_rows_goals_and_lines():
    """--kv-dtype auto float16: a row per length and dtype (llama.cpp's numbers on both), goals
    judged per dtype, a line per dtype in the plot and llama.cpp's drawn once."""
    data = result([row(512, 2.0, 60.0, 250.0, 70.0),
                   row(512, 2.1, 61.0, 250.0, 70.0, kv="float16"),
                   row(4096, 20.0, 40.0, 250.0, 50.0),
                   row(4096, 19.0, 55.0, 250.0, 50.0, kv="float16")])
    text = cl.render(data)
    assert "| 4096 | float16 | 19.000 | 216 | 250 | 0.86x | 55.0 | 50.0 | 1.10x |" in text
    assert f"- decode at depth 4k >= llama.cpp's tg {F32}: not met" in text
    assert "- decode at depth 4k >= llama.cpp's tg (KV float16): met (batchscope 55.0" in text
    assert len(data["goals"]) == 6
    svg = cl.plot(data)
    assert svg.count("<polyline") == 6
    assert "batchscope, KV float16" in svg and "batchscope, KV auto (float32)" in svg
