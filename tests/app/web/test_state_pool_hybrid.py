"""The state pool's seams on a real tiny qwen3_5 (Gated DeltaNet layers beside attention): the
step records, /dashboard.json and /metrics read the engine's pool, and a divergence experiment
compares the traced states. (Fabricated pools and traces: test_dashboard_state_pool.py,
tests/app/lab/test_divergence.py.)"""

from __future__ import annotations

import importlib

import pytest
from starlette.testclient import TestClient

from app.lab.divergence import SideConfig, run_experiment
from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.model_loader import load_model
from engine.telemetry import STATE_POOL_FIELDS
from engine.testing import FAMILY_CONFIGS, make_family_folder

PROMPT = "word1 is number 1. word2 is number 2. word3 is number 3."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    module_name, config = FAMILY_CONFIGS["qwen3_5"]
    return make_family_folder(tmp_path_factory.mktemp("qwen3_5") / "f32",
                              importlib.import_module(f"mlx_lm.models.{module_name}"), config)


def test_the_dashboard_and_metrics_read_the_engines_pool(folder):
    app = create_app(Settings(engine=EngineConfig(model=str(folder), weights="f32",
                                                  num_kv_blocks=64, block_size=16)))
    with TestClient(app) as client:
        response = client.post("/v1/completions", json={"model": "f32", "prompt": PROMPT,
                                                        "max_tokens": 3})
        assert response.status_code == 200, response.text
        engine = app.state.engine
        usage = engine.state_slots.usage()
        records = engine.steps.recent()
        # As the step ran: the last step's request still held its slot, given back since.
        assert {name: getattr(records[-1], name) for name in STATE_POOL_FIELDS} == \
            {**usage, "state_slots_used": 1}
        assert usage["state_slots_used"] == 0
        assert max(r.state_slots_used for r in records) == 1  # the request held one slot
        pool = client.get("/dashboard.json").json()["state"]["state_pool"]
        assert pool == {name.removeprefix("state_"): usage[name] for name in STATE_POOL_FIELDS}
        assert pool["slots_total"] > 0 and pool["slot_bytes"] > 0 and pool["slots_used"] == 0
        metrics = {line.split(" ")[0]: float(line.split(" ")[1])
                   for line in client.get("/metrics").text.splitlines()
                   if line.startswith("batchscope:state_")}
    assert metrics["batchscope:state_slots_total"] == usage["state_slots_total"]
    assert metrics["batchscope:state_checkpoint_capacity"] == \
        usage["state_checkpoint_capacity"]
    assert metrics["batchscope:state_slots_used"] == 0


def test_a_divergence_experiment_compares_the_states(folder):
    def loader(weights: str):
        return load_model(str(folder), weights=weights)

    same = SideConfig(weights="f32", kernel_policy="gemm")
    record = run_experiment(PROMPT, same, same, max_tokens=4, loader=loader)
    prompt_tokens = record.prompt_tokens
    # The prompt in one step, then one state per output token fed back (the last one's
    # token is never fed back).
    assert [p.tokens for p in record.state.per_step] == \
        [prompt_tokens + i for i in range(4)]
    assert record.bit_identical and record.state.max_abs_delta == 0
    assert len(record.state.max_abs_delta_per_layer) == 6  # qwen3_5's recurrent layers
