"""The Engine over tensor-parallel ranks (engine/distributed/runner.py): refusals before any
rank starts, and (slow) two ranks on loopback through tests/distributed_engine.py, each run
under `timeout` in its own process on fresh free ports, so a hung ring cannot hang the suite."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from distributed_engine import FEATURES, config, feature, greedy

import engine.distributed.runner as sharded
from engine.config import EngineConfig
from engine.distributed.launch import DistributedError
from engine.engine import Engine
from engine.model_loader import load_model
from engine.models import UnsupportedModelError
from engine.testing import FAMILY_CONFIGS, make_family_folder

SCRIPT = Path(__file__).parents[1] / "distributed_engine.py"
# hidden 128, head_dim 32: 4 heads and 2 kv heads, one kv head per rank over 2
WIDER = {"hidden_size": 128, "head_dim": 32, "intermediate_size": 256}


def _folder(tmp_path: Path, name: str, scale: float = 3.0, **overrides) -> Path:
    module_name, cfg = FAMILY_CONFIGS[name]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    return make_family_folder(tmp_path / name, module, {**cfg, **overrides}, scale=scale)


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting a rank fails the test: the refusals come before any."""
    def start_ranks(*args, **kwargs):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(sharded, "start_ranks", start_ranks)


@pytest.mark.parametrize(("name", "size", "why"), [
    ("gemma3_text", 2,
     "gemma3: tensor parallelism supports llama, qwen2, qwen3, qwen3_moe, mixtral, gpt_oss "
     "only"),
    ("llama", 3, "4 attention heads do not split over 3 ranks"),
])
def test_unshardable_refused_by_name_before_ranks_start(tmp_path, no_ranks, name, size, why):
    engine = Engine(config(str(_folder(tmp_path, name)), size))
    with pytest.raises(UnsupportedModelError, match=why):
        engine.start(timeout=120)


def test_own_loader_and_draft_refused(tmp_path, no_ranks):
    folder = str(_folder(tmp_path, "llama", **WIDER))
    engine = Engine(config(folder, 2), loader=lambda: load_model(folder, "f32"))
    with pytest.raises(DistributedError, match="given its own loader cannot be split"):
        engine.start(timeout=120)
    with pytest.raises(ValueError, match="speculative draft is not supported with tensor"):
        EngineConfig(tensor_parallel_size=2, speculative="draft", draft_model="layers:1")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def _run(mode: str, folder: Path, out: Path, limit: int = 240) -> dict:
    done = subprocess.run(["timeout", str(limit), sys.executable, str(SCRIPT), mode,
                           str(folder), str(out)], capture_output=True, text=True,
                          timeout=limit + 30)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(("name", "overrides"), [
    ("llama", WIDER),
    # layers 0 and 2 route to 2 of 8 experts sharded in place, layer 1 is dense
    ("qwen3_moe", {}),
    # both layers route to 2 of 8 experts, each sharded in place (its own shard: mlx-lm has none)
    ("mixtral", WIDER),
    # attention sinks split with the heads, sliding-window layers, biased experts (down's bias
    # divided by the ranks, as mlx-lm's shard() does)
    ("gpt_oss", WIDER),
])
def test_two_ranks_give_one_ranks_greedy_ids(tmp_path, name, overrides):
    folder = _folder(tmp_path, name, **overrides)
    got = _run("greedy", folder, tmp_path / "out.json")
    with Engine(config(str(folder), 1)) as engine:
        want = greedy(engine)
    assert got["alone"] == want["alone"] and got["together"] == want["together"]
    assert got["together"] == got["alone"]
    assert got["ranks"] and all(r == [0, 1] for r in got["ranks"])  # every step, both ranks
    assert got["all_sum_s"] == ["None"]  # untimed unless --time-collectives
    assert len(set(got["ports"])) == 2
    assert got["exits"] == {"1": 0}  # the stop plan ended rank 1
    # Idle, rank 1 blocks on its doorbell, not in a broadcast whose ring sockets busy-poll
    # (a whole core before it had one).
    if sys.platform == "linux":
        assert got["idle_cpu"] < 0.2, got["idle_cpu"]


def assert_same_greedy(got: list, want: list, bound: float = 1e-4) -> None:
    """Token ids equal, logprobs within `bound`; where the ids part, only at a near-tie:
    each side's token is the other's runner-up, their logprobs within 1e-3 of each other."""
    got_ids, got_lp, got_top = got
    want_ids, want_lp, want_top = want
    fork = next((i for i, (a, b) in enumerate(zip(got_ids, want_ids, strict=True)) if a != b),
                len(want_ids))
    assert got_lp[:fork] == pytest.approx(want_lp[:fork], abs=bound)
    if fork < len(want_ids):
        a, b = got_ids[fork], want_ids[fork]
        assert set(got_top[fork]) == set(want_top[fork]) == {a, b}, (fork, got_top, want_top)
        assert abs(want_top[fork][a] - want_top[fork][b]) < 1e-3, (fork, want_top[fork])


@pytest.mark.slow
def test_the_embedded_model_over_three_ranks_through_the_api(tmp_path):
    """The embedded model at f32 (9 heads and 3 kv heads: 3 ranks, one kv head each) gives one
    process's greedy tokens on the reference prompts through /v1/completions, alone and 8 at
    once."""
    from distributed_engine import api_greedy
    from starlette.testclient import TestClient

    from app.settings import Settings
    from app.web.app import create_app
    from engine.testing import REFERENCE_PROMPTS

    got = _run("embedded", Path("3"), tmp_path / "out.json", limit=540)
    assert got["ranks"] == [0, 1, 2]
    settings = Settings(engine=config("embedded", 1, num_kv_blocks=256, max_num_seqs=8))
    with TestClient(create_app(settings)) as client:
        want = api_greedy(client, client.app.state.engine.loaded.name, REFERENCE_PROMPTS)
    for key in ("alone", "together"):
        assert len(got[key]) == len(want[key])
        for g, w in zip(got[key], want[key], strict=True):
            assert_same_greedy(g, w)


@pytest.mark.slow
def test_prefix_cache_preemption_and_ngram_speculation_under_two_ranks(tmp_path):
    """What the scheduler decides on rank 0 alone (a prefix-cache hit, preemption, n-gram
    drafts verified) gives one rank's greedy ids under two."""
    # Small weights: the model repeats itself, so the prompt lookup finds drafts to verify.
    folder = _folder(tmp_path, "llama", scale=0.3, **WIDER)
    got = {name: _run(name, folder, tmp_path / f"{name}.json") for name in FEATURES}
    for name in FEATURES:
        assert got[name]["ids"] == feature(str(folder), 1, name)["ids"], name
        assert got[name]["ranks"] == [0, 1], name
    assert got["prefix"]["prefix_hits"] > 0
    assert got["preemption"]["preempted"] > 0
    assert got["ngram"]["drafted"] > 0
    assert got["prefix"]["ids"][0] == got["prefix"]["ids"][1]


@pytest.mark.slow
def test_killed_rank_fails_requests_refuses_new_ones_and_stops(tmp_path):
    got = _run("kill", _folder(tmp_path, "llama", **WIDER), tmp_path / "out.json")
    named = "rank 1 exited (signal SIGKILL)"
    assert got["tokens_before"] >= 3
    assert len(got["errors"]) == 1 and named in got["errors"][0]
    assert got["finish"][0][0] == "error" and named in got["finish"][0][1]
    assert got["finish"][0][2]  # interrupted: its run is recorded as a dead server's would be
    assert got["running"] is False
    assert got["refused"].startswith("engine is not running") and named in got["refused"]
    assert got["exits"] == {"1": -9}


@pytest.mark.slow
def test_serve_shows_ranks_and_answers_503_once_a_rank_is_lost(tmp_path):
    got = _run("serve", _folder(tmp_path, "llama", **WIDER), tmp_path / "out.json")
    status, body = got["completion"]
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    ranks = got["dashboard_ranks"]
    assert [(r["rank"], r["port"]) for r in ranks] == list(enumerate(got["ports"]))
    assert all(r[k] > 0 for r in ranks for k in ("wall_s", "model_s", "broadcast_s",
                                                 "all_sum_s"))
    assert all(r["all_sum_s"] < r["wall_s"] for r in ranks)  # a part of the step, apart
    assert [(int(r), int(p)) for r, p, _ in got["dashboard_rows"]] == list(
        enumerate(got["ports"]))  # the page's ranks table, with each rank's step time
    assert [float(ms) for *_, ms in got["dashboard_rows"]] == [
        pytest.approx(r["wall_s"] * 1000, abs=0.006) for r in ranks]
    for rank in ("0", "1"):
        assert f'batchscope:rank_step_seconds_count{{rank="{rank}"}} 8.0' in got["metrics"]
        for counter in ("rank_plan_broadcast_seconds_total", "rank_all_sum_seconds_total"):
            assert any(line.startswith(f'batchscope:{counter}{{rank="{rank}"}}')
                       for line in got["metrics"])
    named = "rank 1 exited (signal SIGKILL)"
    status, body = got["failed"]  # the request running when the rank was lost
    assert status == 500 and named in body["error"]["message"]
    status, body = got["refused"]
    assert status == 503 and body["error"]["code"] == "engine_unavailable"
    assert named in body["error"]["message"]
    assert got["exits"] == {"1": -9}


def test_one_rank_dashboard_has_no_ranks(tmp_path):
    from api_helpers import make_app
    from starlette.testclient import TestClient

    with TestClient(make_app()) as client:
        client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "hi",
                                             "max_tokens": 2})
        assert client.get("/dashboard.json").json()["ranks"] == []
        assert "rank=" not in client.get("/metrics").text
