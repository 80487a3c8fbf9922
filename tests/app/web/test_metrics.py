"""/metrics: Prometheus text that counts what the tiny engine really did."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families
from speculation import SPEC, ScriptedDrafts, verify_totals
from starlette.testclient import TestClient

from app.runs import RunRequest, RunResult
from app.settings import Settings
from app.web.app import create_app
from app.web.metrics import EngineMetrics
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import FinishEvent
from engine.sampling import SamplingParams, StructuredOutput
from engine.telemetry import StepEntry, StepRecord
from engine.testing import tiny_model

PROMPTS = ["the quick brown fox", "jumps over the lazy dog", "a shared prefix, then one",
           "a shared prefix, then two", "pack my box with five dozen liquor jugs",
           "sphinx of black quartz, judge my vow"]


def make_app(proposer=None, **engine) -> TestClient:
    engine.setdefault("num_kv_blocks", 128)
    settings = Settings(engine=EngineConfig(**engine))
    app = create_app(settings, engine_factory=lambda config: Engine(config, loader=tiny_model,
                                                                    proposer=proposer))
    return TestClient(app)


def scrape(client: TestClient) -> dict[str, dict]:
    """{family name: {(sample name, sorted labels): value}} of /metrics."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(response.text):
        out[family.name] = {(s.name, tuple(sorted(s.labels.items()))): s.value
                            for s in family.samples}
    return out


def value(metrics: dict, family: str, sample: str | None = None, **labels: str) -> float:
    return metrics[family][(sample or family, tuple(sorted(labels.items())))]


def run_all(client: TestClient, requests: list[RunRequest],
            cancel_after_first_token: bool = False) -> list[RunResult]:
    """Start the requests together through RunService (on the app's loop); wait for them."""
    runs = client.app.state.runs

    async def go() -> list[RunResult]:
        started = [runs.start(r) for r in requests]
        if not cancel_after_first_token:
            return list(await asyncio.gather(*(run.collect() for run in started)))
        results = []
        for run in started:
            async for _ in run.events():
                run.cancel()  # after the first event (a token); the finish still comes
            results.append(RunResult([], run.finish, None))
        return results

    results = client.portal.call(go)
    settle(client.app.state.engine)
    return results


def settle(engine: Engine, timeout: float = 10.0) -> None:
    """Wait for the last step's record: a request finishes inside a step, before its record."""
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_work() or engine.steps.recent(1)[-1].step != engine.step_count:
        assert time.monotonic() < deadline, "the engine did not settle"
        time.sleep(0.005)


def request(prompt: str, client: TestClient, **params) -> RunRequest:
    params.setdefault("ignore_eos", True)  # every sampled token is then an output token
    return RunRequest(client.app.state.runs.encode(prompt), SamplingParams(**params),
                      "/test")


@pytest.fixture(scope="module")
def client():
    with make_app(block_size=4) as c:
        scrape(c)  # installs the collector before any request (until the lifespan does)
        yield c


@pytest.fixture(scope="module")
def finishes(client) -> list[FinishEvent]:
    done = run_all(client, [request(p, client, max_tokens=12) for p in PROMPTS])
    # The same prompt again, stopped by a character of its own greedy output: reason "stop".
    # (The random model's text is mostly invalid UTF-8: pick a plain ASCII character.)
    stop = next(ch for ch in done[0].finish.text[1:] if ch.isascii() and ch.isprintable())
    stopped = run_all(client, [request(PROMPTS[0], client, max_tokens=12, stop=[stop])])
    cancelled = run_all(client, [request("cancel me", client, max_tokens=200)],
                        cancel_after_first_token=True)
    # One through the OpenAI route too, so the path people use is counted as well.
    response = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "via api",
                                                    "max_tokens": 5, "ignore_eos": True})
    assert response.status_code == 200
    results = [r.finish for r in done + stopped + cancelled]
    assert [f.reason for f in results] == ["length"] * 6 + ["stop", "cancelled"]
    return results


def test_counters_equal_what_the_engine_did(client, finishes):
    engine = client.app.state.engine
    steps = engine.steps.recent()
    assert steps[0].step == 1  # the ring buffer still holds every step: exact comparisons
    m = scrape(client)
    sampled = [e for r in steps for e in r.entries if e.sampled]
    api_tokens = 5
    assert value(m, "batchscope:generation_tokens", "batchscope:generation_tokens_total") \
        == len(sampled) == sum(f.completion_tokens for f in finishes) + api_tokens
    api_prompt = len(engine.encode("via api"))
    assert value(m, "batchscope:prompt_tokens", "batchscope:prompt_tokens_total") \
        == sum(f.prompt_tokens for f in finishes) + api_prompt
    reasons = Counter(f.reason for f in finishes) + Counter({"length": 1})
    for reason in ("stop", "length", "cancelled", "error"):
        assert value(m, "batchscope:request_success", "batchscope:request_success_total",
                     finished_reason=reason) == reasons[reason], reason
    paths = Counter(r.kernel_path for r in steps)
    for path in ("native", "gemm", "gemv", "tiled"):  # every path exported, 0 until taken
        assert value(m, "batchscope:steps", "batchscope:steps_total",
                     kernel_path=path) == paths[path]
    bm = engine.block_manager
    assert bm.stats.hits > 0  # the shared prefixes and the repeated prompt hit the cache
    assert value(m, "batchscope:prefix_cache_queries",
                 "batchscope:prefix_cache_queries_total") == bm.stats.queries
    assert value(m, "batchscope:prefix_cache_hits",
                 "batchscope:prefix_cache_hits_total") == bm.stats.hits
    assert value(m, "batchscope:num_preemptions", "batchscope:num_preemptions_total") == 0


def test_histograms_have_counts(client, finishes):
    engine = client.app.state.engine
    steps = engine.steps.recent()
    m = scrape(client)

    def count(name: str) -> float:
        return value(m, name, name + "_count")

    served = sum(1 for f in finishes if f.reason in ("stop", "length")) + 1  # + the API one
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_time_per_output_token_seconds"):
        assert count("batchscope:" + name) == served, name
    # Every sampled token after a request's first is one inter-token gap.
    sampled = sum(1 for r in steps for e in r.entries if e.sampled)
    requests_with_tokens = len({e.request_id for r in steps for e in r.entries if e.sampled})
    assert count("batchscope:inter_token_latency_seconds") == sampled - requests_with_tokens
    assert value(m, "batchscope:inter_token_latency_seconds",
                 "batchscope:inter_token_latency_seconds_sum") > 0
    rows = "batchscope:iteration_tokens_total"
    assert count(rows) == len(steps) == engine.step_count
    assert value(m, rows, rows + "_sum") == sum(r.total_rows for r in steps)
    # Cumulative buckets end with everything at +Inf.
    assert value(m, rows, rows + "_bucket", le="+Inf") == len(steps)
    assert value(m, rows, rows + "_bucket", le="1.0") == sum(1 for r in steps
                                                               if r.total_rows <= 1)


def test_gauges_read_the_live_engine(client, finishes):
    m = scrape(client)
    assert value(m, "batchscope:num_requests_running") == 0
    assert value(m, "batchscope:num_requests_waiting") == 0
    assert value(m, "batchscope:kv_cache_usage_perc") == 0  # cached prefixes are not "used"
    assert client.app.state.engine.block_manager.num_cached_blocks > 0


def test_preemptions_with_a_tiny_pool(client, finishes):
    # 24 blocks of 4 tokens cannot hold six requests growing to ~60 tokens: preemption.
    with make_app(num_kv_blocks=24, block_size=4, enable_prefix_caching=False) as small:
        scrape(small)
        results = run_all(small, [request(p, small, max_tokens=40) for p in PROMPTS])
        steps = small.app.state.engine.steps.recent()
        m = scrape(small)
    preempted = sum(r.finish.preemptions for r in results)
    assert preempted > 0
    assert value(m, "batchscope:num_preemptions",
                 "batchscope:num_preemptions_total") == preempted \
        == sum(len(r.preempted) for r in steps)
    # Recomputed prefills do not count a prompt twice; every output token once.
    assert value(m, "batchscope:prompt_tokens", "batchscope:prompt_tokens_total") \
        == sum(r.finish.prompt_tokens for r in results)
    assert value(m, "batchscope:generation_tokens", "batchscope:generation_tokens_total") \
        == sum(r.finish.completion_tokens for r in results) == 6 * 40
    # Each app has its own registry: the other app's counters did not move.
    assert value(scrape(client), "batchscope:num_preemptions",
                 "batchscope:num_preemptions_total") == 0


def test_a_model_without_recurrent_layers_exports_the_state_pool_at_zero(client, finishes):
    m = scrape(client)
    for gauge in ("state_slots_used", "state_slots_total", "state_checkpoints",
                  "state_checkpoint_capacity"):
        assert value(m, "batchscope:" + gauge) == 0
    assert value(m, "batchscope:state_checkpoint_hits",
                 "batchscope:state_checkpoint_hits_total") == 0


class FakeEngine:
    """Step records fed by hand; no live scheduler."""

    def __init__(self) -> None:
        self.steps = self
        self.records: list[StepRecord] = []

    def recent(self) -> list[StepRecord]:
        return list(self.records)

    def subscribe(self, callback):
        return lambda: None


def record(step: int, **kw) -> StepRecord:
    entry = StepEntry("r1", "decode", 1, 10 + step, 3, True, emitted=1)
    if step == 2:  # a verify group: 3 drafts, 2 of them kept (3 tokens in the step)
        entry = StepEntry("r1", "verify", 4, 14, 4, True, drafted=3, accepted=2, emitted=3)
    base = dict(step=step, started_at=100.0 + step, wall_time=0.01, model_time=0.005,
                scheduler_time=0.005, entries=[entry], total_rows=1, prefill_rows=0,
                decode_rows=1, kv_blocks_total=8, kv_blocks_used=3, kv_blocks_free=5,
                kv_blocks_cached=0, num_running=1, num_waiting=0)
    return StepRecord(**{**base, **kw})


def test_the_state_pool_is_read_live_and_checkpoint_hits_counted_once():
    """Slots and checkpoints are the engine's state pool at scrape time; checkpoint hits are
    counted from the steps' cumulative totals (once per step, restarting with a new pool)."""

    class Slots:
        usage_now = {"state_slots_total": 4, "state_slots_used": 3, "state_checkpoints": 5,
                     "state_checkpoint_capacity": 16, "state_checkpoint_hits": 7,
                     "state_slot_bytes": 1 << 20}

        def usage(self) -> dict[str, int]:
            return dict(self.usage_now)

    engine = FakeEngine()
    engine.state_slots = Slots()
    engine.records = [record(1, state_checkpoint_hits=2), record(2, state_checkpoint_hits=3)]
    metrics = EngineMetrics(engine)
    metrics.follow()
    metrics.observe_step(engine.records[1])  # live delivery of a backfilled step
    metrics.observe_step(record(3, state_checkpoint_hits=1))  # the pool was rebuilt
    reg = metrics.registry
    assert reg.get_sample_value("batchscope:state_checkpoint_hits_total") == 4
    assert {name: reg.get_sample_value("batchscope:" + name) for name in
            ("state_slots_used", "state_slots_total", "state_checkpoints",
             "state_checkpoint_capacity")} == \
        {"state_slots_used": 3, "state_slots_total": 4, "state_checkpoints": 5,
         "state_checkpoint_capacity": 16}
    engine.state_slots.usage_now = {**Slots.usage_now, "state_slots_used": 0}
    assert reg.get_sample_value("batchscope:state_slots_used") == 0  # read at scrape time


def test_steps_seen_twice_count_once():
    """A step both backfilled from the ring buffer and delivered live is counted once."""
    engine = FakeEngine()
    engine.records = [record(1, prefix_cache_queries=10, prefix_cache_hits=4),
                      record(2, prefix_cache_queries=10, prefix_cache_hits=4)]
    metrics = EngineMetrics(engine)
    metrics.follow()
    metrics.observe_step(engine.records[1])  # live delivery of a backfilled step
    # The pool was rebuilt: cumulative prefix counts restart from zero.
    metrics.observe_step(record(3, kernel_path="gemv", prefix_cache_queries=2,
                                prefix_cache_hits=1))
    reg = metrics.registry
    assert reg.get_sample_value("batchscope:steps_total", {"kernel_path": "gemm"}) == 2
    assert reg.get_sample_value("batchscope:steps_total", {"kernel_path": "gemv"}) == 1
    assert reg.get_sample_value("batchscope:generation_tokens_total") == 5
    assert reg.get_sample_value("batchscope:spec_decode_num_drafts_total") == 1
    assert reg.get_sample_value("batchscope:spec_decode_num_draft_tokens_total") == 3
    assert reg.get_sample_value("batchscope:spec_decode_num_accepted_tokens_total") == 2
    per_pos = "batchscope:spec_decode_num_accepted_tokens_per_pos_total"
    assert [reg.get_sample_value(per_pos, {"position": str(i)}) for i in range(3)] \
        == [1, 1, None]
    assert reg.get_sample_value("batchscope:prompt_tokens_total") == 11  # context at 1st token
    assert reg.get_sample_value("batchscope:inter_token_latency_seconds_count") == 2
    assert reg.get_sample_value("batchscope:inter_token_latency_seconds_sum") \
        == pytest.approx(2.0)
    assert reg.get_sample_value("batchscope:prefix_cache_queries_total") == 12
    assert reg.get_sample_value("batchscope:prefix_cache_hits_total") == 5


def test_constrained_rows_and_mask_time_equal_the_steps(client):
    """Requests held to a grammar: their rows and their matchers' time, as the steps say."""
    before = scrape(client)
    first = client.app.state.engine.step_count
    grammar = StructuredOutput("regex", "[a-d]{4,8}")
    run_all(client, [request(p, client, max_tokens=8, ignore_eos=False, structured=grammar)
                     for p in PROMPTS[:3]])
    steps = [r for r in client.app.state.engine.steps.recent() if r.step > first]
    after = scrape(client)

    def added(family: str) -> float:
        sample = f"batchscope:{family}_total"
        return value(after, "batchscope:" + family, sample) \
            - value(before, "batchscope:" + family, sample)

    rows = sum(r.constrained_rows for r in steps)
    assert rows >= 3 * 4  # every request's tokens, at least 4 each
    assert added("constrained_rows") == rows
    assert added("grammar_mask_seconds") == pytest.approx(sum(r.mask_ms for r in steps) / 1000)
    assert added("grammar_mask_seconds") > 0


# ---- speculative decoding --------------------------------------------------------------------
SPEC_FAMILIES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens")


def spec_values(m: dict) -> dict[str, float]:
    out = {f: value(m, "batchscope:" + f, f"batchscope:{f}_total") for f in SPEC_FAMILIES}
    per_pos = "batchscope:spec_decode_num_accepted_tokens_per_pos"
    for (sample, labels), v in m.get(per_pos, {}).items():
        if sample == per_pos + "_total":
            out["pos" + dict(labels)["position"]] = v
    return out


def test_speculative_counters_equal_the_verify_entries(client):
    """Drafts accepted and rejected (a scripted proposer); the counters match the records."""
    drafts = ScriptedDrafts()
    with make_app(block_size=4, proposer=drafts, **SPEC) as spec:
        scrape(spec)
        prompts = PROMPTS[:4]
        # References without speculation (the per-request opt-out), then the drafted runs.
        plain = run_all(spec, [request(p, spec, max_tokens=16, speculative=False)
                               for p in prompts])
        for p, result in zip(prompts, plain, strict=True):
            drafts.learn(spec.app.state.runs.encode(p), result.finish.token_ids)
        done = run_all(spec, [request(p, spec, max_tokens=16) for p in prompts])
        steps = spec.app.state.engine.steps.recent()
        m = scrape(spec)
    assert steps[0].step == 1
    totals = verify_totals(steps)
    assert totals["accepted"] > 0 and totals["rejected"] > 0  # both outcomes happened
    assert [r.finish.token_ids for r in done] == [r.finish.token_ids for r in plain]
    got = spec_values(m)
    assert got["spec_decode_num_drafts"] == totals["groups"] > 0
    assert got["spec_decode_num_draft_tokens"] == totals["drafted"] \
        == sum(r.draft_tokens for r in steps)
    assert got["spec_decode_num_accepted_tokens"] == totals["accepted"] \
        == sum(r.accepted_tokens for r in steps)
    # Every position up to k is exported, at zero until a group keeps that many drafts.
    assert {k for k in got if k.startswith("pos")} == {f"pos{i}" for i in range(4)}
    for i in range(4):
        assert got[f"pos{i}"] == totals.get(f"pos{i}", 0), i
    assert got["pos0"] >= got["pos1"] >= got["pos2"] >= got["pos3"]
    assert sum(got[f"pos{i}"] for i in range(4)) == totals["accepted"]
    # A verify step emits accepted + 1 tokens: generation tokens still equal the outputs.
    assert value(m, "batchscope:generation_tokens", "batchscope:generation_tokens_total") \
        == sum(r.finish.completion_tokens for r in plain + done) == 8 * 16
    # The engine without speculation exports the counters at zero and no positions.
    other = scrape(client)
    assert all(v == 0 for v in spec_values(other).values())
    assert not any(k.startswith("pos") for k in spec_values(other))
