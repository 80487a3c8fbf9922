"""An Engine over two ranks on loopback, as a script tests start under `timeout`
(tests/engine/test_distributed_engine.py): the ring lives and dies in this child process, so
a hung collective cannot outlive the test, and every run gets fresh free ports.

    python tests/distributed_engine.py greedy FOLDER OUT.json  # PROMPTS alone, then together
    python tests/distributed_engine.py kill FOLDER OUT.json    # rank 1 killed mid-generation
    python tests/distributed_engine.py serve FOLDER OUT.json   # the app: dashboard, metrics, 503
    python tests/distributed_engine.py prefix FOLDER OUT.json  # or preemption, ngram: FEATURES
    python tests/distributed_engine.py embedded 3 OUT.json     # the embedded model, f32, 3 ranks
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

PROMPTS = [[(7 * j) % 300 + 5 for j in range(37)], [(5 * j) % 200 + 9 for j in range(5)],
           [(3 * j) % 250 + 2 for j in range(20)]]
MAX_TOKENS = 8
# The project before tests/ (run as a script, tests/ comes first: its app/ is the tests').
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def config(folder: str, size: int, **changes):
    from engine.config import EngineConfig

    return EngineConfig(**{"model": folder, "weights": "f32", "num_kv_blocks": 64,
                           "block_size": 16, "max_num_seqs": 4, "tensor_parallel_size": size,
                           **changes})


# What the scheduler decides on rank 0 alone, each with its engine settings: the same prompt
# twice (the second hits the prefix cache), more requests than a small pool holds at once
# (preemption), and n-gram speculation on a prompt that repeats itself (verify rows).
FEATURES = {
    "prefix": {"block_size": 4},
    "preemption": {"block_size": 4, "num_kv_blocks": 20, "enable_prefix_caching": False},
    "ngram": {"speculative": "ngram", "num_speculative_tokens": 3},
}
REPEATING = [5, 6, 7, 8, 9] * 6


def feature_run(engine, name: str) -> dict:
    """The feature's requests on `engine`: each one's greedy ids, and the steps' counters that
    show the feature ran."""
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    if name == "prefix":
        ids = [engine.generate(PROMPTS[0], params).token_ids for _ in range(2)]
    else:
        prompts = [REPEATING] if name == "ngram" else PROMPTS * 2
        ids = [h.result().token_ids for h in [engine.submit(p, params) for p in prompts]]
    steps = engine.steps.recent()
    return {"ids": ids, "prefix_hits": engine.block_manager.stats.hits,
            "preempted": sum(len(s.preempted) for s in steps),
            "drafted": sum(s.draft_tokens for s in steps)}


def feature(folder: str, size: int, name: str) -> dict:
    """A feature's run on an engine over `size` ranks (one such engine a process: MLX keeps
    one distributed group per process)."""
    from engine.engine import Engine

    with Engine(config(folder, size, **FEATURES[name])).start(timeout=240) as engine:
        out = feature_run(engine, name)
        out["ranks"] = sorted({t.rank for s in engine.steps.recent() for t in s.ranks})
    return out


def greedy(engine) -> dict:
    """Each prompt's greedy ids alone, then all of them submitted together."""
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = [engine.generate(p, params).token_ids for p in PROMPTS]
    handles = [engine.submit(p, params) for p in PROMPTS]
    return {"alone": alone, "together": [h.result().token_ids for h in handles]}


def idle_cpu(pid: int, seconds: float = 1.5) -> float | None:
    """The share of one core the process `pid` used over `seconds` of the engine being idle
    (None where /proc does not say: not Linux)."""
    def used() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    if not Path(f"/proc/{pid}/stat").exists():
        return None
    before = used()
    time.sleep(seconds)
    return (used() - before) / seconds


def _kill(engine, ranks, out: dict) -> None:
    """Rank 1 killed once a long request has produced tokens; what the engine then does."""
    from engine.engine import EngineError
    from engine.events import ErrorEvent, FinishEvent, TokenEvent
    from engine.sampling import SamplingParams

    handle = engine.submit(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=400,
                                                      ignore_eos=True))
    events = []
    for event in handle:
        events.append(event)
        if isinstance(event, TokenEvent) and event.index == 2:
            ranks.processes[1].kill()
        if isinstance(event, FinishEvent):
            break
    out["errors"] = [e.message for e in events if isinstance(e, ErrorEvent)]
    out["finish"] = [[e.reason, e.error, e.interrupted] for e in events
                     if isinstance(e, FinishEvent)]
    out["tokens_before"] = sum(isinstance(e, TokenEvent) for e in events)
    time.sleep(0.5)
    out["running"] = engine.running
    try:
        engine.submit(PROMPTS[1])
    except EngineError as e:
        out["refused"] = str(e)


def serve(folder: str, out: dict) -> None:
    """The app over two ranks: a completion, /dashboard.json's ranks, /metrics' rank series;
    then rank 1 killed: the next completion fails naming it, the one after gets a 503."""
    from starlette.testclient import TestClient

    from app.settings import Settings
    from app.web.app import create_app

    body = {"model": Path(folder).name, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    settings = Settings(engine=config(folder, 2, time_collectives=True))
    with TestClient(create_app(settings)) as client:
        engine = client.app.state.engine
        out["ports"] = engine.runner.ports
        done = client.post("/v1/completions", json=body)
        out["completion"] = [done.status_code, done.json()]
        out["dashboard_ranks"] = client.get("/dashboard.json").json()["ranks"]
        # The page's ranks table: (rank, port, step ms) per row.
        out["dashboard_rows"] = re.findall(
            r'<tr data-rank="(\d+)">\s*<td>\d+</td><td class="num">(\d+)</td>\s*'
            r'<td class="num">([\d.]+)</td>', client.get("/dashboard").text)
        out["metrics"] = [line for line in client.get("/metrics").text.splitlines()
                          if "rank=" in line]
        ranks = engine.runner.coordinator.ranks
        ranks.processes[1].kill()
        ranks.processes[1].wait()
        for key in ("failed", "refused"):
            answer = client.post("/v1/completions", json=body)
            out[key] = [answer.status_code, answer.json()]
    out["exits"] = {str(r): p.poll() for r, p in ranks.processes.items()}


def api_greedy(client, model: str, prompts: list[str], max_tokens: int = 32) -> dict:
    """Through /v1/completions: each prompt alone, then 8 requests at once (the prompts in
    turn); per request its token ids, their logprobs and the two best alternatives."""
    from concurrent.futures import ThreadPoolExecutor

    def complete(prompt: str) -> list:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 2, "return_tokens_as_token_ids": True}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        lp = answer.json()["choices"][0]["logprobs"]
        ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        tops = [{int(t.removeprefix("token_id:")): v for t, v in top.items()}
                for top in lp["top_logprobs"]]
        return [ids, lp["token_logprobs"], tops]

    alone = [complete(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(complete, [prompts[i % len(prompts)] for i in range(8)]))
    return {"alone": alone, "together": together}


def embedded(size: int, out: dict) -> None:
    """The embedded model at f32 over `size` ranks (9 heads, 3 kv heads: 3 ranks split them)
    through the app: the reference prompts' greedy tokens alone and 8 at once."""
    from starlette.testclient import TestClient

    from app.settings import Settings
    from app.web.app import create_app
    from engine.testing import REFERENCE_PROMPTS

    settings = Settings(engine=config("embedded", size, num_kv_blocks=256, max_num_seqs=8))
    with TestClient(create_app(settings)) as client:
        engine = client.app.state.engine
        out.update(api_greedy(client, engine.loaded.name, REFERENCE_PROMPTS))
        out["ranks"] = sorted({t.rank for s in engine.steps.recent() for t in s.ranks})


def main(argv: list[str]) -> int:
    from engine.engine import Engine

    mode, folder, out_path = argv
    if mode in ("serve", "embedded") or mode in FEATURES:
        out: dict = {}
        if mode == "serve":
            serve(folder, out)
        elif mode == "embedded":  # folder: the number of ranks
            embedded(int(folder), out)
        else:
            out = feature(folder, 2, mode)
        Path(out_path).write_text(json.dumps(out))
        return 0
    out = {}
    engine = Engine(config(folder, 2)).start(timeout=240)
    ranks = engine.runner.coordinator.ranks
    out["ports"] = engine.runner.ports
    try:
        if mode == "greedy":
            out.update(greedy(engine))
            out["ranks"] = [[r.rank for r in s.ranks] for s in engine.steps.recent()]
            # --time-collectives is off by default: no all_sum time, rather than a zero
            out["all_sum_s"] = sorted({repr(r.all_sum_s) for s in engine.steps.recent()
                                       for r in s.ranks})
            out["idle_cpu"] = idle_cpu(ranks.processes[1].pid)
        else:
            _kill(engine, ranks, out)
    finally:
        engine.stop()
    out["exits"] = {str(r): p.poll() for r, p in ranks.processes.items()}
    Path(out_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
