"""Divergence experiments in the runs database: an experiment run through the page is saved with
its two sides as runs (their tokens equal to the record's), a new app over the same file lists
and shows it, a failed one is saved with its error, bad ids are 404s, and `batchscope diverge
--db` writes a row the page reads."""

from __future__ import annotations

import functools
import json
import time

import pytest
from bs4 import BeautifulSoup
from sqlalchemy import text
from starlette.testclient import TestClient

import app.lab.divergence
from app.cli import build_parser
from app.db import experiments as divergence_store
from app.db.database import DatabaseError, create_database_engine
from app.settings import Settings
from app.web.app import create_app
from app.web.pages.divergence import lab_for
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model
from tests.live_server import runs_recorder

JSON = {"accept": "application/json"}
FORM = {"prompt": "Hello <b>world</b>", "max_tokens": "6", "top_k": "3",
        "a_weights": "f32", "a_policy": "gemm", "a_threshold": "1", "a_alongside": "20",
        "a_join": "0", "a_others_tokens": "4",
        "b_weights": "bf16", "b_policy": "gemv", "b_threshold": "1", "b_alongside": "",
        "b_join": "0", "b_others_tokens": "4"}


def two_models(weights: str):
    """A different random model on side B ("bf16" here): the sides fork."""
    return tiny_model(seed=0 if weights == "f32" else 1, quantize=False)


def q4_loader(weights: str):
    return tiny_model(quantize=weights == "q4")


def broken_loader(weights: str):
    raise RuntimeError(f"no {weights} weights on this shelf")


@pytest.fixture
def db_path(db_target):
    """A SQLite file's path or a PostgreSQL URL (tests/app/conftest.py)."""
    return db_target


def open_client(db_path, loader=two_models) -> TestClient:
    """An app recording into db_path (None: without a database); enter it with `with`."""
    factory = runs_recorder(db_path) if db_path is not None else None
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=128)),
                     engine_factory=lambda config: Engine(config, loader=tiny_model),
                     recorder_factory=factory, divergence_loader=loader)
    # Form posts come from the page itself (app/web/security.py's CSRF rule).
    return TestClient(app, headers={"origin": "http://testserver"})


def run_and_wait(client: TestClient, form: dict = FORM) -> dict:
    r = client.post("/divergence", data=form, follow_redirects=False)
    assert r.status_code == 303, r.text[:300]
    exp_id = r.headers["location"].split("id=")[1]
    deadline = time.time() + 120
    while True:
        entry = client.get(f"/divergence.json?id={exp_id}").json()["experiment"]
        # Finished, and then saved (or not, with the reason).
        if entry["status"] in ("done", "error") and (entry["saved"] or entry["save_error"]):
            return entry
        assert time.time() < deadline, entry
        time.sleep(0.05)


def rows(db_path, sql: str, *args) -> list:
    """The rows of `sql`, whose `?` take `args` in turn, as mappings (SQLite or PostgreSQL)."""
    head, *rest = sql.split("?")
    named = head + "".join(f":p{i}{part}" for i, part in enumerate(rest))
    engine = create_database_engine(db_path)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(named), {f"p{i}": a for i, a in enumerate(args)})
                        .mappings().all())
    finally:
        engine.dispose()


def test_a_finished_experiment_is_saved_with_its_two_runs_and_survives_a_restart(db_path):
    with open_client(db_path) as client:
        entry = run_and_wait(client)
        assert entry["status"] == "done" and entry["saved"], entry["save_error"]
        exp_id, record = entry["id"], entry["record"]
        assert record["fork"] is not None, record["verdict"]  # two different models
        assert lab_for(client.app).get(exp_id) is None  # the database holds it now
        runs = entry["runs"]
        assert runs == {"a": f"{exp_id}-a", "b": f"{exp_id}-b"}

        # The experiment's row refers to its two runs; the runs hold the sides' tokens.
        (row,) = rows(db_path, "SELECT * FROM divergence_experiments WHERE id = ?", exp_id)
        assert (row["run_a_id"], row["run_b_id"]) == (runs["a"], runs["b"])
        assert row["status"] == "done" and row["source"] == "web"
        assert row["verdict"] == "forked" and row["verdict_text"] == record["verdict"]
        assert row["fork_token_index"] == record["fork"]["token_index"]
        assert row["prompt_text"] == FORM["prompt"] and row["error"] is None
        for s in ("a", "b"):
            side = record["sides"][s]
            (run,) = rows(db_path, "SELECT * FROM runs WHERE id = ?", runs[s])
            assert run["source"] == "divergence" and run["status"] == "finished"
            assert run["weights"] == side["weights"] and run["output_text"] == side["text"]
            assert run["completion_tokens"] == len(side["token_ids"]) == 6
            tokens = rows(db_path, "SELECT token_id, text FROM run_tokens WHERE run_id = ? "
                                   "ORDER BY idx", runs[s])
            assert [t["token_id"] for t in tokens] == side["token_ids"]
            # Text held back (a partial character) comes only with the finish, as when serving.
            assert side["text"].startswith("".join(t["text"] for t in tokens))
        a_tokens = record["sides"]["a"]["token_ids"]
        assert a_tokens != record["sides"]["b"]["token_ids"]

        # The runs show on /runs and /runs/{id}, and /compare finds the fork.
        listed = client.get("/runs.json").json()["runs"]
        assert {r["id"] for r in listed} >= {runs["a"], runs["b"]}
        run_a = client.get(f"/runs/{runs['a']}.json").json()
        assert [t["token_id"] for t in run_a["tokens"]] == a_tokens
        assert run_a["kernel_policy"] == "gemm" and run_a["params"]["alongside"] == [20]
        # Parameters read as written: the label's "·" is not shown as a \u escape.
        run_page = BeautifulSoup(client.get(f"/runs/{runs['a']}").text, "html.parser")
        label_cell = next(tr.find("code") for tr in run_page.find_all("tr")
                          if tr.find("th") and tr.find("th").get_text() == "label")
        assert "·" in run_a["params"]["label"]
        assert label_cell.get_text() == f'"{run_a["params"]["label"]}"'
        compared = client.get(f"/compare.json?a={runs['a']}&b={runs['b']}").json()
        assert compared["first_difference"] == record["fork"]["token_index"]
        assert "kernel_policy" in compared["params_differing"]

        page = BeautifulSoup(client.get(f"/divergence?id={exp_id}").text, "html.parser")
        links = page.find("p", class_="div-runs")
        assert links.find("a", attrs={"data-side": "a"})["href"] == f"/runs/{runs['a']}"
        assert links.find("a", attrs={"data-side": "b"})["href"] == f"/runs/{runs['b']}"
        assert links.find("a", class_="compare")["href"] == \
            f"/compare?a={runs['a']}&b={runs['b']}"
        assert page.find(class_="storage")["data-persisted"] == "true"

    # A new app over the same file: no experiment in memory, all of it from the database.
    with open_client(db_path) as client:
        listing = client.get("/divergence.json").json()
        assert listing["persisted"] is True and listing["saved_total"] == 1
        (summary,) = listing["experiments"]
        assert summary["id"] == exp_id and summary["verdict"] == record["verdict"]
        assert summary["runs"] == runs and summary["a"] == record["sides"]["a"]["label"]
        again = client.get(f"/divergence.json?id={exp_id}").json()
        assert again["experiment"]["record"]["sides"]["b"]["token_ids"] == \
            record["sides"]["b"]["token_ids"]
        assert again["view"]["fork_token"] == record["fork"]["token_index"]
        page = BeautifulSoup(client.get(f"/divergence?id={exp_id}").text, "html.parser")
        assert page.find(class_="verdict").get_text(strip=True) == record["verdict"]
        assert page.find("tr", attrs={"data-id": exp_id}) is not None
        # The form is filled with the saved experiment's settings.
        form = page.find("form", class_="div-form")
        assert form.find("input", attrs={"name": "a_alongside"})["value"] == "20"


def test_the_sides_steps_are_recorded_like_a_served_runs(db_path, monkeypatch):
    """Each side's engine steps go to steps/step_entries under an engine session of its own:
    /runs/{id} shows the target's steps with the companions as (unlinked) batch-mates."""
    ran = {}  # weights -> steps that side's engine ran (f32 on A, bf16 on B: one engine each)
    close = app.lab.divergence.DivergenceRunner.close

    def count_then_close(runner):
        ran.update({key[0]: e.step_count for key, e in runner.engines.items()})
        close(runner)

    monkeypatch.setattr(app.lab.divergence.DivergenceRunner, "close", count_then_close)
    form = {**FORM, "a_alongside": "20,12", "a_others_tokens": "9"}  # they outlive the target
    with open_client(db_path) as client:
        entry = run_and_wait(client, form)
        assert entry["status"] == "done" and entry["saved"], entry["save_error"]
        exp_id, record, runs = entry["id"], entry["record"], entry["runs"]
        sessions = set()
        for s, policy in (("a", "gemm"), ("b", "gemv")):
            side = record["sides"][s]
            (run,) = rows(db_path, "SELECT * FROM runs WHERE id = ?", runs[s])
            (session,) = rows(db_path, "SELECT * FROM engine_sessions WHERE id = ?",
                              run["session_id"])
            sessions.add(session["id"])
            assert (session["model"], session["weights"], session["kernel_policy"]) == \
                (run["model"], run["weights"], policy)
            config = json.loads(session["config_json"])
            assert config["divergence"] == {"experiment": exp_id, "side": s,
                                            "config": side["config"]}
            assert config["kernel_policy"] == policy and not config["enable_prefix_caching"]

            # Every step the side's engine ran, as the record has it.
            steps = rows(db_path, "SELECT * FROM steps WHERE session_id = ? ORDER BY step",
                         session["id"])
            engine_steps = side["engine_steps"]
            assert len(steps) == len(engine_steps) == ran[side["config"]["weights"]]
            if s == "a":  # the others ran on after the target's last step
                assert len(engine_steps) > len(side["steps"])
            else:
                assert len(engine_steps) == len(side["steps"])
            for row, full in zip(steps, engine_steps, strict=True):
                assert (row["step"], row["kernel_path"], row["total_rows"], row["prefill_rows"],
                        row["decode_rows"], row["kv_blocks_used"]) == \
                    (full["step"], full["kernel_path"], full["total_rows"], full["prefill_rows"],
                     full["decode_rows"], full["kv_blocks_used"])
            others = [f"{runs[s]}-alongside-{i}" for i in range(2 if s == "a" else 0)]
            entries = rows(db_path, "SELECT step, run_id FROM step_entries WHERE session_id = ?",
                           session["id"])
            assert {e["run_id"] for e in entries} == {runs[s], *others}
            assert {e["step"] for e in entries if e["run_id"] == runs[s]} == \
                {t["step"] for t in side["steps"]}

            # /runs/{id}: the target's steps, with the record's path and rows per step.
            shown = client.get(f"/runs/{runs[s]}.json").json()
            assert [(x["step"], x["kernel_path"], x["total_rows"]) for x in shown["steps"]] == \
                [(t["step"], t["path"], t["rows"]) for t in side["steps"]]
            assert all(x["session_id"] == session["id"] for x in shown["steps"])
            # Its tokens point at steps it sampled in.
            sampled = {x["step"] for x in shown["steps"] if x["entry"]["sampled"]}
            assert {t["step"] for t in shown["tokens"]} <= sampled
            mates = {m["run_id"]: m["recorded"] for x in shown["steps"] for m in x["batch_mates"]}
            assert mates == dict.fromkeys(others, False)
            page = BeautifulSoup(client.get(f"/runs/{runs[s]}").text, "html.parser")
            table = page.find("table", class_="steps")
            assert len(table.find("tbody").find_all("tr")) == len(side["steps"])
            cells = table.find_all("td", attrs={"data-col": "batch_mates"})
            assert [c.find("a") for c in cells] == [None] * len(cells)  # not runs: no links
            assert {code.get_text() for c in cells for code in c.find_all("code")} == set(others)
        assert len(sessions) == 2
        # The first step of A is the mixed one; B ran its target alone, row by row.
        first_a = client.get(f"/runs/{runs['a']}.json").json()["steps"][0]
        assert first_a["prefill_rows"] == record["prompt_tokens"] + 20 + 12
        assert len(first_a["batch_mates"]) == 2
        assert all(x["batch_mates"] == [] and x["kernel_path"] == "gemv"
                   for x in client.get(f"/runs/{runs['b']}.json").json()["steps"])
        compared = client.get(f"/compare.json?a={runs['a']}&b={runs['b']}").json()
        assert compared["first_difference"] == record["fork"]["token_index"]
        assert client.get(f"/compare?a={runs['a']}&b={runs['b']}").status_code == 200


def test_a_failed_experiment_is_saved_with_its_error(db_path):
    with open_client(db_path, loader=broken_loader) as client:
        entry = run_and_wait(client)
        assert entry["status"] == "error" and entry["saved"]
        assert "no f32 weights on this shelf" in entry["error"]
        assert entry["runs"] is None and entry["record"] is None
    (row,) = rows(db_path, "SELECT * FROM divergence_experiments")
    assert row["status"] == "error" and "no f32 weights on this shelf" in row["error"]
    assert row["run_a_id"] is None and row["record_json"] is None
    assert rows(db_path, "SELECT id FROM runs") == []
    with open_client(db_path) as client:
        page = BeautifulSoup(client.get(f"/divergence?id={row['id']}").text, "html.parser")
        assert "no f32 weights on this shelf" in page.find(class_="error-message").get_text()


def test_a_failed_write_keeps_the_experiment_in_memory(db_path, monkeypatch):
    def refuse(db, entry, origin="web"):
        raise DatabaseError("cannot record the divergence experiment: disk full")

    monkeypatch.setattr(divergence_store, "save_experiment", refuse)
    with open_client(db_path) as client:
        entry = run_and_wait(client)
        assert entry["status"] == "done" and not entry["saved"]
        assert "disk full" in entry["save_error"]
        page = BeautifulSoup(client.get(f"/divergence?id={entry['id']}").text, "html.parser")
        assert "disk full" in page.find(class_="save-error").get_text()
    assert rows(db_path, "SELECT id FROM divergence_experiments") == []


@pytest.mark.parametrize("persisted", [True, False])
def test_an_unknown_id_is_a_404(db_path, persisted):
    with open_client(db_path if persisted else None) as client:
        for bad in ("nope", "div-1-abcdef", "' OR 1=1 --", "x" * 5000, "%00"):
            r = client.get("/divergence", params={"id": bad})
            assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
            r = client.get("/divergence.json", params={"id": bad})
            assert r.status_code == 404
            error = r.json()["error"]
            assert error["param"] == "id" and error["code"] == "not_found"
            assert ("no database" in error["message"]) is not persisted
        listing = client.get("/divergence.json").json()
        assert listing["persisted"] is persisted
        page = BeautifulSoup(client.get("/divergence").text, "html.parser")
        assert page.find(class_="storage")["data-persisted"] == str(persisted).lower()


def test_without_a_database_finished_experiments_stay_in_memory():
    with open_client(None) as client:
        r = client.post("/divergence", data=FORM, follow_redirects=False)
        exp_id = r.headers["location"].split("id=")[1]
        deadline = time.time() + 120
        while (entry := client.get(f"/divergence.json?id={exp_id}").json()["experiment"]
               )["status"] not in ("done", "error"):
            assert time.time() < deadline
            time.sleep(0.05)
        assert entry["status"] == "done" and not entry["saved"] and entry["runs"] is None
        assert lab_for(client.app).get(exp_id) is not None


def test_cli_db_writes_an_experiment_the_page_reads(db_path, monkeypatch, capsys):
    # The tiny model instead of the embedded one; the rest of the command runs as it is.
    monkeypatch.setattr(app.lab.divergence, "run_experiment",
                        functools.partial(app.lab.divergence.run_experiment, loader=q4_loader))
    parser = build_parser()
    # MLX's quantized_matmul on both sides, which computes each row alike on every path.
    args = parser.parse_args(["diverge", "Hello there",
                              "--a", "weights=q4,policy=gemm,row_kernels=mlx",
                              "--b", "weights=q4,policy=gemv,row_kernels=mlx", "--max-tokens", "5",
                              "--db", str(db_path)])
    assert args.func(args) == 0
    err = capsys.readouterr().err
    (row,) = rows(db_path, "SELECT * FROM divergence_experiments")
    assert f"saved as experiment {row['id']}" in err
    assert row["source"] == "cli" and row["verdict"] == "identical"  # 4-bit on a CPU
    with open_client(db_path) as client:
        listing = client.get("/divergence.json").json()["experiments"]
        assert [e["id"] for e in listing] == [row["id"]] and listing[0]["source"] == "cli"
        entry = client.get(f"/divergence.json?id={row['id']}").json()["experiment"]
        assert entry["record"]["bit_identical"] and entry["params"]["prompt"] == "Hello there"
        run_b = client.get(f"/runs/{entry['runs']['b']}.json").json()
        assert run_b["endpoint"] == "batchscope diverge" and run_b["kernel_policy"] == "gemv"
        assert [t["token_id"] for t in run_b["tokens"]] == \
            entry["record"]["sides"]["b"]["token_ids"]
        assert len(run_b["tokens"]) == 5
        # Its steps too: alone, 4-bit, row by row.
        assert len(run_b["steps"]) == 5
        assert all(s["kernel_path"] == "gemv" and s["batch_mates"] == [] for s in run_b["steps"])


def test_cli_db_errors(tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["diverge", "hi", "--db", str(tmp_path / "missing" / "x.db")])
    assert args.func(args) == 2  # before any model is loaded
    assert "does not exist" in capsys.readouterr().err
    args = parser.parse_args(["diverge", "--search", "--db", str(tmp_path / "x.db")])
    with pytest.raises(ValueError, match="--db saves one experiment"):
        args.func(args)
