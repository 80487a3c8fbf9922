"""What serving costs at one stream: `batchscope serve` against the engine in process.

One person typing into the playground is one stream. The same short prompt (a distinct first
word per request, so no prefix-cache hits), --max-tokens tokens with ignore_eos, greedy, goes
in each round to:
- the engine in this process (Engine.submit, its events read on this thread);
- `batchscope serve` (a subprocess, default flags but --weights, its own runs database) over
  HTTP, streamed (`/v1/completions`, stream with usage, as `batchscope bench serve` sends it)
  and not streamed.
The client is a plain blocking socket (http.client), so what the two CPU cores spend on the
client is small next to the server's share.

Per request: TTFT (send to first text: the first token event in process, the first SSE chunk
with text over HTTP), decode tok/s (the tokens after the first over the time from the first to
the end: the finish event, the `[DONE]` line) and, not streamed, the whole request's tok/s
(tokens over send-to-response). On Linux it also reads, per request, the serving process's
CPU time and wake-ups per output token from /proc: these hardly move when other work shares
the machine, where the rates do. Each round measures every side back to back, in an order that
alternates; the table gives each side's median over the rounds and the median of the
per-round ratios (server / engine, TTFT as engine / server so that 1.00x is no overhead and
lower is worse) with their range.

    .venv/bin/python benchmarks/serve_overhead.py [--weights auto] [--max-tokens 128]
        [--rounds 7] [--base REV] [--compare-flags FLAGS]

--base REV also serves revision REV (a temporary git worktree with its own native kernels, as
benchmarks/build_ab.py builds it) beside the working tree, measured in the same rounds.
--compare-flags FLAGS also serves the working tree with these `batchscope serve` flags added
(one string, e.g. "--no-async-scheduling"), measured in the same rounds.
Writes benchmarks/results/serve_overhead.{md,json} unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# isort: off
import engine  # noqa: F401  (binds MLX to the optimized BLAS: must come before mlx is imported)
# isort: on
# benchmarks/build_ab.py (the script directory is on sys.path)
from build_ab import backend_line, base_tree, write_results
from peers import free_port, running_server, server_commands

from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import FinishEvent, TokenEvent
from engine.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT = "{}: Write a short story about a lighthouse keeper."
METRICS = ("ttft_ms", "decode_tps", "e2e_tps", "cpu_us")


def prompt(i: int) -> str:
    return PROMPT.format(["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot"][i % 6]
                         + str(i))


# ---- CPU time per thread (Linux: /proc) ---------------------------------------------------------
# The main thread (the event loop in the server, the events' reader in process) and the rest:
# the engine thread, the BLAS workers, the runs recorder's writer. (Python does not name its
# threads to the OS, so the rest cannot be told apart from outside.)
ROLES = ("loop", "rest")


def threads(pid: int) -> dict[str, list[int]] | None:
    """Per role [CPU ns, voluntary context switches (the thread blocked: one wake-up each)];
    None where /proc has no per-thread accounts."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return None
    out = {role: [0, 0] for role in ROLES}
    for task in tasks.iterdir():
        try:
            cpu = int((task / "schedstat").read_text().split()[0])
            status = (task / "status").read_text()
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        role = out["loop" if task.name == str(pid) else "rest"]
        role[0] += cpu
        role[1] += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return out


def measured(pid: int, request: Callable[[], dict], tokens: int) -> dict:
    """The request's own figures plus, per role, CPU µs and wake-ups per output token."""
    before = threads(pid)
    result = request()
    after = threads(pid)
    if before is None or after is None:
        return result
    for role in ROLES:
        result[f"{role}_cpu_us"] = (after[role][0] - before[role][0]) / 1e3 / tokens
        result[f"{role}_wakeups"] = (after[role][1] - before[role][1]) / tokens
    result["cpu_us"] = sum(result[f"{role}_cpu_us"] for role in ROLES)
    return result


# ---- the engine in process ---------------------------------------------------------------------
def engine_request(eng: Engine, text: str, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    handle = eng.submit(eng.encode(text), params)
    first = end = None
    tokens = 0
    for event in handle:
        now = time.perf_counter()
        if isinstance(event, TokenEvent):
            tokens += 1
            if first is None and event.text:
                first = now
        elif isinstance(event, FinishEvent):
            end = now
    assert tokens == max_tokens and first is not None and end is not None, (tokens, first)
    return {"ttft_ms": (first - t0) * 1e3, "decode_tps": (tokens - 1) / (end - first),
            "e2e_tps": tokens / (end - t0)}


# ---- over HTTP ---------------------------------------------------------------------------------
def http_request(port: int, text: str, max_tokens: int, stream: bool) -> dict:
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        if not stream:
            data = json.loads(response.read())
            end = time.perf_counter()
            tokens = data["usage"]["completion_tokens"]
            assert tokens == max_tokens, data["usage"]
            return {"e2e_tps": tokens / (end - t0)}
        first = end = None
        usage = None
        while line := response.readline():
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            now = time.perf_counter()
            if payload == b"[DONE]":
                end = now
                break
            chunk = json.loads(payload)
            usage = chunk.get("usage") or usage
            if first is None and any(c.get("text") for c in chunk["choices"]):
                first = now
    finally:
        conn.close()
    assert usage is not None and usage["completion_tokens"] == max_tokens, usage
    assert first is not None and end is not None
    return {"ttft_ms": (first - t0) * 1e3, "decode_tps": (max_tokens - 1) / (end - first)}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(rounds: list[dict], sides: list[str]) -> dict:
    """Per side the median of each metric; per server side the per-round ratios against the
    engine (TTFT inverted: engine / server), as median and range."""
    out: dict = {}
    for side in sides:
        row: dict = {}
        for m in METRICS:
            values = [r[side][m] for r in rounds if m in r[side]]
            if not values:
                continue
            row[m] = _median(values)
            if side != "engine":
                ratios = [(r["engine"][m] / r[side][m]) if m in ("ttft_ms", "cpu_us")
                          else (r[side][m] / r["engine"][m]) for r in rounds if m in r[side]]
                row[f"{m}_ratio"] = [_median(ratios), min(ratios), max(ratios)]
        for key in rounds[0][side]:
            if key.endswith(("_cpu_us", "_wakeups")):
                row[key] = _median([r[side][key] for r in rounds])
        out[side] = row
    return out


def _ratio(cell: list[float]) -> str:
    return f"{cell[0]:.2f}x ({cell[1]:.2f}-{cell[2]:.2f})"


def render(summary: dict, servers: list[str], meta: dict) -> str:
    e = summary["engine"]
    lines = [
        "# Serving at one stream: `batchscope serve` against the engine in process", "",
        f"`benchmarks/serve_overhead.py`, {meta['date']}: {meta['rounds']} rounds, one request "
        f"at a time, a {meta['prompt_tokens']}-token prompt, {meta['max_tokens']} tokens "
        f"(ignore_eos, greedy), weights {meta['weights']}, {meta['backend']}. Ratios are "
        "per round against the engine measured in the same round (median, range); 1.00x is "
        "no overhead. TTFT's ratio is engine / server.", "",
        "| side | TTFT ms | ratio | decode tok/s | ratio | whole request tok/s (not streamed) "
        "| ratio |",
        "|---|---|---|---|---|---|---|",
        f"| engine in process | {e['ttft_ms']:.1f} | 1.00x | {e['decode_tps']:.1f} | 1.00x | "
        f"{e['e2e_tps']:.1f} | 1.00x |",
    ]
    for name in servers:
        s, n = summary[f"{name}:stream"], summary[f"{name}:json"]
        lines.append(
            f"| {name} | {s['ttft_ms']:.1f} | {_ratio(s['ttft_ms_ratio'])} | "
            f"{s['decode_tps']:.1f} | {_ratio(s['decode_tps_ratio'])} | {n['e2e_tps']:.1f} | "
            f"{_ratio(n['e2e_tps_ratio'])} |")
    if "cpu_us" not in e:
        return "\n".join(lines) + "\n"
    lines += [
        "", "## CPU per output token", "",
        "CPU time of the serving process per output token (from /proc), medians over the "
        "rounds: its main thread (the server's event loop; in process, the thread reading the "
        "events) and the others (the engine thread, the BLAS workers, the runs writer). "
        "Wake-ups are the times threads blocked and were woken (voluntary context switches). "
        "The ratio is the engine's total over the side's (1.00x: serving costs nothing "
        "more).", "",
        "| side | main thread µs | other threads µs | total µs | ratio "
        "| main thread wake-ups | other threads' wake-ups |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [("engine in process", e)] + [
        (f"{name}, {kind}", summary[f"{name}:{key}"]) for name in servers
        for kind, key in (("streamed", "stream"), ("not streamed", "json"))]
    for label, row in rows:
        ratio = _ratio(row["cpu_us_ratio"]) if "cpu_us_ratio" in row else "1.00x"
        lines.append(
            f"| {label} | {row['loop_cpu_us']:.0f} | {row['rest_cpu_us']:.0f} | "
            f"{row['cpu_us']:.0f} | {ratio} | {row['loop_wakeups']:.2f} | "
            f"{row['rest_wakeups']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--base", help="also serve this git revision, side by side")
    ap.add_argument("--compare-flags", metavar="FLAGS",
                    help="also serve this tree with these serve flags added, side by side")
    ap.add_argument("--out", default=str(HERE / "results" / "serve_overhead"))
    args = ap.parse_args()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    with tempfile.TemporaryDirectory(prefix="serve-overhead-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        # Each server side: the tree it serves from and the flags it adds.
        trees = {"serve (this tree)": (ROOT, [])}
        if args.base:
            trees[f"serve ({args.base})"] = (stack.enter_context(base_tree(args.base, work)), [])
        if args.compare_flags:
            trees[f"serve ({args.compare_flags})"] = (ROOT, shlex.split(args.compare_flags))
        ports, pids = {}, {}
        for name, (tree, flags) in trees.items():
            port = free_port()
            cmd = server_commands("batchscope", port, args.weights, work,
                                  work / f"{len(ports)}.db") + flags
            _, proc = stack.enter_context(running_server(name, cmd, port,
                                                         work / f"{len(ports)}.log", log, tree))
            ports[name], pids[name] = port, proc.pid
        eng = stack.enter_context(Engine(EngineConfig(weights=args.weights)))
        weights = eng.loaded.weights
        prompt_tokens = len(eng.encode(prompt(0)))

        def one(side: str, i: int) -> dict:
            text, n = prompt(i), args.max_tokens
            if side == "engine":
                return measured(os.getpid(), lambda: engine_request(eng, text, n), n)
            name, kind = side.rsplit(":", 1)
            return measured(pids[name], lambda: http_request(ports[name], text, n,
                                                             kind == "stream"), n)

        sides = ["engine", *(f"{n}:{k}" for n in trees for k in ("stream", "json"))]
        for side in sides:  # warm-up: every path compiled and imported once
            one(side, 1000)
        rounds = []
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            results = {side: one(side, r * len(sides) + k) for k, side in enumerate(order)}
            rounds.append(results)
            log(f"round {r + 1}: " + ", ".join(
                f"{s} " + "/".join(f"{v:.1f}" for v in results[s].values()) for s in sides))

    summary = summarize(rounds, sides)
    meta = {"date": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
            "max_tokens": args.max_tokens, "prompt_tokens": prompt_tokens, "weights": weights,
            "backend": backend_line(blas=True), "base": args.base,
            "compare_flags": args.compare_flags}
    write_results(Path(args.out), {"meta": meta, "summary": summary, "rounds": rounds},
                  render(summary, list(trees), meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
