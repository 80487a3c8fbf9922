"""`batchscope bench serve` against a live batchscope server on the tiny model (real HTTP on
loopback), recording into the server's SQLite database; then /benchmarks shows the run."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from bs4 import BeautifulSoup
from live_server import serving
from sqlalchemy import select

from app.cli import main
from app.db import Database, Recorder, open_database
from app.db import benchmarks as store
from app.db.models import Run
from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model

LABEL = "<script>alert('x')</script> c2"
PROMPTS = ["The cat sat on the mat", "Once upon a time", "Numbers: 1 2 3 4 5 6 7 8 9",
           "A", "Tell me about rivers and seas", "zz"]


@dataclass
class Live:
    url: str
    db: Database


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    db = open_database(tmp_path_factory.mktemp("bench") / "runs.db")
    recorder = Recorder(db, flush_interval=0.01)
    recorder.start()
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=128)),
                     engine_factory=lambda config: Engine(config, loader=tiny_model),
                     recorder_factory=lambda settings: recorder)  # closed by the lifespan
    with serving(app) as url:
        yield Live(url, db)
    db.close()


@pytest.fixture(scope="module")
def bench_run(live, tmp_path_factory) -> dict:
    """One benchmark: 6 distinct prompts (distinct lengths), concurrency 2, recorded."""
    tmp = tmp_path_factory.mktemp("bench_run")
    dataset = tmp / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p, "max_tokens": 3 + i}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    result = tmp / "result.json"
    rc = main(["bench", "serve", "--url", live.url, "--dataset", str(dataset),
               "--num-prompts", str(len(PROMPTS)), "--max-concurrency", "2",
               "--label", LABEL, "--goodput", "e2el:60000", "--db", str(live.db.path),
               "--save-result", str(result)])
    assert rc == 0
    return json.loads(result.read_text())


def server_runs(db: Database, count: int, timeout: float = 20) -> list[Run]:
    """The server's API runs, once `count` of them are finished: a run's finish is written
    by the server's recorder thread after the client has read the last chunk."""
    deadline = time.monotonic() + timeout
    while True:
        with db.read() as conn:
            runs = list(conn.execute(select(Run).where(Run.source == "api")).all())
        done = [r for r in runs if r.status != "running"]
        if len(done) >= count or time.monotonic() > deadline:
            return runs
        time.sleep(0.05)


def test_every_request_completes_with_the_servers_token_counts(live, bench_run):
    reqs = bench_run["requests"]
    assert bench_run["summary"]["completed"] == len(PROMPTS) == len(reqs)
    assert bench_run["summary"]["failed"] == 0
    # The server's own record of each request (its database), matched by prompt length
    # (bytes with the tiny model's byte tokenizer: all different).
    recorded = {r.prompt_tokens: r for r in server_runs(live.db, len(PROMPTS))}
    assert len(recorded) == len(PROMPTS)
    for req in reqs:
        prompt = PROMPTS[req["index"]]
        run = recorded[len(prompt.encode())]
        assert req["prompt_tokens"] == run.prompt_tokens
        assert req["output_tokens"] == run.completion_tokens == req["max_tokens"]  # ignore_eos
        assert req["output_tokens_source"] == "usage"
        assert req["chunks"] <= req["output_tokens"]  # partial UTF-8 tokens send no text
        assert 0 < req["ttft"] <= req["latency"]
        assert len(req["itl"]) == max(req["chunks"] - 1, 0)
    s = bench_run["summary"]
    assert s["total_output_tokens"] == sum(3 + i for i in range(len(PROMPTS)))
    assert s["total_input_tokens"] == sum(len(p.encode()) for p in PROMPTS)
    assert 1 <= s["peak_concurrency"] <= 2
    assert s["goodput"]["good_requests"] == len(PROMPTS)
    assert s["tpot"]["count"] == len(PROMPTS)  # every request has at least 3 tokens


def test_the_run_is_recorded(live, bench_run):
    listing = store.list_runs(live.db)
    (run,) = [r for r in listing["runs"] if r["id"] == bench_run["benchmark_id"]]
    assert run["label"] == LABEL and run["url"] == live.url
    assert run["model"] == "tiny-llama" and run["max_concurrency"] == 2
    assert run["request_rate"] is None and run["completed"] == len(PROMPTS)
    assert run["summary"] == bench_run["summary"]
    assert store.get_run(live.db, run["id"])["requests"] == bench_run["requests"]


def test_benchmarks_page_and_json_twin_show_recorded_runs(live, bench_run):
    run_id = bench_run["benchmark_id"]
    data = httpx.get(f"{live.url}/benchmarks.json").json()
    (row,) = [r for r in data["runs"] if r["id"] == run_id]
    assert row["summary"]["output_throughput"] == bench_run["summary"]["output_throughput"]
    assert run_id in data["plotted"]
    assert httpx.get(f"{live.url}/benchmarks",
                     headers={"accept": "application/json"}).json() == data

    page = httpx.get(f"{live.url}/benchmarks")
    assert page.status_code == 200 and LABEL not in page.text  # escaped, never raw
    soup = BeautifulSoup(page.text, "html.parser")
    tr = soup.find("tr", attrs={"data-run": str(run_id)})
    assert tr.find(attrs={"data-col": "label"}).get_text() == LABEL
    shown = tr.find(attrs={"data-col": "output_throughput"}).get_text()
    assert shown == f"{bench_run['summary']['output_throughput']:.1f}"
    svgs = soup.find_all("svg")
    assert len(svgs) == 4  # throughput, TTFT, TPOT and E2E CDFs
    assert soup.find("circle", attrs={"data-run": str(run_id)}) is not None
    cdf = soup.find("svg", class_="cdf-ttft")
    line = [p for p in cdf.find_all("polyline") if p["data-n"] == str(len(PROMPTS))]
    assert line, "the TTFT CDF has one point per request"
    assert "<script>" not in str(cdf)

    detail = httpx.get(f"{live.url}/benchmarks/{run_id}.json").json()
    assert detail["requests"] == bench_run["requests"]
    html = httpx.get(f"{live.url}/benchmarks/{run_id}")
    assert html.status_code == 200 and LABEL not in html.text
    assert len(BeautifulSoup(html.text, "html.parser").select("tr[data-request]")) == 6
    assert httpx.get(f"{live.url}/benchmarks/999999.json").status_code == 404
    assert httpx.get(f"{live.url}/benchmarks.json?runs=x").status_code == 400


def test_chat_endpoint_with_the_mixed_dataset(live, tmp_path, capsys):
    rc = main(["bench", "serve", "--url", f"{live.url}/v1", "--endpoint", "chat",
               "--num-prompts", "4", "--request-rate", "50", "--max-tokens-cap", "4",
               "--input-len-cap", "12", "--seed", "3", "--no-record",
               "--save-result", str(tmp_path / "r.json")])
    assert rc == 0
    out = capsys.readouterr()
    assert "Serving Benchmark Result" in out.out and "Successful requests:" in out.out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["benchmark_id"] is None and result["summary"]["completed"] == 4
    assert all(r["output_tokens"] == r["max_tokens"] for r in result["requests"])


def test_unreachable_server_is_one_line_and_nonzero(tmp_path, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nobody listens there now
    rc = main(["bench", "serve", "--url", f"http://127.0.0.1:{port}",
               "--db", str(tmp_path / "b.db")])
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert err.startswith("batchscope bench: error: cannot reach") and "\n" not in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args,message", [
    (["--goodput", "ttft=5"], "--goodput takes NAME:MILLISECONDS"),
    (["--dataset", "missing.jsonl", "--no-record"], "does not exist"),
])
def test_bad_arguments_exit_2_with_a_message(live, args, message, capsys, tmp_path,
                                            monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = main(["bench", "serve", "--url", live.url, *args])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_a_server_with_an_api_key(tmp_path, capsys, monkeypatch):
    for name in ("BATCHSCOPE_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=64), api_key="s3cret"),
                     engine_factory=lambda config: Engine(config, loader=tiny_model))
    dataset = tmp_path / "p.txt"
    dataset.write_text("hello there\n")
    args = ["bench", "serve", "--dataset", str(dataset), "--num-prompts", "2",
            "--max-tokens-cap", "3", "--no-record"]
    with serving(app) as url:
        assert main([*args, "--url", url]) == 1
        err = capsys.readouterr().err.strip()
        assert err == (f"batchscope bench: error: {url} refused the request (HTTP 401): give "
                       "its key with --api-key or $BATCHSCOPE_API_KEY")
        assert main([*args, "--url", url, "--api-key", "wrong"]) == 1
        assert "the key given was refused" in capsys.readouterr().err
        assert main([*args, "--url", url, "--api-key", "s3cret"]) == 0
        assert "Successful requests:                    2" in capsys.readouterr().out
