"""kill -9 in the middle of generation: the runs database survives, and the next start marks
the runs that were in flight as interrupted and serves again. Slow: starts `batchscope serve`
(the embedded model) twice."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import httpx
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--num-kv-blocks", "128"]
GREEDY = {"temperature": 0, "max_tokens": 12}


def read_db(path) -> tuple[str, dict[str, dict], dict[str, int]]:
    """integrity_check, runs by id, and run_tokens rows per run."""
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    try:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
        runs = {r["id"]: dict(r) for r in conn.execute("SELECT * FROM runs")}
        tokens = dict(conn.execute("SELECT run_id, count(*) FROM run_tokens GROUP BY run_id"))
    finally:
        conn.close()
    return integrity, runs, tokens


def stream(client: httpx.Client, path: str, body: dict, out: dict) -> None:
    """Stream one request into `out` (id, text, chunks, finish), until the end or a failure."""
    out.update(text="", chunks=0, finish=None, broken=None)
    try:
        with client.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                out["id"] = chunk["id"]
                choice = chunk["choices"][0]
                delta = choice.get("delta") or {}
                out["text"] += choice.get("text") or delta.get("content") or ""
                out["chunks"] += 1
                out["finish"] = choice["finish_reason"] or out["finish"]
    except httpx.HTTPError as e:  # the server was killed under us
        out["broken"] = f"{type(e).__name__}: {e}"


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def test_kill_9_mid_generation_keeps_the_database_and_the_next_start_recovers(tmp_path):
    db = tmp_path / "runs.db"
    server = ServerProcess(db, tmp_path / "server1.log", SERVER_ARGS).start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            # Runs that complete before the crash, through all three response kinds.
            done: dict[str, dict] = {}
            r = client.post("/v1/completions", json={"prompt": "The capital of France is",
                                                     **GREEDY})
            assert r.status_code == 200
            done[r.json()["id"]] = {"text": r.json()["choices"][0]["text"]}
            for path, body in [
                ("/v1/completions", {"prompt": "Three rivers of Europe:", **GREEDY}),
                ("/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "Say hello."}], **GREEDY}),
            ]:
                out: dict = {}
                stream(client, path, body, out)
                assert out["finish"] in ("stop", "length") and out["broken"] is None
                done[out["id"]] = out

            # Runs in flight when the server dies.
            long = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
            flying = [{} for _ in range(3)]
            threads = [threading.Thread(target=stream, args=(
                client, "/v1/completions", {"prompt": f"Story number {i}:", **long}, out))
                for i, out in enumerate(flying)]
            for t in threads:
                t.start()
            wait_for(lambda: all(o.get("chunks", 0) >= 3 for o in flying), 120,
                     "the in-flight streams to get going")

            def tokens_on_disk():
                _, runs, _ = read_db(db)
                return all(runs.get(o["id"], {}).get("output_text") for o in flying)

            wait_for(tokens_on_disk, 30, "the in-flight runs' first tokens in the database")
            server.kill()
            for t in threads:
                t.join(30)
            assert all(o["broken"] and o["finish"] is None for o in flying), flying
    finally:
        server.stop()

    # (a) The file as the crash left it (WAL included): intact, completed runs whole.
    integrity, runs, token_rows = read_db(db)
    assert integrity == "ok"
    for run_id, seen in done.items():
        run = runs[run_id]
        assert run["status"] == "finished" and run["finish_reason"] in ("stop", "length")
        assert run["output_text"] == seen["text"]
        assert token_rows.get(run_id, 0) == run["completion_tokens"] == len(
            json.loads(run["output_token_ids_json"]))
    for o in flying:
        run = runs[o["id"]]
        assert run["status"] == "running"  # nobody could say otherwise before the restart
        # What reached the disk is what the client had been sent, up to the kill.
        assert run["output_text"] and o["text"].startswith(run["output_text"])
        assert token_rows[o["id"]] == run["completion_tokens"]

    # (b) Restart on the same database.
    server = ServerProcess(db, tmp_path / "server2.log", SERVER_ARGS).start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            r = client.post("/v1/completions", json={"prompt": "The capital of France is",
                                                     **GREEDY})
            assert r.status_code == 200
            after_id = r.json()["id"]
            # Same greedy request, same text: the engine serves as before the crash.
            assert r.json()["choices"][0]["text"] == next(iter(done.values()))["text"]

            def listed() -> dict[str, str] | None:  # once the new run's finish is written
                rows = client.get("/runs.json", params={"per_page": 100}).json()["runs"]
                status = {row["id"]: row["status"] for row in rows}
                return status if status.get(after_id) == "finished" else None

            status = wait_for(listed, 10, "the new run's finish in /runs.json")
            page = client.get("/runs", params={"per_page": 100})
            assert page.status_code == 200
        assert "marked 3 unfinished runs as interrupted" in server.log(20000)
    finally:
        assert server.stop() == 0
    expected = set(done) | {o["id"] for o in flying} | {after_id}
    assert set(status) == expected
    assert all(status[o["id"]] == "interrupted" for o in flying)
    assert all(status[i] == "finished" for i in set(done) | {after_id})
    for run_id in expected:
        assert run_id in page.text
    _, runs_after, _ = read_db(db)
    for o in flying:  # interrupted runs keep the text they had
        assert runs_after[o["id"]]["output_text"] == runs[o["id"]]["output_text"]
