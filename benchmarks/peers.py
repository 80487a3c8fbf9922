"""batchscope side by side with its peers, on one machine, model, weight format and workload.

    .venv/bin/python benchmarks/peers.py [--quick] [--weights auto] [--out-dir benchmarks/results]

1. offline   batchscope's engine vs mlx-lm's batch_generate vs serial generation
             (benchmarks/engine_batching.py's functions, same prompts for all three)
2. http      `batchscope serve` vs `mlx_lm.server` at 1, 4, 8, 16 concurrent streams, driven by
             the load client of `batchscope bench serve` (app/bench/) with the same long-tailed
             `mixed` requests and seed; mlx_lm.server serves a folder written by
             `batchscope export-model --weights W` in a temporary directory, batchscope serves
             the same format (--weights W). One server runs at a time.
3. static    continuous batching (the engine, max_num_seqs = B) against static batching (batches
             of B in arrival order, each run to its longest output) on the long-tailed mix
4. sweep     max_num_seqs 1..32 on the long-tailed mix (in-process engine, all requests at once):
             output throughput against p99 TPOT and TTFT, and the knee

Writes peers.md (tables with goals), peers.json (every number) and peers_*.svg to --out-dir.
Progress goes to stderr. --quick runs a tiny version of everything (a smoke test).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
import mlx_lm
import engine_batching as eb  # benchmarks/engine_batching.py (the script directory is on sys.path)
# isort: on

import numpy as np

from app.bench import dataset as datasets
from app.bench.client import choose_model, probe, run_load
from app.bench.metrics import summarize
from app.charts import Point, Series, line_chart
from engine.config import WEIGHT_FORMATS, EngineConfig
from engine.engine import Engine
from engine.model_loader import load_model
from engine.platform import backend_info
from engine.sampling import SamplingParams
from engine.weights.formats import resolve_weights

CONTEXT = 2048  # the mixed dataset is fitted into this many tokens (both servers' context is 8k)
GOAL_HTTP_RATIO = 1.5  # batchscope serve / mlx_lm.server output throughput at GOAL_STREAMS
GOAL_STREAMS = 8
GOAL_STATIC_RATIO = 2.0  # continuous / static useful output throughput
GOAL_ENGINE_RATIO = 1.0  # engine / batch_generate overall output throughput
KNEE_SHARE = 0.9  # the knee: the smallest max_num_seqs reaching this share of the best tok/s
SERVER_START_TIMEOUT = 300.0


@dataclass(frozen=True)
class Profile:
    offline_concurrency: tuple[int, ...]
    offline_max_tokens: int
    http_concurrency: tuple[int, ...]
    prompts_per_stream: int  # HTTP: requests per run = max(min_prompts, this x concurrency)
    min_prompts: int
    static_batch: int
    static_prompts: int
    sweep: tuple[int, ...]
    sweep_prompts: int
    # The long-tailed mix (app/bench/dataset.py `mixed`), in words ~ tokens.
    input_median: int = 64
    output_median: int = 40
    input_len_cap: int = 320
    max_tokens_cap: int = 160


FULL = Profile(offline_concurrency=(1, 4, 8, 16), offline_max_tokens=32,
               http_concurrency=(1, 4, 8, 16), prompts_per_stream=4, min_prompts=12,
               static_batch=8, static_prompts=48, sweep=(1, 2, 4, 8, 16, 32), sweep_prompts=32)
QUICK = Profile(offline_concurrency=(1, 4), offline_max_tokens=8, http_concurrency=(1, 4),
                prompts_per_stream=2, min_prompts=4, static_batch=4, static_prompts=8,
                sweep=(1, 4), sweep_prompts=8, input_median=24, output_median=8,
                input_len_cap=48, max_tokens_cap=16)

# Aggregate output tokens/s by requests in flight (f32, OpenBLAS, 2 cores), and prefill
# tokens/s: only for the time estimate printed at the start.
EST_DECODE = {1: 12.0, 2: 20.0, 4: 28.0, 8: 40.0, 16: 50.0, 32: 55.0}
EST_PREFILL = 250.0


def _rate_at(c: int) -> float:
    keys = sorted(EST_DECODE)
    return EST_DECODE[max([k for k in keys if k <= c] or [keys[0]])]


# ---------------------------------------------------------------------------------------------
# Progress


class Log:
    """Progress lines on stderr, `[NAME mm:ss] message`, the time since the run began."""

    def __init__(self, name: str = "peers") -> None:
        self.name = name
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        m, s = divmod(int(time.monotonic() - self.t0), 60)
        print(f"[{self.name} {m:02d}:{s:02d}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Workload


def workload(p: Profile, n: int, seed: int) -> list[datasets.BenchRequest]:
    return datasets.mixed(n, seed=seed, context=CONTEXT, max_tokens_cap=p.max_tokens_cap,
                          input_len_cap=p.input_len_cap, input_median=p.input_median,
                          output_median=p.output_median)


def http_prompts(p: Profile, c: int) -> int:
    return max(p.min_prompts, p.prompts_per_stream * c)


def estimate_s(p: Profile, seed: int) -> dict[str, float]:
    """Rough seconds per section from the dev machine's rates (EST_*) and the workload."""
    def run_s(reqs, c):
        out = sum(r.max_tokens for r in reqs)
        return out / _rate_at(min(c, len(reqs))) + sum(r.input_len for r in reqs) / EST_PREFILL

    est = {"offline": 8.0, "http": 20.0, "static": 4.0, "sweep": 0.0}  # loads, warm-ups
    for c in p.offline_concurrency:  # engine + batch_generate, then serial
        est["offline"] += 2 * c * p.offline_max_tokens / _rate_at(c) + (
            c * p.offline_max_tokens / _rate_at(1))
    for c in p.http_concurrency:  # both servers
        est["http"] += 2 * run_s(workload(p, http_prompts(p, c), seed), c)
    reqs = workload(p, p.static_prompts, seed)
    b = p.static_batch
    groups = [reqs[i:i + b] for i in range(0, len(reqs), b)]
    est["static"] += sum(len(g) * max(r.max_tokens for r in g) / _rate_at(len(g))
                         for g in groups) + run_s(reqs, b)
    reqs = workload(p, p.sweep_prompts, seed)
    est["sweep"] = sum(run_s(reqs, m) + 4 for m in p.sweep)
    return est


# ---------------------------------------------------------------------------------------------
# Engine runs (offline, static vs continuous, sweep)


def make_engine(weights: str, max_num_seqs: int) -> Engine:
    config = EngineConfig(weights=weights, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max(512, 2 * max_num_seqs + 256),
                          num_kv_blocks=1024, enable_prefix_caching=False)
    return Engine(config).start()


def _pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _mean(values) -> float | None:
    return float(np.mean(values)) if len(values) else None


def run_continuous(eng: Engine, prompts: list[list[int]], targets: list[int]) -> dict:
    """All requests at once, each with its own max_tokens (ignore_eos: exactly that many)."""
    t0 = time.time()
    handles = [eng.submit(ids, SamplingParams(max_tokens=m, ignore_eos=True))
               for ids, m in zip(prompts, targets, strict=True)]
    fins = [h.result() for h in handles]
    wall = time.time() - t0
    per = [{"target": m, "generated": f.completion_tokens, "e2e": f.finish_time - t0,
            "ttft": (f.first_token_time or f.finish_time) - t0,
            "tpot": ((f.finish_time - f.first_token_time) / (f.completion_tokens - 1)
                     if f.first_token_time and f.completion_tokens > 1 else None),
            "reason": f.reason, "preemptions": f.preemptions}
           for f, m in zip(fins, targets, strict=True)]
    return _engine_summary(per, wall)


def run_static(eng: Engine, prompts: list[list[int]], targets: list[int], batch: int) -> dict:
    """Batches of `batch` in arrival order; a batch starts when the previous one has finished,
    and all its requests run to its longest target (ignore_eos). A request's E2E latency is its
    batch's end (a static batch returns together); only its own target counts as useful."""
    t0 = time.time()
    per = []
    for i in range(0, len(prompts), batch):
        group = list(range(i, min(i + batch, len(prompts))))
        longest = max(targets[j] for j in group)
        params = SamplingParams(max_tokens=longest, ignore_eos=True)
        handles = [eng.submit(prompts[j], params) for j in group]
        fins = [h.result() for h in handles]
        end = time.time() - t0
        for j, f in zip(group, fins, strict=True):
            per.append({"target": targets[j], "generated": f.completion_tokens, "e2e": end,
                        "ttft": (f.first_token_time or f.finish_time) - t0, "tpot": None,
                        "reason": f.reason, "preemptions": f.preemptions, "batch": i // batch})
    wall = time.time() - t0
    return _engine_summary(per, wall)


def _engine_summary(per: list[dict], wall: float) -> dict:
    useful = sum(min(r["target"], r["generated"]) for r in per)
    generated = sum(r["generated"] for r in per)
    e2e = [r["e2e"] for r in per]
    ttft = [r["ttft"] for r in per]
    tpot = [r["tpot"] for r in per if r["tpot"] is not None]
    ms = 1000.0
    return {"requests": len(per), "wall_s": wall, "useful_tokens": useful,
            "generated_tokens": generated, "useful_tps": useful / wall,
            "generated_tps": generated / wall,
            "all_reached_target": all(r["generated"] >= r["target"] for r in per),
            "preemptions": sum(r["preemptions"] for r in per),
            "e2e_mean_ms": _mean(e2e) * ms, "e2e_p50_ms": _pct(e2e, 50) * ms,
            "e2e_p99_ms": _pct(e2e, 99) * ms,
            "ttft_p50_ms": _pct(ttft, 50) * ms, "ttft_p99_ms": _pct(ttft, 99) * ms,
            "tpot_p50_ms": None if not tpot else _pct(tpot, 50) * ms,
            "tpot_p99_ms": None if not tpot else _pct(tpot, 99) * ms,
            "per_request": per}


def section_offline(p: Profile, weights: str, log: Log) -> dict:
    log(f"offline: engine vs batch_generate vs serial, {list(p.offline_concurrency)} requests, "
        f"{p.offline_max_tokens} new tokens each")
    eng = Engine(eb.engine_config(weights, list(p.offline_concurrency))).start()
    try:
        loaded = load_model("embedded", eng.loaded.weights)
        rows = eb.compare(eng, loaded, list(p.offline_concurrency), p.offline_max_tokens,
                          log=lambda m: log("offline " + m.lstrip("# ")))
    finally:
        eng.stop()
    for r in rows:
        r["ratio_overall"] = r["engine"]["overall_tps"] / r["batch_generate"]["overall_tps"]
        r["ratio_decode"] = r["engine"]["decode_tps"] / r["batch_generate"]["decode_tps"]
        r["goal_met"] = r["ratio_overall"] >= GOAL_ENGINE_RATIO
    return {"max_tokens": p.offline_max_tokens, "model": loaded.name, "rows": rows}


def section_static(p: Profile, weights: str, seed: int, log: Log) -> dict:
    b = p.static_batch
    reqs = workload(p, p.static_prompts, seed)
    log(f"static vs continuous: {len(reqs)} long-tailed requests, B = {b}")
    eng = make_engine(weights, b)
    try:
        prompts = [eng.encode(r.prompt) for r in reqs]
        targets = [r.max_tokens for r in reqs]
        run_continuous(eng, prompts[:2], [4, 4])  # warm-up
        log(f"static: batches of {b}, each to its longest output...")
        static = run_static(eng, prompts, targets, b)
        log(f"static: {static['useful_tps']:.1f} useful tok/s; continuous...")
        cont = run_continuous(eng, prompts, targets)
        log(f"continuous: {cont['useful_tps']:.1f} useful tok/s")
    finally:
        eng.stop()
    ratio = cont["useful_tps"] / static["useful_tps"]
    return {"batch": b, "targets": targets, "prompt_tokens": [len(x) for x in prompts],
            "static": static, "continuous": cont, "ratio": ratio,
            "goal_met": ratio >= GOAL_STATIC_RATIO}


def section_sweep(p: Profile, weights: str, seed: int, log: Log) -> dict:
    reqs = workload(p, p.sweep_prompts, seed)
    rows = []
    for m in p.sweep:
        log(f"sweep: max_num_seqs {m}, {len(reqs)} requests at once...")
        eng = make_engine(weights, m)
        try:
            prompts = [eng.encode(r.prompt) for r in reqs]
            run_continuous(eng, prompts[:2], [4, 4])  # warm-up
            res = run_continuous(eng, prompts, [r.max_tokens for r in reqs])
        finally:
            eng.stop()
        log(f"sweep: max_num_seqs {m}: {res['useful_tps']:.1f} tok/s, p99 TPOT "
            f"{_fmt(res['tpot_p99_ms'], 0)} ms, p99 TTFT {res['ttft_p99_ms']:.0f} ms")
        rows.append({"max_num_seqs": m, **res})
    best = max(r["useful_tps"] for r in rows)
    knee = next(r["max_num_seqs"] for r in rows if r["useful_tps"] >= KNEE_SHARE * best)
    return {"requests": len(reqs), "rows": rows, "knee": knee, "best_tps": best}


# ---------------------------------------------------------------------------------------------
# HTTP: both servers as subprocesses


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1"})
    return env


def server_commands(name: str, port: int, weights: str, model_dir: Path, db: Path) -> list[str]:
    py = sys.executable
    if name == "batchscope":
        return [py, "-c", "import sys; from app.cli import main; sys.exit(main())", "serve",
                "--host", "127.0.0.1", "--port", str(port), "--db", str(db),
                "--weights", weights]
    # mlx_lm.server gets the same optimized BLAS as batchscope: importing `engine` only loads
    # it globally before MLX (without it MLX's CPU float32 matmuls use a reference BLAS).
    return [py, "-c", "import engine, sys; from mlx_lm.server import main; "
                      "sys.argv[0] = 'mlx_lm.server'; main()",
            "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "WARNING"]


def _openblas_mapped(pid: int) -> bool | None:
    try:
        return "libopenblas" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None


@contextlib.contextmanager
def running_server(name: str, cmd: list[str], port: int, log_path: Path, log: Log,
                   tree: Path | None = None):
    """Start a server, wait until GET /v1/models answers 200, yield its URL; stop it after
    (SIGTERM, then SIGKILL to its process group). tree: a checkout whose build it serves (it
    runs there with the tree on PYTHONPATH: `python -c` puts the working directory first on
    sys.path, so it imports that tree's engine and native kernels)."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    env = server_env() | ({"PYTHONPATH": str(tree)} if tree is not None else {})
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tree,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with code {proc.returncode} before it was "
                                   f"ready; its output ended with:\n{tail}")
            try:
                if httpx.get(url + "/v1/models", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} was not ready after {SERVER_START_TIMEOUT:.0f} s; "
                                   f"its output ended with:\n{tail}")
            time.sleep(0.5)
        log(f"http: {name} ready on port {port} after {time.monotonic() - t0:.1f} s")
        yield url, proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _slim(result) -> dict:
    d = result.to_dict()
    d.pop("itl", None)  # per-chunk gaps: summarized in the run's itl statistics
    d.pop("usage", None)
    return d


def section_http(p: Profile, weights: str, seed: int, log: Log, workdir: Path) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = workdir / "model"
    log(f"http: batchscope export-model {model_dir.name} --weights {weights}")
    subprocess.run([sys.executable, "-c", "import sys; from app.cli import main; "
                    "sys.exit(main())", "export-model", str(model_dir), "--weights", weights],
                   check=True, stdout=subprocess.DEVNULL, env=server_env())
    warm = workload(p, 2, seed + 1000)
    servers = {}
    for name in ("batchscope", "mlx_lm.server"):
        port = free_port()
        cmd = server_commands(name, port, weights, model_dir, workdir / "bench.db")
        runs = []
        with running_server(name, cmd, port, workdir / f"{name}.log", log) as (url, proc):
            info = probe(url)
            blas = _openblas_mapped(proc.pid)
            model = choose_model(info, None)  # as `batchscope bench serve` picks it
            asyncio.run(run_load(url, warm, model=model, max_concurrency=2, seed=seed))  # warm

            for c in p.http_concurrency:
                reqs = workload(p, http_prompts(p, c), seed)
                log(f"http: {name}, {c} streams, {len(reqs)} requests...")
                results, duration = asyncio.run(run_load(url, reqs, model=model,
                                                         max_concurrency=c, seed=seed))
                s = summarize(results, duration)
                log(f"http: {name}, {c} streams: {s['output_throughput']:.1f} tok/s, p99 TTFT "
                    f"{_fmt(s['ttft']['p99_ms'], 0)} ms, {s['failed']} failed")
                first_error = next((r.error for r in results if r.error), None)
                if first_error and name == "batchscope":  # ours must not fail: a defect
                    raise RuntimeError(f"{name}: {s['failed']} requests failed at {c} streams; "
                                       f"the first said: {first_error}")
                # A peer's failures are part of its result: counted and shown, not hidden.
                runs.append({"concurrency": c, "num_prompts": len(reqs), "summary": s,
                             "first_error": first_error,
                             "requests": [_slim(r) for r in results]})
        servers[name] = {"command": [Path(cmd[0]).name, *cmd[1:]], "openblas_mapped": blas,
                         "owned_by": info.owned_by, "runs": runs}
        # No absolute paths of this machine in the results.
        servers[name]["command"] = [a.replace(str(workdir), "$TMP") for a in
                                    servers[name]["command"]]
    rows = []
    for i, c in enumerate(p.http_concurrency):
        a = servers["batchscope"]["runs"][i]["summary"]
        b = servers["mlx_lm.server"]["runs"][i]["summary"]
        ratio = a["output_throughput"] / b["output_throughput"]
        goal = None
        if c == GOAL_STREAMS:
            goal = ratio >= GOAL_HTTP_RATIO and a["ttft"]["p99_ms"] < b["ttft"]["p99_ms"]
        rows.append({"concurrency": c, "ratio": ratio,
                     "ttft_p99_ratio": a["ttft"]["p99_ms"] / b["ttft"]["p99_ms"],
                     "goal_met": goal})
    return {"weights": weights, "servers": servers, "rows": rows,
            "mlx_lm_server_batching": MLX_LM_BATCHING.format(version=mlx_lm.__version__)}


MLX_LM_BATCHING = (
    "mlx_lm.server (mlx-lm {version}) batches: its generation thread keeps one BatchGenerator "
    "and inserts each new request into the running batch (continuous batching: up to "
    "--decode-concurrency 32 sequences decoding, --prompt-concurrency 8 prompts prefilled "
    "together, defaults used here). It falls back to one request at a time only for requests "
    "with a seed, with images, with --kv-bits or a draft model; the load client sends none.")


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(v, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:.{digits}f}"


def _fmt_load(v) -> str:
    return "unknown" if not v else ", ".join(f"{x:.1f}" for x in v)


def _met(v: bool | None) -> str:
    return "not measured" if v is None else ("**met**" if v else "**missed**")


def render(data: dict) -> str:
    p = data["profile"]
    info = data["backend"]
    out = [f"# batchscope and its peers{' (--quick)' if data['quick'] else ''}", "",
           f"Measured {data['date']} in one run of `{data['command']}` "
           f"({data['elapsed_s'] / 60:.1f} min). Model SmolLM2-135M-Instruct, weights "
           f"{data['weights']} on both sides, backend {info['backend']}, BLAS "
           f"{'OpenBLAS' if info.get('blas') else 'bundled reference'}, {data['cpus']} CPUs "
           f"({data['machine']}), mlx {info.get('mlx_version')}, mlx-lm "
           f"{data['mlx_lm_version']}. Every number below comes from this run. Load average "
           f"(1, 5, 15 min) at the start {_fmt_load(data.get('load_average_start'))}, at the end "
           f"{_fmt_load(data.get('load_average_end'))}: other processes on the machine slow "
           "every side.", ""]
    for name, error in (data.get("errors") or {}).items():
        out += [f"**Section {name} failed**: `{error[:500]}`", ""]
    wl = (f"Long-tailed mix: `batchscope bench serve`'s `mixed` dataset (seed {data['seed']}), "
          f"lognormal prompt lengths (median {p['input_median']} words ~ tokens, at most "
          f"{p['input_len_cap']}) and output lengths (median {p['output_median']}, at most "
          f"{p['max_tokens_cap']}).")
    out += ["## Goals", "", "| goal | measured | result |", "|---|---|---|"]
    goals = data["goals"]
    for g in goals:
        out.append(f"| {g['goal']} | {g['measured']} | {_met(g['met'])} |")
    out += ["", wl, ""]

    if "offline" in data:
        off = data["offline"]
        out += ["## 1. Offline: engine vs mlx-lm batch_generate vs serial", "",
                f"benchmarks/engine_batching.py's runs: C prompts of 20-120 tokens, "
                f"{off['max_tokens']} new tokens each, greedy, the engine with max_num_seqs = "
                "largest C. Overall = generated tokens / wall time (prefill included). Goal: "
                f"engine >= {GOAL_ENGINE_RATIO:.1f}x batch_generate overall, at every C.", "",
                "| requests | engine tok/s | batch_generate tok/s | serial tok/s "
                "| engine / batch_generate | decode tok/s: engine | batch_generate "
                "| decode ratio | goal | result |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in off["rows"]:
            e, b, s = r["engine"], r["batch_generate"], r["serial"]
            out.append(f"| {r['concurrency']} | {e['overall_tps']:.1f} | {b['overall_tps']:.1f} "
                       f"| {s['overall_tps']:.1f} | {r['ratio_overall']:.2f}x "
                       f"| {e['decode_tps']:.1f} | {b['decode_tps']:.1f} "
                       f"| {r['ratio_decode']:.2f}x | >= {GOAL_ENGINE_RATIO:.1f}x "
                       f"| {_met(r['goal_met'])} |")
        out.append("")

    if "http" in data:
        h = data["http"]
        sv = h["servers"]
        out += ["## 2. Over HTTP: `batchscope serve` vs `mlx_lm.server`", "",
                f"Streamed `/v1/completions` requests from `batchscope bench serve`'s client, all "
                f"sent at once under a cap of N concurrent streams; at each N the same "
                f"max({p['min_prompts']}, {p['prompts_per_stream']} x N) requests of the "
                "long-tailed mix for both servers, greedy, without ignore_eos (mlx_lm.server "
                "has none), so a request may stop early at end-of-sequence: the output token "
                "counts of both are shown. Both servers with their defaults (batchscope "
                f"max_num_seqs 16), weights {h['weights']}; mlx_lm.server serves a folder "
                f"written by `batchscope export-model --weights {h['weights']}`. "
                f"OpenBLAS mapped in batchscope: {sv['batchscope']['openblas_mapped']}, in "
                f"mlx_lm.server: {sv['mlx_lm.server']['openblas_mapped']}.", "",
                h["mlx_lm_server_batching"], "",
                f"Goal: batchscope >= {GOAL_HTTP_RATIO}x mlx_lm.server output throughput at "
                f"{GOAL_STREAMS} streams, with a lower p99 TTFT.", "",
                "| streams | requests | output tok/s: batchscope | mlx_lm.server | ratio "
                "| p50 TTFT ms: batchscope | mlx_lm.server | p99 TTFT ms: batchscope "
                "| mlx_lm.server | p50 TPOT ms: batchscope | mlx_lm.server "
                "| p99 TPOT ms: batchscope | mlx_lm.server | output tokens: batchscope "
                "| mlx_lm.server | failed: batchscope | mlx_lm.server | goal | result |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, r in enumerate(h["rows"]):
            a = sv["batchscope"]["runs"][i]["summary"]
            b = sv["mlx_lm.server"]["runs"][i]["summary"]
            goal = (f">= {GOAL_HTTP_RATIO}x, lower p99 TTFT" if r["concurrency"] == GOAL_STREAMS
                    else "—")
            out.append(
                f"| {r['concurrency']} | {sv['batchscope']['runs'][i]['num_prompts']} "
                f"| {a['output_throughput']:.1f} | {b['output_throughput']:.1f} "
                f"| {r['ratio']:.2f}x "
                f"| {_fmt(a['ttft']['median_ms'], 0)} | {_fmt(b['ttft']['median_ms'], 0)} "
                f"| {_fmt(a['ttft']['p99_ms'], 0)} | {_fmt(b['ttft']['p99_ms'], 0)} "
                f"| {_fmt(a['tpot']['median_ms'])} | {_fmt(b['tpot']['median_ms'])} "
                f"| {_fmt(a['tpot']['p99_ms'])} | {_fmt(b['tpot']['p99_ms'])} "
                f"| {a['total_output_tokens']} | {b['total_output_tokens']} "
                f"| {a['failed']} | {b['failed']} | {goal} "
                f"| {_met(r['goal_met']) if r['concurrency'] == GOAL_STREAMS else '—'} |")
        for i, r in enumerate(h["rows"]):
            run = sv["mlx_lm.server"]["runs"][i]
            if run.get("first_error"):
                out += ["", f"mlx_lm.server at {r['concurrency']} streams: "
                        f"{run['summary']['failed']} of {run['num_prompts']} requests failed "
                        f"(the first: `{run['first_error'][:200]}`); its throughput and "
                        "latencies count the completed requests only."]
        out += ["", "![throughput against concurrency](peers_http_throughput.svg)", ""]

    if "static" in data:
        st = data["static"]
        s, c = st["static"], st["continuous"]
        out += ["## 3. Continuous vs static batching (engine in-process)", "",
                f"{s['requests']} requests of the long-tailed mix, all arrived at time 0, "
                f"batch size B = {st['batch']}. Static: batches of B in arrival order, a batch "
                "starts when the previous one has finished, every request of a batch runs to "
                "the batch's longest output (ignore_eos); a request's E2E latency is its batch's "
                "end. Continuous: the engine with max_num_seqs = B, all submitted at once with "
                "their own max_tokens (ignore_eos). Useful tokens = each request's own target. "
                f"Goal: continuous >= {GOAL_STATIC_RATIO:.0f}x static useful output tok/s.", "",
                "| batching | useful tok/s | useful tokens | generated tokens | wall s "
                "| mean E2E ms | p99 E2E ms | ratio | goal | result |",
                "|---|---|---|---|---|---|---|---|---|---|",
                f"| static (B = {st['batch']}) | {s['useful_tps']:.1f} | {s['useful_tokens']} "
                f"| {s['generated_tokens']} | {s['wall_s']:.1f} | {s['e2e_mean_ms']:.0f} "
                f"| {s['e2e_p99_ms']:.0f} | 1.00x | — | — |",
                f"| continuous (max_num_seqs = {st['batch']}) | {c['useful_tps']:.1f} "
                f"| {c['useful_tokens']} | {c['generated_tokens']} | {c['wall_s']:.1f} "
                f"| {c['e2e_mean_ms']:.0f} | {c['e2e_p99_ms']:.0f} | {st['ratio']:.2f}x "
                f"| >= {GOAL_STATIC_RATIO:.1f}x | {_met(st['goal_met'])} |", ""]

    if "sweep" in data:
        sw = data["sweep"]
        out += ["## 4. max_num_seqs sweep (engine in-process)", "",
                f"{sw['requests']} requests of the long-tailed mix submitted at once (TTFT "
                "includes the wait for a slot), each to its own max_tokens (ignore_eos). The "
                f"knee: the smallest max_num_seqs reaching {KNEE_SHARE:.0%} of the best output "
                f"throughput of the sweep; here **{sw['knee']}**.", "",
                "| max_num_seqs | output tok/s | share of best | p50 TPOT ms | p99 TPOT ms "
                "| p50 TTFT ms | p99 TTFT ms | mean E2E ms | preemptions |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in sw["rows"]:
            mark = " (knee)" if r["max_num_seqs"] == sw["knee"] else ""
            out.append(f"| {r['max_num_seqs']}{mark} | {r['useful_tps']:.1f} "
                       f"| {r['useful_tps'] / sw['best_tps']:.0%} | {_fmt(r['tpot_p50_ms'])} "
                       f"| {_fmt(r['tpot_p99_ms'])} | {r['ttft_p50_ms']:.0f} "
                       f"| {r['ttft_p99_ms']:.0f} | {r['e2e_mean_ms']:.0f} "
                       f"| {r['preemptions']} |")
        out += ["", "![throughput against p99 TPOT](peers_sweep.svg)", ""]
    return "\n".join(out)


def goals(data: dict) -> list[dict]:
    g = []
    if "http" in data:
        row = next((r for r in data["http"]["rows"] if r["concurrency"] == GOAL_STREAMS), None)
        if row is None:
            measured = f"no {GOAL_STREAMS}-stream run in this profile"
        else:
            i = data["http"]["rows"].index(row)
            a = data["http"]["servers"]["batchscope"]["runs"][i]["summary"]
            b = data["http"]["servers"]["mlx_lm.server"]["runs"][i]["summary"]
            measured = (f"{row['ratio']:.2f}x ({a['output_throughput']:.1f} vs "
                        f"{b['output_throughput']:.1f} tok/s); p99 TTFT "
                        f"{a['ttft']['p99_ms']:.0f} vs {b['ttft']['p99_ms']:.0f} ms")
        g.append({"goal": f"`batchscope serve` >= {GOAL_HTTP_RATIO}x `mlx_lm.server` output "
                          f"throughput at {GOAL_STREAMS} streams, lower p99 TTFT",
                  "measured": measured, "met": None if row is None else row["goal_met"]})
    if "static" in data:
        st = data["static"]
        g.append({"goal": f"continuous >= {GOAL_STATIC_RATIO:.0f}x static on the long-tail mix "
                          f"(B = {st['batch']})",
                  "measured": f"{st['ratio']:.2f}x ({st['continuous']['useful_tps']:.1f} vs "
                              f"{st['static']['useful_tps']:.1f} useful tok/s)",
                  "met": st["goal_met"]})
    if "offline" in data:
        rows = data["offline"]["rows"]
        g.append({"goal": f"engine >= {GOAL_ENGINE_RATIO:.1f}x `batch_generate` (overall tok/s, "
                          "every concurrency)",
                  "measured": ", ".join(f"{r['ratio_overall']:.2f}x at {r['concurrency']}"
                                        for r in rows),
                  "met": all(r["goal_met"] for r in rows)})
    return g


# ---------------------------------------------------------------------------------------------
# SVG plots (app/charts.py)


def line_svg(title: str, x_label: str, y_label: str,
             series: list[tuple[str, list[tuple[float, float, str]]]], css: str) -> str:
    """One line per series; each point's label is its tooltip, and its head (up to ":") is
    written beside it."""
    return line_chart(title, x_label, y_label,
                      [Series(name, [Point(x, y, tip=label, label=label.split(":")[0])
                                     for x, y, label in pts], marker=3.5, joined=len(pts) > 1)
                       for name, pts in series],
                      css_class=css, x_headroom=1.08)


def write_plots(data: dict, out_dir: Path) -> list[Path]:
    written = []
    if "http" in data:
        series = []
        for name, sv in data["http"]["servers"].items():
            pts = [(r["concurrency"], r["summary"]["output_throughput"],
                    f"{r['concurrency']}: {r['summary']['output_throughput']:.1f} tok/s")
                   for r in sv["runs"]]
            series.append((name, pts))
        path = out_dir / "peers_http_throughput.svg"
        path.write_text(line_svg("Output throughput against concurrent streams",
                                 "concurrent streams (--max-concurrency)", "output tokens/s",
                                 series, "peers-http"))
        written.append(path)
    if "sweep" in data:
        pts = [(r["tpot_p99_ms"] or 0.0, r["useful_tps"],
                f"{r['max_num_seqs']}: {r['useful_tps']:.1f} tok/s, p99 TPOT "
                f"{_fmt(r['tpot_p99_ms'], 0)} ms") for r in data["sweep"]["rows"]]
        path = out_dir / "peers_sweep.svg"
        path.write_text(line_svg("max_num_seqs sweep: throughput against p99 TPOT",
                                 "p99 TPOT (ms)", "output tokens/s",
                                 [("engine (labels: max_num_seqs)", pts)], "peers-sweep"))
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------


SECTIONS = ("offline", "http", "static", "sweep")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny version of everything")
    ap.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS,
                    help="one weight format for every side (auto: the engine's pick for this "
                         "backend, e.g. f32 on a CPU with OpenBLAS)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="run only these sections (default: all)")
    args = ap.parse_args(argv)
    p = QUICK if args.quick else FULL
    log = Log()
    info = backend_info()
    # One format for batchscope and mlx-lm alike: auto is the fastest for mlx-lm (on the CPU
    # its quantized matmul is one row at a time, so not q4; benchmarks/llama_cpp_peer.py runs
    # batchscope at its own default).
    weights = resolve_weights(args.weights, info, native_quantized=False)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    parts = estimate_s(p, args.seed)
    est = sum(v for k, v in parts.items() if k in args.only)
    log(f"{'quick' if args.quick else 'full'} run, weights {weights}, backend {info['backend']}"
        f"; estimated {est / 60:.0f} min on a quiet 2-core machine ("
        + ", ".join(f"{k} ~{parts[k] / 60:.0f} min" for k in SECTIONS if k in args.only)
        + f"); longer when the CPUs are shared (load average now {_fmt_load(_loadavg())} on "
        f"{os.cpu_count()} CPUs)")
    shown = ["benchmarks/peers.py", *(argv if argv is not None else sys.argv[1:])]
    if Path(args.out_dir).is_absolute():  # no paths of this machine in the results
        shown = [("DIR" if a == args.out_dir else a.replace(args.out_dir, "DIR"))
                 for a in shown]
    shown = " ".join(shown)
    data: dict = {"quick": args.quick, "weights": weights, "seed": args.seed,
                  "backend": {k: v for k, v in info.items() if k != "blas"} | {
                      "blas": "OpenBLAS" if info.get("blas") else None},
                  "cpus": os.cpu_count(), "machine": f"{platform.system()} {platform.machine()}",
                  "mlx_lm_version": mlx_lm.__version__,
                  "profile": dict(p.__dict__),
                  "command": shown.strip(),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "estimated_s": est}
    t0 = time.monotonic()
    sections: dict[str, Callable[[], dict]] = {
        "offline": lambda: section_offline(p, weights, log),
        "http": lambda: _with_tmp(lambda d: section_http(p, weights, args.seed, log, d)),
        "static": lambda: section_static(p, weights, args.seed, log),
        "sweep": lambda: section_sweep(p, weights, args.seed, log),
    }
    data["load_average_start"] = _loadavg()
    errors: dict[str, str] = {}
    for name in SECTIONS:
        if name not in args.only:
            continue
        try:
            data[name] = sections[name]()
        except Exception as e:  # the other sections still run; the results say what failed
            traceback.print_exc()
            errors[name] = f"{type(e).__name__}: {e}"
            log(f"{name}: FAILED: {errors[name][:300]}")
        # Written after every section, so a long run that fails late keeps what it measured.
        data["elapsed_s"] = time.monotonic() - t0
        data["load_average_end"] = _loadavg()
        data["errors"] = errors
        data["goals"] = goals(data)
        md = render(data)
        (out_dir / "peers.md").write_text(md + "\n")
        (out_dir / "peers.json").write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
        plots = write_plots(data, out_dir)
    print(md)
    log(f"done in {data['elapsed_s'] / 60:.1f} min (estimated {est / 60:.0f}); wrote "
        f"{', '.join(str(x) for x in [out_dir / 'peers.md', out_dir / 'peers.json', *plots])}")
    if errors:
        log(f"failed sections: {', '.join(errors)}")
        return 1
    return 0


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _with_tmp(fn: Callable[[Path], dict]) -> dict:
    with tempfile.TemporaryDirectory(prefix="batchscope-peers-") as d:
        return fn(Path(d))


if __name__ == "__main__":
    sys.exit(main())
