"""The divergence page: a finished record rendered (fork marked, logit table, chart, timeline),
escaped, with its JSON twin; the form runs an experiment in the worker thread; the CLI's text
output of the same record."""

from __future__ import annotations

import dataclasses
import time

import pytest
from bs4 import BeautifulSoup
from starlette.testclient import TestClient

from app.lab.divergence import SideConfig, run_experiment, search
from app.lab.divergence.record import StateComparison, StateStep
from app.lab.divergence.text import clean, format_record, format_search
from app.settings import Settings
from app.web.app import create_app
from app.web.pages.divergence import form_values, lab_for
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model

SCRIPT = "<script>alert(1)</script>"
JSON = {"accept": "application/json"}
PROMPT = f"{SCRIPT} & once"


def two_models(weights: str):
    """A different random model on side B ("bf16" here): a real fork at the first token."""
    return tiny_model(seed=0 if weights == "f32" else 1, quantize=False)


def q4_loader(weights: str):
    return tiny_model(quantize=weights == "q4")


@pytest.fixture(scope="module")
def forked():
    a = SideConfig(weights="f32", kernel_policy="gemm", alongside=(30, 20))
    b = SideConfig(weights="bf16", kernel_policy="gemv")
    record = run_experiment(PROMPT, a, b, max_tokens=10, loader=two_models, top_k=3)
    assert record.fork is not None, record.verdict
    params = {"prompt": PROMPT, "max_tokens": 10, "top_k": 3, "chat": False,
              "a": a.to_dict(), "b": b.to_dict()}
    return record, params


@pytest.fixture(scope="module")
def client():
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=128)),
                     engine_factory=lambda config: Engine(config, loader=tiny_model),
                     divergence_loader=q4_loader)
    # Form posts come from the page itself (app/web/security.py's CSRF rule).
    with TestClient(app, headers={"origin": "http://testserver"}) as c:
        yield c


def soup(response) -> BeautifulSoup:
    assert response.status_code == 200, response.text[:300]
    assert response.headers["content-type"].startswith("text/html")
    return BeautifulSoup(response.text, "html.parser")


def test_a_finished_record_renders_with_the_fork_marked(client, forked):
    record, params = forked
    exp_id = lab_for(client.app).add_record(record, params)
    response = client.get(f"/divergence?id={exp_id}")
    page = soup(response)
    assert SCRIPT not in response.text  # prompt and outputs are escaped
    assert not [s for s in page.find_all("script") if "alert" in s.get_text()]
    section = page.find("section", class_="experiment")
    assert section["data-id"] == exp_id and section["data-status"] == "done"
    assert page.find(class_="verdict").get_text(strip=True) == record.verdict
    assert page.find("pre", class_="prompt").get_text() == PROMPT
    fork = record.fork
    for s, rest in (("a", fork.continuation_a), ("b", fork.continuation_b)):
        pre = page.find("pre", attrs={"data-side": s})
        assert pre.find(class_="shared").get_text() == fork.shared_text
        assert pre.find("mark", class_="fork").get_text() == rest
    rows = page.select("table.fork-table tbody tr")
    assert [int(r["data-token"]) for r in rows] == [t.token_id for t in fork.table]
    first = rows[0].find(attrs={"data-col": "logit_a"}).get_text()
    assert first.startswith(f"{fork.table[0].logit_a:.6f}")
    assert sum("◀" in r.get_text() for r in rows) == 2  # each side's choice
    chain = [li.get_text() for li in page.select("ol.div-chain li")]
    assert chain == record.chain
    svg = page.find("svg", class_="div-chart")
    assert len(svg.find_all("polyline")) == 3
    assert len(svg.find_all("circle")) == record.logits.compared_tokens
    timeline = page.select("table.div-timeline tbody tr")
    assert timeline and int(timeline[0]["data-first"]) == 0
    assert int(timeline[-1]["data-last"]) == record.kv.compared_positions - 1
    assert len(page.select("tr.kv-first")) == 1  # the first KV difference is marked once
    # The form is filled with this experiment's settings, to rerun it with changes.
    form = page.find("form", class_="div-form")
    assert form.find("textarea", attrs={"name": "prompt"}).get_text() == PROMPT
    assert form.find("select", attrs={"name": "b_weights"}).find(selected=True).get_text() == \
        "bf16"
    assert form.find("input", attrs={"name": "a_alongside"})["value"] == "30,20"
    assert page.find("tr", attrs={"data-id": exp_id}) is not None  # in the recent list


def test_json_twin_holds_the_record(client, forked):
    record, params = forked
    exp_id = lab_for(client.app).add_record(record, params)
    body = client.get(f"/divergence.json?id={exp_id}").json()
    assert body["experiment"]["status"] == "done"
    got = body["experiment"]["record"]
    assert got["fork"]["token_index"] == record.fork.token_index
    assert got["fork"]["table"][0]["logit_a"] == pytest.approx(record.fork.table[0].logit_a)
    assert got["kv"]["by_position"] == pytest.approx(record.kv.by_position)
    assert body["view"]["fork_token"] == record.fork.token_index
    same = client.get(f"/divergence?id={exp_id}", headers=JSON).json()
    assert same["experiment"]["id"] == exp_id
    listing = client.get("/divergence.json").json()
    assert listing["experiment"] is None and any(e["id"] == exp_id
                                                 for e in listing["experiments"])


def hybrid(record):
    """The record as a model with recurrent layers would have it: states after 3 steps, the
    second one different in layer 1 (and so the third)."""
    steps = [StateStep(tokens=n, step_a=i + 1, step_b=i + 1, path_a="gemm", path_b="gemv",
                       rows_a=n if i == 0 else 3, rows_b=n if i == 0 else 1,
                       max_abs_delta=d, max_abs_delta_per_layer=[0.0, d])
             for i, (n, d) in enumerate([(20, 0.0), (21, 2.5e-7), (22, 4e-7)])]
    state = StateComparison(compared_steps=3, max_abs_delta=4e-7,
                            max_abs_delta_per_layer=[0.0, 4e-7], first_difference=21,
                            per_step=steps)
    return dataclasses.replace(record, state=state)


def test_a_hybrid_records_state_is_shown_and_said_to_carry_forward(client, forked):
    record, params = forked
    lab = lab_for(client.app)
    dense = soup(client.get(f"/divergence?id={lab.add_record(record, params)}"))
    assert dense.select_one("table.div-state") is None and "Recurrent state" not in dense.text
    exp_id = lab.add_record(hybrid(record), params)
    page = soup(client.get(f"/divergence?id={exp_id}"))
    assert "carried forward forever" in page.find(class_="state-carried").get_text()
    rows = page.select("table.div-state tbody tr")
    assert [int(r["data-tokens"]) for r in rows] == [20, 21, 22]
    assert [r.find(attrs={"data-col": "max_abs_delta"}).get_text() for r in rows] == \
        ["0", "2.5e-07 ← first", "4e-07"]
    assert page.select("tr.state-first") == [rows[1]]
    assert rows[1].find("code").get_text() == "0 2.5e-07"
    got = client.get(f"/divergence.json?id={exp_id}").json()["experiment"]["record"]["state"]
    assert got["first_difference"] == 21
    assert [p["max_abs_delta_per_layer"] for p in got["per_step"]] == \
        [[0.0, 0.0], [0.0, 2.5e-7], [0.0, 4e-7]]


def test_unknown_experiment_is_a_404(client):
    assert client.get("/divergence?id=nope").status_code == 404
    body = client.get("/divergence.json?id=nope").json()
    assert body["error"]["param"] == "id"


def test_the_form_runs_an_experiment_in_the_worker(client):
    form = {"prompt": f"hi {SCRIPT}", "max_tokens": "6", "top_k": "3",
            "a_weights": "q4", "a_policy": "gemm", "a_threshold": "1", "a_alongside": "20, 10",
            "a_join": "2", "a_others_tokens": "4", "a_matmul": "mlx",
            "b_weights": "q4", "b_policy": "gemv", "b_threshold": "1", "b_alongside": "",
            "b_join": "0", "b_others_tokens": "4", "b_matmul": "mlx"}
    r = client.post("/divergence", data=form, follow_redirects=False)
    assert r.status_code == 303
    exp_id = r.headers["location"].split("id=")[1]
    deadline = time.time() + 120
    while True:
        # The page first, then the status: a status still running means the page was rendered
        # while it ran, so it must refresh itself.
        page = soup(client.get(f"/divergence?id={exp_id}"))
        entry = client.get(f"/divergence.json?id={exp_id}").json()["experiment"]
        if entry["status"] in ("done", "error") or time.time() > deadline:
            break
        assert page.find("meta", attrs={"http-equiv": "refresh"}) is not None
        time.sleep(0.05)
    assert entry["status"] == "done", entry["error"]
    record = entry["record"]
    # 4-bit on a CPU, MLX's quantized_matmul on both sides: rows are computed alike on every
    # path, alone or not (the native kernel on gemm steps sums in another order than MLX's).
    assert record["bit_identical"] and record["fork"] is None
    assert record["sides"]["a"]["others_joined"]
    assert record["sides"]["a"]["label"] == ("q4 · gemm · row kernels mlx · alongside 20,10 "
                                             "from token 2")
    page = soup(client.get(f"/divergence?id={exp_id}"))
    assert page.find("meta", attrs={"http-equiv": "refresh"}) is None
    assert page.find(class_="verdict").get_text().startswith("bit-identical")
    assert page.find("table", class_="fork-table") is None
    # The JSON twin of the POST answers 202 with the experiment's URL.
    r = client.post("/divergence.json", data=form)
    assert r.status_code == 202 and r.json()["url"].startswith("/divergence.json?id=")


def test_form_errors(client):
    bad = {"prompt": " ", "max_tokens": "0", "a_policy": "fast", "b_alongside": "12,x",
           "a_threshold": "many", "b_matmul": "blas"}
    r = client.post("/divergence", data=bad)
    assert r.status_code == 400
    page = BeautifulSoup(r.text, "html.parser")
    fields = {p["data-field"] for p in page.select(".form-errors p")}
    assert {"prompt", "max_tokens", "a_policy", "a_threshold", "b_alongside"} <= fields
    assert "row kernels must be one of auto, mlx" in r.text
    r = client.post("/divergence.json", data=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_the_row_kernels_field_reads_older_experiments(client):
    """The form's a_matmul/b_matmul fields are the row_kernels setting, labelled so; an
    experiment saved under the setting's old name (decode_matmul) fills them back."""
    page = soup(client.get("/divergence"))
    field = page.find("select", attrs={"name": "a_matmul"})
    assert field.find_parent("label").get_text().startswith("Row kernels")
    side = SideConfig(weights="q4", row_kernels="mlx").to_dict()
    older = {k: v for k, v in side.items() if k != "row_kernels"} | {"decode_matmul": "mlx"}
    params = {"prompt": "hi", "max_tokens": 4, "top_k": 3, "a": side, "b": older}
    values = form_values(params)
    assert values["a_matmul"] == values["b_matmul"] == "mlx"


def test_cli_text_output(forked):
    record, _ = forked
    text = format_record(record)
    fork = record.fork
    assert f"Verdict: {record.verdict}" in text
    assert f"Logits at the fork (output token {fork.token_index}" in text
    assert f"{fork.table[0].logit_a:.6f}" in text
    assert "Contamination timeline" in text and "prompt" in text
    assert clean("a\x1b[31mred\x07") == "a\\x1b[31mred\\x07"
    s = search(["hello", "hi"], SideConfig(weights="q4", row_kernels="mlx"),
               SideConfig(weights="q4", kernel_policy="gemv", row_kernels="mlx"),
               max_tokens=4, loader=q4_loader)
    out = format_search(s)
    assert "Forked: 0 of 2" in out and "bit-identical: 2" in out
