#!/usr/bin/env python
"""Soak test: many concurrent streaming clients against a live server, then an audit.

    .venv/bin/python scripts/soak.py                       # 32 clients, 300 s, own server
    .venv/bin/python scripts/soak.py --clients 8 --duration 30
    .venv/bin/python scripts/soak.py --url http://127.0.0.1:8000 [--db PATH] [--pid PID]

Without --url it starts `batchscope serve` itself on loopback (port 0, a temporary database,
the embedded model with --weights auto, the fastest format on this machine
(engine/weights/formats.py), and a 256-block KV pool; --server-args changes them). Each client
loops until the duration is over, picking at random:

    stream      a streamed completion or chat request, read to [DONE]
    disconnect  a streamed request (ignore_eos, long) dropped after a few chunks: the server
                must cancel it in the engine (the API has no cancel call: a client leaving is
                the cancel, as with OpenAI)
    plain       a non-streamed request, read whole
    abandon     a non-streamed request given up after a random 0.3-3 s (the connection closes:
                the server must cancel it, unless it finished first)

HTTP 429 (a full waiting queue) is an expected outcome: counted, and retried after Retry-After.
After the duration the clients finish what they started, the server is waited on until idle,
and the audit checks: no 5xx and no error chunk in a stream; every completed request recorded
with exactly the text the client received; every disconnected one recorded as cancelled;
abandoned ones recorded as cancelled or finished; nothing left "running"; no KV block held
(only evictable prefix-cache blocks may remain, from /dashboard.json); the server's resident
memory (VmRSS) grew less than --max-rss-growth after warm-up; SQLite's integrity_check is ok.
It prints a summary and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "The history of the printing press",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three facts about Mars:",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Translate to French: good morning, how are you?",
]
# A long shared preamble so that many requests start with the same blocks (prefix cache).
PREAMBLE = ("You are a careful assistant. Answer briefly and precisely, in plain English, "
            "without lists unless asked. ")


# ---- the server ------------------------------------------------------------------------------
class ServerProcess:
    """`batchscope serve` in a subprocess on a free loopback port, logging to a file."""

    def __init__(self, db: Path, log: Path, extra: list[str] | None = None):
        self.db, self.log_path = db, log
        self.args = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1",
                     "--port", "0", "--db", str(db), *(extra or [])]
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 180) -> ServerProcess:
        self._log = open(self.log_path, "ab")  # closed in stop()
        self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(rb"Uvicorn running on (http://[\d.]+:\d+)",
                              self.log_path.read_bytes())
            if match:
                self.url = match.group(1).decode()
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start in {timeout:.0f} s:\n{self.log()}")
            time.sleep(0.1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_bytes()[-tail:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no shutdown, no flush, as a crash or the OOM killer would."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()

    def stop(self, timeout: float = 30) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        with contextlib.suppress(Exception):
            self._log.close()
        return self.proc.returncode if self.proc else None


def rss_kib(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else None


# ---- the clients -----------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str  # stream | disconnect | plain | abandon
    marker: str
    run_id: str | None = None
    status: int | None = None
    text: str = ""
    finish_reason: str | None = None
    chunks: int = 0
    error: str | None = None  # an error chunk in a stream, or a failed request
    gave_up: bool = False  # abandon: the client closed before the response came


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    throttled: int = 0  # 429s (retried)
    transport_errors: list[str] = field(default_factory=list)


def request_body(rng: random.Random, marker: str, kind: str) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    prompt = f"{rng.choice(PROMPTS)} {marker}"
    if kind == "disconnect":  # long enough that it cannot finish before the server notices
        params = {"max_tokens": rng.randint(96, 160), "ignore_eos": True}
    else:
        params = {"max_tokens": rng.randint(4, 40)}
    params["temperature"] = rng.choice([0.0, 0.0, 0.7, 1.0])
    if params["temperature"]:
        params["seed"] = rng.randrange(1 << 30)
    if chat:
        body = {"messages": [{"role": "system", "content": PREAMBLE},
                             {"role": "user", "content": prompt}], **params}
        return "/v1/chat/completions", body
    return "/v1/completions", {"prompt": PREAMBLE + prompt, **params}


def chunk_text(chunk: dict) -> str:
    choice = chunk["choices"][0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def post_once(client: httpx.AsyncClient, rng: random.Random, kind: str, marker: str,
                    tally: Tally) -> Outcome | None:
    """One request; None when it was throttled (429) and should be retried."""
    path, body = request_body(rng, marker, kind)
    out = Outcome(kind, marker)
    if kind in ("stream", "disconnect"):
        body["stream"] = True
        drop_after = rng.randint(1, 8) if kind == "disconnect" else None
        async with client.stream("POST", path, json=body) as r:
            out.status = r.status_code
            tally.statuses[r.status_code] += 1
            if r.status_code == 429:
                await r.aread()
                await asyncio.sleep(retry_after(r))
                return None
            if r.status_code != 200:
                out.error = (await r.aread()).decode(errors="replace")[:300]
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = chunk["error"].get("message")
                    continue
                out.run_id = chunk.get("id") or out.run_id
                if not chunk.get("choices"):
                    continue  # the usage chunk
                out.chunks += 1
                out.text += chunk_text(chunk)
                out.finish_reason = chunk["choices"][0].get("finish_reason") or out.finish_reason
                if drop_after is not None and out.chunks >= drop_after and out.run_id:
                    break  # leaving the block closes the connection mid-stream
        return out
    # plain and abandon: one JSON response
    send = client.post(path, json=body)
    try:
        if kind == "abandon":
            r = await asyncio.wait_for(send, timeout=rng.uniform(0.3, 3.0))
        else:
            r = await send
    except TimeoutError:
        out.gave_up = True
        return out
    out.status = r.status_code
    tally.statuses[r.status_code] += 1
    if r.status_code == 429:
        await asyncio.sleep(retry_after(r))
        return None
    if r.status_code != 200:
        out.error = r.text[:300]
        return out
    data = r.json()
    out.run_id = data["id"]
    choice = data["choices"][0]
    out.text = choice["message"]["content"] if "message" in choice else choice["text"]
    out.finish_reason = choice["finish_reason"]
    return out


def retry_after(r: httpx.Response) -> float:
    try:
        return min(max(float(r.headers.get("retry-after", "1")), 0.1), 10.0)
    except ValueError:
        return 1.0


async def client_loop(index: int, url: str, deadline: float, seed: int, tally: Tally,
                      mix: dict[str, float], headers: dict[str, str]) -> None:
    rng = random.Random(seed * 1000 + index)
    kinds, weights = zip(*mix.items(), strict=True)
    n = 0
    timeout = httpx.Timeout(300, connect=30)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers) as client:
        while time.monotonic() < deadline:
            # The first requests cycle through the kinds, so even a short run has each.
            kind = kinds[index % len(kinds)] if n == 0 else rng.choices(kinds, weights)[0]
            marker = f"[soak {seed}-{index}-{n}]"
            n += 1
            try:
                while True:
                    outcome = await post_once(client, rng, kind, marker, tally)
                    if outcome is not None:
                        break
                    tally.throttled += 1
                    if time.monotonic() > deadline:
                        break
            except httpx.HTTPError as e:
                tally.transport_errors.append(f"{marker} {kind}: {type(e).__name__}: {e}")
                continue
            if outcome is not None:
                tally.outcomes.append(outcome)
            await asyncio.sleep(rng.uniform(0, 0.2))


# ---- the audit -------------------------------------------------------------------------------
class RunsReader:
    """Recorded runs, from the SQLite file when we know it, else from the JSON pages."""

    def __init__(self, url: str, db: Path | None, headers: dict[str, str]):
        self.url, self.db, self.headers = url, db, headers

    def by_marker(self, markers: list[str]) -> dict[str, list[dict]]:
        found: dict[str, list[dict]] = {m: [] for m in markers}
        if self.db is not None:
            conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30)
            try:
                conn.row_factory = sqlite3.Row
                rows = conn.execute("SELECT id, status, finish_reason, error, output_text, "
                                    "prompt_text FROM runs").fetchall()
            finally:
                conn.close()
            pattern = re.compile(r"\[soak [\d-]+\]")
            for row in rows:
                for m in pattern.findall(row["prompt_text"] or ""):
                    if m in found:
                        found[m].append(dict(row))
            return found
        with httpx.Client(base_url=self.url, timeout=60, headers=self.headers) as client:
            for m in markers:
                listed = client.get("/runs.json", params={"q": m, "per_page": 10}).json()
                for item in listed["runs"]:
                    full = client.get(f"/runs/{item['id']}.json").json()
                    if m in (full.get("prompt_text") or ""):
                        found[m].append(full)
        return found

    def integrity(self) -> str | None:
        if self.db is None:
            return None
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30)
        try:
            return conn.execute("PRAGMA integrity_check").fetchone()[0]
        finally:
            conn.close()


def wait_idle(url: str, timeout: float, headers: dict[str, str]) -> dict:
    """The dashboard's live state once nothing runs or waits (or at the timeout)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=30, headers=headers) as client:
        while True:
            state = client.get("/dashboard.json").json()["state"]
            if (state["idle"] and state["kv"]["used"] == 0) or time.monotonic() > deadline:
                return state
            time.sleep(0.25)


def audit(tally: Tally, reader: RunsReader, failures: list[str],
          settle: float = 15.0) -> dict[str, int]:
    counts: Counter = Counter()
    markers = [o.marker for o in tally.outcomes]
    # The recorder writes in batches: give the last finishes up to `settle` s to land.
    deadline = time.monotonic() + settle
    while True:
        recorded = reader.by_marker(markers)
        running = [m for m, rows in recorded.items() if any(r["status"] == "running"
                                                              for r in rows)]
        if not running or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for o in tally.outcomes:
        rows = recorded.get(o.marker, [])
        counts[o.kind] += 1
        if o.error is not None:
            failures.append(f"{o.marker} {o.kind}: status {o.status}: {o.error}")
            continue
        if o.gave_up and not rows:
            counts["abandon_unrecorded"] += 1  # gave up before the server submitted it
            continue
        if len(rows) != 1:
            failures.append(f"{o.marker} {o.kind}: {len(rows)} recorded runs, expected 1")
            continue
        row = rows[0]
        if o.run_id is not None and row["id"] != o.run_id:
            failures.append(f"{o.marker}: recorded as {row['id']}, the client saw {o.run_id}")
        if row["status"] == "running":
            failures.append(f"{o.marker} {o.kind}: still 'running' in the database")
            continue
        reason = row["finish_reason"]
        if o.kind == "disconnect" and o.finish_reason is None:
            if reason != "cancelled":
                failures.append(f"{o.marker} disconnect: recorded {reason!r}, not 'cancelled'")
            else:
                counts["cancelled"] += 1
        elif o.gave_up:
            if reason == "cancelled":
                counts["cancelled"] += 1
            elif reason not in ("stop", "length"):
                failures.append(f"{o.marker} abandon: recorded {reason!r}")
        else:
            counts["completed"] += 1
            if reason != o.finish_reason:
                failures.append(f"{o.marker} {o.kind}: finish {o.finish_reason!r} streamed, "
                                f"{reason!r} recorded")
            if (row["output_text"] or "") != o.text:
                failures.append(f"{o.marker} {o.kind}: recorded output differs from what the "
                                f"client received ({len(row['output_text'] or '')} vs "
                                f"{len(o.text)} chars)")
    return counts


# ---- main ------------------------------------------------------------------------------------
async def drive(url: str, args: argparse.Namespace, pid: int | None) -> tuple[Tally, dict]:
    tally = Tally()
    mix = {"stream": 0.55, "disconnect": 0.2, "plain": 0.15, "abandon": 0.1}
    start = time.monotonic()
    deadline = start + args.duration
    headers = auth_headers(args)
    tasks = [asyncio.create_task(client_loop(i, url, deadline, args.seed, tally, mix, headers))
             for i in range(args.clients)]
    rss: dict = {"warm": None, "end": None}
    warmup = args.warmup if args.warmup is not None else min(60.0, args.duration * 0.25)
    if pid is not None:
        await asyncio.sleep(warmup)
        rss["warm"] = rss_kib(pid)
    last_report = time.monotonic()
    while not all(t.done() for t in tasks):
        await asyncio.sleep(1)
        if time.monotonic() - last_report >= 30:
            last_report = time.monotonic()
            print(f"  {time.monotonic() - start:5.0f} s: {len(tally.outcomes)} requests done, "
                  f"statuses {dict(tally.statuses)}", flush=True)
    for t in tasks:
        t.result()
    return tally, rss


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=300, help="seconds of load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="use this server instead of starting one")
    parser.add_argument("--db", type=Path, default=None,
                        help="with --url: the server's SQLite file (else the audit reads the "
                             "JSON pages)")
    parser.add_argument("--api-key", default=os.environ.get("BATCHSCOPE_API_KEY"),
                        help="with --url: the server's API key (default $BATCHSCOPE_API_KEY)")
    parser.add_argument("--pid", type=int, default=None,
                        help="with --url: the server's process id, for the memory check")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before the first memory sample (default: a quarter of "
                             "the duration, at most 60)")
    parser.add_argument("--max-rss-growth", type=float, default=10.0, help="percent")
    parser.add_argument("--server-args", default="--weights auto --num-kv-blocks 256",
                        help="`batchscope serve` arguments for the server started here "
                             "(write --server-args='--flag value ...')")
    args = parser.parse_args(argv)

    server = None
    tmp = None
    if args.url is None:
        tmp = tempfile.TemporaryDirectory(prefix="batchscope-soak-")
        db = Path(tmp.name) / "soak.db"
        server = ServerProcess(db, Path(tmp.name) / "server.log", args.server_args.split())
        print(f"starting batchscope serve ({args.server_args}) ...", flush=True)
        server.start()
        url, pid = server.url, server.pid
    else:
        url, pid, db = args.url.rstrip("/"), args.pid, args.db
    print(f"soak: {args.clients} clients for {args.duration:.0f} s against {url} "
          f"(seed {args.seed})", flush=True)
    failures: list[str] = []
    try:
        began = time.monotonic()
        tally, rss = asyncio.run(drive(url, args, pid))
        elapsed = time.monotonic() - began
        state = wait_idle(url, timeout=120, headers=auth_headers(args))
        if pid is not None:
            rss["end"] = rss_kib(pid)
        reader = RunsReader(url, db, auth_headers(args))
        counts = audit(tally, reader, failures)
        integrity = reader.integrity()
        if server is not None and server.proc.poll() is not None:
            failures.append(f"the server died (exit {server.proc.returncode})")
    finally:
        if server is not None:
            code = server.stop()
            if code not in (0, None) and not failures:
                failures.append(f"the server exited with {code} at shutdown")
            if failures:
                print("---- server log (tail) ----\n" + server.log(3000), file=sys.stderr)
            tmp.cleanup()

    five = sum(n for s, n in tally.statuses.items() if s >= 500)
    other4 = {s: n for s, n in tally.statuses.items() if 400 <= s < 500 and s != 429}
    leaked = state["kv"]["used"]
    if five:
        failures.append(f"{five} responses with a 5xx status")
    if other4:
        failures.append(f"unexpected 4xx responses: {other4}")
    if tally.transport_errors:
        failures += tally.transport_errors[:10]
    if leaked or not state["idle"]:
        failures.append(f"after the drain: {leaked} KV blocks held, idle={state['idle']}")
    if integrity not in (None, "ok"):
        failures.append(f"integrity_check: {integrity}")
    growth = None
    if rss["warm"] and rss["end"]:
        growth = 100.0 * (rss["end"] - rss["warm"]) / rss["warm"]
        if growth >= args.max_rss_growth:
            failures.append(f"resident memory grew {growth:.1f}% after warm-up "
                            f"(limit {args.max_rss_growth:g}%)")

    def mib(kib):
        return f"{kib / 1024:.0f} MiB" if kib else "n/a"

    print("\n==== soak summary ====")
    print(f"clients {args.clients}, duration {elapsed:.0f} s, seed {args.seed}")
    print(f"requests         {len(tally.outcomes)}  (stream {counts['stream']}, "
          f"disconnect {counts['disconnect']}, plain {counts['plain']}, "
          f"abandon {counts['abandon']})")
    print(f"completed        {counts['completed']}  (recorded text == received text checked)")
    print(f"disconnected     {counts['disconnect']} streams dropped mid-way, "
          f"{counts['abandon']} plain requests abandoned "
          f"({counts['abandon_unrecorded']} of them before the server took them)")
    print(f"cancelled (db)   {counts['cancelled']}  (every dropped stream must be; an abandoned "
          "request may have finished first)")
    print(f"HTTP statuses    {dict(sorted(tally.statuses.items()))}; 429 retried "
          f"{tally.throttled}; 5xx {five}; transport errors {len(tally.transport_errors)}")
    print(f"KV blocks        leaked {leaked}, cached (evictable) {state['kv']['cached']}, "
          f"of {state['kv']['num_blocks']}")
    print(f"RSS              warm {mib(rss['warm'])}, end {mib(rss['end'])}, growth "
          + (f"{growth:+.1f}%" if growth is not None else "n/a"))
    print(f"sqlite           integrity_check {integrity or 'n/a (no --db)'}")
    if failures:
        print(f"FAILED: {len(failures)} problems")
        for f in failures[:30]:
            print("  - " + f)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
