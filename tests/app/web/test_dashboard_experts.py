"""Expert load end to end on a tiny mixture-of-experts model: the step records, the dashboard
page's expert strip, /dashboard.json, the SSE frames, /steps.json and the runs database.
(A dense model shows no expert section: tests/app/web/test_dashboard.py.)"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from bs4 import BeautifulSoup
from live_server import runs_recorder, serving
from mlx_lm.models import qwen3_moe

from app.db import open_database
from app.db.runs import get_run
from app.settings import Settings
from app.web.app import create_app
from app.web.pages.dashboard import EXPERT_STEPS, expert_load
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_loader import LoadedModel
from engine.testing import ByteTokenizer, tiny_config

TIMEOUT = 30.0
NUM_EXPERTS = 8
MOE_LAYERS = [0, 2]  # layer 1 is dense (mlp_only_layers)
PROMPTS = ["the quick brown fox", "jumps over the lazy dog", "an expert for every token"]


def tiny_moe() -> LoadedModel:
    """A 3-layer qwen3_moe, 4-bit, over the byte tokenizer: layers 0 and 2 route each token
    to 2 of 8 experts."""
    config = tiny_config(model_type="qwen3_moe", num_hidden_layers=3, num_experts=NUM_EXPERTS,
                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                         moe_intermediate_size=64, norm_topk_prob=True)
    mx.random.seed(0)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    model.update(nn.utils.tree_map(lambda p: p * 4.0 if p.ndim >= 2 else p, model.parameters()))
    nn.quantize(model, group_size=32, bits=4)
    config["quantization"] = {"group_size": 32, "bits": 4}
    mx.eval(model.parameters())
    return LoadedModel(model=model, tokenizer=ByteTokenizer(), config=config, name="tiny-moe",
                       weights="q4", source="tiny")


@dataclass
class Live:
    app: Any
    engine: Engine
    http: httpx.Client
    db_path: Path


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    db_path = tmp_path_factory.mktemp("db") / "runs.db"
    settings = Settings(engine=EngineConfig(num_kv_blocks=64, block_size=4))
    app = create_app(settings, engine_factory=lambda config: Engine(config, loader=tiny_moe),
                     recorder_factory=runs_recorder(db_path))
    with serving(app, TIMEOUT) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        yield Live(app, app.state.engine, http, db_path)


def wait_until(condition, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def ran(live) -> list[dict]:
    """The prompts as concurrent completions (so they share steps), then the engine idle."""
    results: list[dict] = [{}] * len(PROMPTS)

    def one(i: int) -> None:
        response = live.http.post("/v1/completions", json={
            "model": "tiny-moe", "prompt": PROMPTS[i], "max_tokens": 12, "ignore_eos": True})
        assert response.status_code == 200, response.text
        results[i] = response.json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    engine = live.engine
    wait_until(lambda: not engine.scheduler.has_work()
               and engine.steps.recent(1)[-1].step == engine.step_count)
    return results


def expected_load(engine: Engine) -> dict[int, list[int]]:
    """Per MoE layer, the rows per expert of the recent steps, summed from the records."""
    records = [r for r in engine.steps.recent(EXPERT_STEPS) if r.expert_rows]
    return {i: np.sum([r.expert_rows[str(i)] for r in records], axis=0).tolist()
            for i in MOE_LAYERS}


def test_step_records_count_every_rows_choice(live, ran):
    records = live.engine.steps.recent()
    assert records and all(sorted(r.expert_rows) == ["0", "2"] for r in records)
    for r in records:
        for rows in r.expert_rows.values():
            assert len(rows) == NUM_EXPERTS and sum(rows) == 2 * r.total_rows


def test_page_shows_one_expert_strip_per_moe_layer(live, ran):
    soup = BeautifulSoup(live.http.get("/dashboard").text, "html.parser")
    section = soup.select_one("section#experts")
    assert section is not None
    # Next to the kernel strip: the section right after it.
    assert section.find_previous_sibling("section")["id"] == "strip"
    expected = expected_load(live.engine)
    lines = section.select(".expert-layer")
    assert [int(line["data-layer"]) for line in lines] == MOE_LAYERS
    for line in lines:
        layer = int(line["data-layer"])
        cells = line.select("i.xc")
        assert [c["title"] for c in cells] == [f"layer {layer}, expert {e}: {n} rows"
                                               for e, n in enumerate(expected[layer])]
        busiest = max(expected[layer])
        shades = [float(c["style"].split("--f:")[1]) for c in cells]
        assert shades == [round(n / busiest, 3) for n in expected[layer]]
        mean = sum(expected[layer]) / NUM_EXPERTS
        assert line.select_one(".expert-spread").get_text() == f"{busiest / mean:.1f}×"
    records = [r for r in live.engine.steps.recent(EXPERT_STEPS) if r.expert_rows]
    caption = section.select_one("#experts-caption").get_text()
    assert f"last {len(records)} steps ({records[0].step}–{records[-1].step})" in caption


def test_dashboard_json_and_stream_carry_the_expert_load(live, ran):
    engine = live.engine
    expected = expected_load(engine)
    state = live.http.get("/dashboard.json").json()["state"]
    experts = state["experts"]
    assert experts == expert_load(engine)
    assert experts["num_experts"] == NUM_EXPERTS
    assert {line["layer"]: line["rows"] for line in experts["layers"]} == expected
    with live.http.stream("GET", "/dashboard/stream") as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                frame = json.loads(line[len("data:"):])
                break
    assert frame["state"]["experts"] == experts
    steps = live.http.get("/steps.json", params={"since": 0}).json()["steps"]
    assert [s["expert_rows"] for s in steps] == [r.expert_rows for r in engine.steps.recent()]


def test_runs_database_keeps_each_steps_expert_rows(live, ran):
    records = {r.step: r.expert_rows for r in live.engine.steps.recent()}
    run_id = ran[0]["id"]
    with open_database(live.db_path) as db:
        def recorded() -> dict | None:
            run = get_run(db, run_id)
            return run if run and run["status"] == "finished" and run["steps"] else None

        wait_until(lambda: recorded() is not None)
        steps = recorded()["steps"]
    assert steps and all(s["expert_rows"] == records[s["step"]] for s in steps)
