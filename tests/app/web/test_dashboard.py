"""/dashboard, its JSON twin, /steps.json and the live SSE stream, on a real server (tiny model).

SSE needs a real server: the test client would wait for an endless stream to end. Streams here
stay finite: a test reads frames until it has seen the steps it caused, then disconnects.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from bs4 import BeautifulSoup
from live_server import serving
from speculation import SPEC, ScriptedDrafts

from app.settings import Settings
from app.web.app import create_app
from app.web.feeds import (
    ACCEPTANCE_STEPS,
    RATE_WINDOW_S,
    FeedClient,
    RollingRate,
    StepFeed,
    compact_steps,
    decode_rate,
)
from app.web.pages.dashboard import CHART_STEPS, hue
from app.web.render import fmt_pct
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.telemetry import StepEntry, StepRecord
from engine.testing import tiny_model

TIMEOUT = 30.0
NUM_BLOCKS = 96
PROMPTS = ["the quick brown fox", "jumps over the lazy dog", "a shared prefix, then one",
           "a shared prefix, then two"]


@dataclass
class Live:
    url: str
    app: Any
    engine: Engine
    http: httpx.Client


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    settings = Settings(engine=EngineConfig(num_kv_blocks=NUM_BLOCKS, block_size=4))
    app = create_app(settings, engine_factory=lambda config: Engine(config, loader=tiny_model))
    with serving(app, TIMEOUT) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        yield Live(url, app, app.state.engine, http)


def complete(live: Live, prompts: list[str], max_tokens: int, **extra) -> list[dict]:
    """The prompts as concurrent /v1/completions requests (so they share steps)."""
    results: list[dict] = [{}] * len(prompts)

    def one(i: int) -> None:
        response = live.http.post("/v1/completions", json={
            "model": "tiny-llama", "prompt": prompts[i], "max_tokens": max_tokens,
            "ignore_eos": True, **extra})
        assert response.status_code == 200, response.text
        results[i] = response.json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert all(results)
    settle(live.engine)
    return results


def settle(engine: Engine) -> None:
    """Wait for the last step's record: a request finishes inside a step, before its record."""
    wait_until(lambda: not engine.scheduler.has_work()
               and engine.steps.recent(1)[-1].step == engine.step_count)


@pytest.fixture(scope="module")
def ran(live) -> list[dict]:
    return complete(live, PROMPTS, 24)


# ---- the page --------------------------------------------------------------------------------
def test_page_shows_batch_block_map_strip_and_charts(live, ran):
    response = live.http.get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    soup = BeautifulSoup(response.text, "html.parser")
    engine = live.engine
    latest = engine.steps.recent(1)[0]

    table = soup.select_one("table#batch-table")
    assert [th.get_text() for th in table.select("thead th")] == [
        "request", "phase", "rows", "drafts", "context", "blocks"]
    rows = table.select("tbody tr[data-request]")
    assert [r["data-request"] for r in rows] == [e.request_id for e in latest.entries]
    for row, entry in zip(rows, latest.entries, strict=True):
        cells = [td.get_text(" ", strip=True) for td in row.select("td")]
        assert cells[1].split()[0] == entry.phase
        assert cells[2:] == [str(entry.rows), "", str(entry.context_len),
                             str(entry.blocks_held)]
        assert f"--h: {hue(entry.request_id)}" in row.select_one(".swatch")["style"]
    caption = " ".join(soup.select_one("#batch-caption").get_text(" ").split())
    assert caption.startswith(f"step {latest.step} · {latest.total_rows} rows")

    cells = soup.select("#kv-map i.blk")
    assert len(cells) == NUM_BLOCKS
    bm = engine.block_manager
    assert len(soup.select("#kv-map i.blk.cached")) == bm.num_cached_blocks > 0  # the prefixes
    assert len(soup.select("#kv-map i.blk.held")) == bm.num_used_blocks == 0  # all finished
    assert cells[bm.cached_block_ids()[0]]["title"].endswith("cached prefix (evictable)")

    marks = soup.select("#kernel-strip i.mark")
    steps = engine.steps.recent(CHART_STEPS)
    assert len(marks) == len(steps) == engine.step_count
    for mark, record in zip(marks, steps, strict=True):
        assert f"path-{record.kernel_path}" in mark["class"]
        assert mark["title"] == (f"step {record.step}: {record.kernel_path}, "
                                 f"{record.total_rows} rows")

    for chart in ("requests", "rows", "kv", "tokens"):
        assert soup.select_one(f"#chart-{chart} svg") is not None, chart
    assert soup.select_one("#experts") is None  # a dense model: no expert load to show
    data = json.loads(soup.select_one("script#dashboard-data").string)
    assert [s["step"] for s in data["steps"]] == [r.step for r in steps]
    assert soup.select_one('script[src="/static/dashboard.js"]')["data-stream"] \
        == "/dashboard/stream"
    assert soup.select_one("#sum-step").get_text() == str(engine.step_count)
    # No speculation configured: the page says so plainly, the JSON twin too.
    assert soup.select_one("#sum-spec").get_text() == "not configured"
    assert soup.select_one("#sum-accept").get_text() == "—"
    assert "not configured" in soup.select_one("#accept-note").get_text()
    assert soup.select_one("#chart-accept svg") is not None
    assert data["speculation"]["enabled"] is False and data["speculation"]["describe"] == "off"
    assert all(s["acceptance"] is None and s["acceptance_rolling"] is None
               and s["verify_rows"] == 0 for s in data["steps"])


def test_page_shows_held_blocks_while_requests_run(live, ran):
    """Stop the engine mid-batch (a test hook that blocks it) and look at the page."""
    engine = live.engine
    gate, reached = threading.Event(), threading.Event()
    decode_steps = 0

    def hold(plan: Any) -> None:
        nonlocal decode_steps
        if len(plan.groups) == 1:
            # Until the other request arrives, slow the steps down, so that the two always
            # come to share steps however late the second HTTP request is on a busy machine.
            time.sleep(0.02)
        elif all(g.phase == "decode" for g in plan.groups):
            decode_steps += 1
            if decode_steps == 3:
                reached.set()
                gate.wait(TIMEOUT)

    engine.before_forward = hold
    worker = threading.Thread(target=complete, args=(live, ["one held", "two held"], 200))
    worker.start()
    try:
        assert reached.wait(TIMEOUT)
        soup = BeautifulSoup(live.http.get("/dashboard").text, "html.parser")
        state = live.http.get("/dashboard.json").json()["state"]
    finally:
        engine.before_forward = None
        gate.set()
        worker.join(TIMEOUT)
    assert state["running"] == 2 and not state["idle"]
    held = soup.select("#kv-map i.blk.held")
    assert len(held) == state["kv"]["used"] > 0
    ids = {r["id"] for r in state["kv"]["requests"]}
    assert len(ids) == 2
    for cell in held:
        assert cell["title"].split(": ", 1)[1] in ids
    assert sum(1 for c in state["kv"]["cells"] if c > 0) == state["kv"]["used"]


# ---- the JSON twins --------------------------------------------------------------------------
def test_dashboard_json_reflects_the_steps_that_ran(live, ran):
    data = live.http.get("/dashboard.json").json()
    engine = live.engine
    records = engine.steps.recent(CHART_STEPS)
    assert [s["step"] for s in data["steps"]] == [r.step for r in records]
    for s, r in zip(data["steps"], records, strict=True):
        for name in ("total_rows", "prefill_rows", "decode_rows", "num_running", "num_waiting",
                     "kv_blocks_used", "kv_blocks_cached", "kv_blocks_free", "kernel_path"):
            assert s[name] == getattr(r, name), name
        assert s["preemptions"] == len(r.preempted)
    assert sum(s["decode_rows"] for s in data["steps"]) > 0
    assert max(len(r.entries) for r in records) > 1  # the concurrent requests shared steps
    state = data["state"]
    assert state["step"] == engine.step_count and state["idle"]
    assert [e["id"] for e in state["batch"]["entries"]] \
        == [e.request_id for e in records[-1].entries]
    kv = state["kv"]
    assert kv["num_blocks"] == NUM_BLOCKS == len(kv["cells"])
    assert kv["used"] + kv["cached"] + kv["free"] == NUM_BLOCKS
    assert sorted(i for i, c in enumerate(kv["cells"]) if c < 0) \
        == sorted(engine.block_manager.cached_block_ids())
    assert data["config"]["num_kv_blocks"] == NUM_BLOCKS
    assert state["experts"] is None and all(not r.expert_rows for r in records)


def test_steps_json_since(live, ran):
    engine = live.engine
    last = engine.step_count
    data = live.http.get("/steps.json", params={"since": last - 3}).json()
    assert [s["step"] for s in data["steps"]] == [last - 2, last - 1, last]
    assert data["steps"][-1] == engine.steps.recent(1)[0].to_dict()  # full records, entries too
    assert data["last_step"] == last and data["missed"] == 0 and not data["more"]
    page = live.http.get("/steps.json", params={"since": 0, "limit": 2}).json()
    assert [s["step"] for s in page["steps"]] == [1, 2]
    assert page["more"] and page["next_since"] == 2
    assert live.http.get("/steps.json", params={"since": last}).json()["steps"] == []
    everything = live.http.get("/steps.json").json()["steps"]
    assert [s["step"] for s in everything] == list(range(1, last + 1))
    for bad in ({"since": "x"}, {"since": "-1"}, {"limit": "0"}):
        response = live.http.get("/steps.json", params=bad)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == next(iter(bad))


# ---- the stream ------------------------------------------------------------------------------
class Frames:
    """Reads `frame` events from an open /dashboard/stream response."""

    def __init__(self, response: httpx.Response):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        self._lines = response.iter_lines()
        self.ids: list[str] = []

    def next(self) -> dict:
        deadline = time.monotonic() + TIMEOUT  # keep-alive pings would keep a read alive
        event = data = None
        for line in self._lines:
            assert time.monotonic() < deadline, "no frame in time"
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("id: "):
                self.ids.append(line[len("id: "):])
            elif line.startswith("data: "):
                data = line[len("data: "):]
            elif line == "" and data is not None:
                assert event == "frame"
                return json.loads(data)
        raise AssertionError("stream ended")


def wait_until(condition, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_stream_coalesces_steps_and_disconnect_unsubscribes(live, ran):
    engine = live.engine
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as http:
        with http.stream("GET", "/dashboard/stream") as response:
            frames = Frames(response)
            first = frames.next()  # the current state at once, no history
            assert first["steps"] == [] and first["state"]["step"] == engine.step_count
            feed = live.app.state.step_feed
            assert feed.following and feed.num_clients == 1
            start = engine.step_count
            started_at = time.monotonic()
            # The server sends frames as the steps happen; reading them afterwards is the same.
            complete(live, PROMPTS + ["x", "y"], 30)
            end = engine.step_count
            seen: list[dict] = []
            received: list[dict] = []
            while not seen or seen[-1]["step"] < end:
                frame = frames.next()
                received.append(frame)
                seen += frame["steps"]
            elapsed = time.monotonic() - started_at
    # Every step exactly once, in order, none lost.
    assert [s["step"] for s in seen] == list(range(start + 1, end + 1))
    records = {r.step: r for r in engine.steps.recent()}
    for s in seen:
        assert s["total_rows"] == records[s["step"]].total_rows
        assert s["decode_rows"] == records[s["step"]].decode_rows
    # Coalesced: far fewer frames than steps, at most ~10 a second. (30 tokens take at least
    # 30 steps: exactly 30 when all six requests join the first.)
    assert len(seen) >= 30
    assert len(received) < len(seen) / 2
    assert len(received) <= elapsed * 10 + 2
    # Each frame's id is its last step, for an EventSource to resume from.
    with_steps = [f for f in received if f["steps"]]
    assert frames.ids[-len(with_steps):] == [str(f["steps"][-1]["step"]) for f in with_steps]
    assert all(f["dropped"] == 0 for f in received)
    assert received[-1]["state"]["batch"]["step"] == end
    # The client went away: the feed lets go of the engine.
    wait_until(lambda: live.app.state.step_feed.num_clients == 0)
    assert not live.app.state.step_feed.following


def test_stream_resumes_after_a_step(live, ran):
    last = live.engine.step_count
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as http:
        with http.stream("GET", "/dashboard/stream", params={"since": last - 4}) as response:
            first = Frames(response).next()
        assert [s["step"] for s in first["steps"]] == list(range(last - 3, last + 1))
        # A reconnecting EventSource sends the last id it saw; it wins over `since`.
        with http.stream("GET", "/dashboard/stream", params={"since": 0},
                         headers={"Last-Event-ID": str(last - 1)}) as response:
            first = Frames(response).next()
        assert [s["step"] for s in first["steps"]] == [last]
        assert http.get("/dashboard/stream", params={"since": "soon"}).status_code == 400
    wait_until(lambda: live.app.state.step_feed.num_clients == 0)


def test_an_idle_engine_shows_idle_values_and_the_stream_says_so(live, ran):
    """After a run the summary's rate falls to 0 (a frame tells the page once the window has
    passed), while the last step's rolling rate, charted, stays what it was."""
    engine = live.engine
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as http:
        with http.stream("GET", "/dashboard/stream") as response:
            frames = Frames(response)
            frames.next()
            complete(live, PROMPTS[:2], 16)
            end = engine.step_count
            received = [frames.next()]
            while not (received[-1]["state"]["idle"]
                       and received[-1]["state"]["tokens_per_s"] == 0):
                received.append(frames.next())
    running = [f for f in received if f["state"]["tokens_per_s"] > 0]
    assert running, "no frame showed the run's decode rate"
    last = engine.steps.recent(1)[0]
    assert received[-1]["steps"] == [] and received[-1]["state"]["step"] == end
    assert received[-1]["state"]["time"] >= last.started_at + last.wall_time + RATE_WINDOW_S
    data = live.http.get("/dashboard.json").json()
    assert data["steps"][-1]["tokens_per_s"] > 0 and data["state"]["tokens_per_s"] == 0
    soup = BeautifulSoup(live.http.get("/dashboard").text, "html.parser")
    assert soup.select_one("#sum-tps").get_text() == "0.0"
    wait_until(lambda: live.app.state.step_feed.num_clients == 0)


def test_constrained_steps_are_marked_with_their_rows_and_mask_time(live, ran):
    first = live.engine.step_count
    complete(live, PROMPTS[:2], 8, structured_outputs={"regex": "[a-d]{4,8}"}, ignore_eos=False)
    records = [r for r in live.engine.steps.recent() if r.step > first]
    assert all(r.constrained_rows > 0 for r in records)
    soup = BeautifulSoup(live.http.get("/dashboard").text, "html.parser")
    marks = soup.select("#kernel-strip i.mark")[-len(records):]
    for mark, r in zip(marks, records, strict=True):
        assert mark["title"].endswith(f", {r.constrained_rows} constrained "
                                      f"(mask {r.mask_ms:.2f} ms)")
    last = records[-1]
    caption = " ".join(soup.select_one("#batch-caption").get_text(" ").split())
    assert caption.endswith(f"{last.constrained_rows} constrained, mask {last.mask_ms:.2f} ms")
    data = live.http.get("/dashboard.json").json()
    assert [s["constrained_rows"] for s in data["steps"][-len(records):]] == \
        [r.constrained_rows for r in records]


def test_overlapped_steps_are_marked_in_the_caption_and_the_json(live):
    """Async scheduling: the requests decode plain rows, so their last step was launched while
    the one before it computed; the caption and /dashboard.json say so."""
    complete(live, PROMPTS[:3], 12)
    last = live.engine.steps.recent(1)[0]
    assert last.overlapped and last.discarded_rows == 0
    batch = live.http.get("/dashboard.json").json()["state"]["batch"]
    assert (batch["overlapped"], batch["discarded_rows"]) == (True, 0)
    soup = BeautifulSoup(live.http.get("/dashboard").text, "html.parser")
    caption = " ".join(soup.select_one("#batch-caption").get_text(" ").split())
    assert caption.endswith(" · overlapped")
    assert soup.select_one("#batch-caption .overlapped")["title"].startswith("async scheduling")


# ---- the bridge, without a server ------------------------------------------------------------
def record(step: int, start: float, wall: float = 0.01, decode: int = 1) -> StepRecord:
    return StepRecord(step=step, started_at=start, wall_time=wall, model_time=wall / 2,
                      scheduler_time=wall / 2, entries=[], total_rows=decode, prefill_rows=0,
                      decode_rows=decode, kv_blocks_total=8, kv_blocks_used=1,
                      kv_blocks_free=7, kv_blocks_cached=0, num_running=decode, num_waiting=0)


class FakeEngine:
    def __init__(self) -> None:
        self.subscribers: list = []
        self.steps = self
        self.records: list[StepRecord] = []

    def subscribe(self, callback):
        self.subscribers.append(callback)
        return lambda: self.subscribers.remove(callback)

    def recent(self, n: int | None = None) -> list[StepRecord]:
        return self.records if n is None else self.records[-n:]

    def emit(self, rec: StepRecord) -> None:
        self.records.append(rec)
        for callback in list(self.subscribers):
            callback(rec)


def test_feed_wakes_the_loop_once_per_burst_and_follows_only_with_clients():
    async def scenario() -> None:
        engine = FakeEngine()
        feed = StepFeed(engine)
        loop = asyncio.get_running_loop()
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakeups
            wakeups += 1
            return original(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        assert not feed.following
        a, b = feed.connect(), feed.connect()
        assert feed.following and len(engine.subscribers) == 1
        # A burst of steps from another thread: one wake-up for all of them.
        burst = threading.Thread(target=lambda: [engine.emit(record(i, 100.0 + i * 0.01))
                                                 for i in range(1, 51)])
        burst.start()
        burst.join()
        await asyncio.wait_for(a.wait(), 5)
        await asyncio.sleep(0)
        assert wakeups == 1
        assert [s["step"] for s in a.take()] == list(range(1, 51))
        assert [s["step"] for s in b.take()] == list(range(1, 51))
        feed.disconnect(a)
        assert feed.following
        feed.disconnect(b)
        assert not feed.following and engine.subscribers == []
        del loop.call_soon_threadsafe

    asyncio.run(scenario())


def test_a_slow_client_keeps_the_newest_steps_and_counts_the_rest():
    async def scenario() -> None:
        client = FeedClient(max_steps=10)
        steps = compact_steps([record(i, 100.0 + i) for i in range(1, 26)])
        client.push(steps[:15])
        client.push(steps[15:])
        client.push(steps[20:])  # a repeat (backlog overlap) is ignored
        await asyncio.wait_for(client.wait(), 1)
        assert [s["step"] for s in client.take()] == list(range(16, 26))
        assert client.dropped == 15 and client.last_step == 25

    asyncio.run(scenario())


def test_rolling_rate_is_decode_rows_per_second_of_wall_time():
    rate = RollingRate(window_s=1.0)
    # Steps of 10 ms, 4 decode rows each, back to back: 400 rows/s.
    values = [rate.add(record(i, 100.0 + i * 0.01, 0.01, 4)) for i in range(200)]
    assert values[-1] == pytest.approx(400.0)
    # After a 5 s idle gap the window holds only the new step.
    assert rate.add(record(201, 107.0, 0.02, 4)) == pytest.approx(200.0)


def test_decode_rate_now_decays_to_zero_once_no_step_ran_in_the_window():
    records = [record(i, 100.0 + i * 0.01, 0.01, 4) for i in range(100)]  # 100.00 to 101.00
    assert decode_rate(records, 101.0) == pytest.approx(400.0)
    # Half a window later: the last 50 steps' tokens over the whole window; a window later:
    # none.
    assert decode_rate(records, 101.5) == pytest.approx(50 * 4 / 1.0, rel=0.02)
    assert decode_rate(records, 102.0) == 0.0
    assert decode_rate([], 50.0) == 0.0


# ---- speculative decoding ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_live() -> Iterator[Live]:
    """Speculating (scripted drafts) while at most 2 requests run, so 3 turn it off."""
    drafts = ScriptedDrafts()
    config = EngineConfig(num_kv_blocks=NUM_BLOCKS, block_size=4,
                          **{**SPEC, "speculative_max_batch": 2})
    app = create_app(Settings(engine=config),
                     engine_factory=lambda c: Engine(c, loader=tiny_model, proposer=drafts))
    with serving(app, TIMEOUT) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        engine = app.state.engine
        for prompt in PROMPTS[:3]:  # references without speculation, to draft from
            plain = SamplingParams(max_tokens=24, ignore_eos=True, speculative=False)
            drafts.learn(engine.encode(prompt), engine.generate(prompt, plain).token_ids)
        yield Live(url, app, engine, http)


def arrivals(engine: Engine, n: int) -> threading.Event:
    """Set once the engine has been handed n requests (its submit_many, wrapped on the
    instance: `del engine.submit_many` restores it)."""
    arrived, submitted, real = threading.Event(), [0], engine.submit_many

    def submit_many(submissions, **kwargs):
        handles = real(submissions, **kwargs)
        submitted[0] += len(submissions)
        if submitted[0] >= n:
            arrived.set()
        return handles

    engine.submit_many = submit_many
    return arrived


def hold_when(engine: Engine, condition,
              after: threading.Event) -> tuple[threading.Event, threading.Event]:
    """Block the engine until `after` is set (every request of the test handed over, so that
    they share steps however the threads sending them are scheduled), and again before the
    step after the first record meeting `condition`, so the pages show that record as the
    latest batch; returns (reached, gate)."""
    reached, gate = threading.Event(), threading.Event()

    def hold(plan: Any) -> None:
        after.wait(TIMEOUT)
        latest = engine.steps.recent(1)
        if not reached.is_set() and latest and condition(latest[0]):
            reached.set()
            gate.wait(TIMEOUT)

    engine.before_forward = hold
    return reached, gate


def look(live: Live, condition, prompts: list[str]) -> tuple[BeautifulSoup, dict, StepRecord]:
    """The page and its JSON twin while the latest step meets `condition`."""
    engine = live.engine
    reached, gate = hold_when(engine, condition, arrivals(engine, len(prompts)))
    worker = threading.Thread(target=complete, args=(live, prompts, 24),
                              kwargs={"temperature": 0})
    worker.start()
    try:
        assert reached.wait(TIMEOUT)
        page = BeautifulSoup(live.http.get("/dashboard").text, "html.parser")
        data = live.http.get("/dashboard.json").json()
        latest = engine.steps.recent(1)[0]
    finally:
        engine.before_forward = None
        del engine.submit_many
        gate.set()
        worker.join(TIMEOUT)
    return page, data, latest


def expected_rolling(records: list[StepRecord]) -> list[float | None]:
    out = []
    for i in range(len(records)):
        window = records[max(0, i + 1 - ACCEPTANCE_STEPS):i + 1]
        drafted = sum(r.draft_tokens for r in window)
        out.append(sum(r.accepted_tokens for r in window) / drafted if drafted else None)
    return out


def test_verify_rows_on_the_page_and_in_its_json_twin(spec_live):
    page, data, latest = look(spec_live, lambda r: r.verify_rows and r.entries[0].phase
                              == "verify" and r.accepted_tokens, PROMPTS[:2])
    engine = spec_live.engine
    batch = data["state"]["batch"]
    assert batch["step"] == latest.step and batch["verify_rows"] == latest.verify_rows > 0
    assert (batch["draft_tokens"], batch["accepted_tokens"], batch["speculation"]) == \
        (latest.draft_tokens, latest.accepted_tokens, "on")
    rows = page.select("#batch-table tbody tr[data-request]")
    for row, entry, shown in zip(rows, latest.entries, batch["entries"], strict=True):
        assert (shown["drafted"], shown["accepted"]) == (entry.drafted, entry.accepted)
        phase = row.select_one("td.phase")
        assert f"phase-{entry.phase}" in phase["class"]
        drafts = row.select_one("td.drafts").get_text(strip=True)
        assert drafts == (f"{entry.accepted}/{entry.drafted}" if entry.phase == "verify"
                          else "")
    caption = " ".join(page.select_one("#batch-caption").get_text(" ").split())
    assert (f"({latest.prefill_rows} prefill, {latest.decode_rows} decode, "
            f"{latest.verify_rows} verify)") in caption
    assert "speculation on" in caption
    assert f"drafts {latest.accepted_tokens}/{latest.draft_tokens} accepted" in caption
    # The setting, the state and the rolling rate: the same numbers as the twin.
    assert data["speculation"] == {"enabled": True, "describe": engine.speculation.describe(),
                                   "method": "ngram", "num_tokens": 4, "max_batch": 2}
    assert page.select_one("#sum-spec").get_text() == "on"
    assert page.select_one("#sum-accept").get_text() == \
        fmt_pct(data["steps"][-1]["acceptance_rolling"])
    assert engine.speculation.describe() in page.select_one("#accept-note").get_text()
    records = [r for r in engine.steps.recent() if r.step <= latest.step][-CHART_STEPS:]
    assert [s["step"] for s in data["steps"]] == [r.step for r in records]
    for s, r, rolling in zip(data["steps"], records, expected_rolling(records), strict=True):
        for name in ("verify_rows", "draft_tokens", "accepted_tokens", "speculation"):
            assert s[name] == getattr(r, name), name
        assert s["verify_groups"] == sum(1 for e in r.entries if e.phase == "verify")
        assert s["acceptance"] == (pytest.approx(r.accepted_tokens / r.draft_tokens, abs=1e-4)
                                   if r.draft_tokens else None)
        assert s["acceptance_rolling"] == (None if rolling is None
                                           else pytest.approx(rolling, abs=1e-4))
    assert any(r.draft_tokens > r.accepted_tokens > 0 for r in records)  # kept and lost
    marks = page.select("#kernel-strip i.mark")
    for mark, r in zip(marks, records, strict=True):
        assert mark["title"].endswith(f"({r.verify_rows} verify)" if r.verify_rows
                                      else f"{r.total_rows} rows")
        share = float(mark["style"].split("--v:")[1].split(";")[0])
        assert share == pytest.approx(r.verify_rows / r.total_rows, abs=1e-3)


def test_the_page_says_when_speculation_is_off_and_why(spec_live):
    page, data, latest = look(spec_live, lambda r: r.speculation.startswith("off"),
                              PROMPTS[:3])
    assert latest.speculation == "off: 3 running > 2" == data["state"]["batch"]["speculation"]
    assert latest.verify_rows == 0 and latest.draft_tokens == 0
    assert page.select_one("#sum-spec").get_text() == "off: 3 running > 2"
    note = page.select_one("#accept-note")
    assert "off" in note["class"] and "off: 3 running > 2" in note.get_text()
    assert data["steps"][-1]["acceptance"] is None


def test_stream_frames_carry_the_verify_numbers(spec_live):
    engine = spec_live.engine
    with httpx.Client(base_url=spec_live.url, timeout=TIMEOUT) as http:
        with http.stream("GET", "/dashboard/stream") as response:
            frames = Frames(response)
            first = frames.next()
            start = engine.step_count
            complete(spec_live, PROMPTS[:2], 24, temperature=0)
            end = engine.step_count
            seen: list[dict] = []
            last_state = first["state"]
            while not seen or seen[-1]["step"] < end:
                frame = frames.next()
                seen += frame["steps"]
                last_state = frame["state"]
    records = {r.step: r for r in engine.steps.recent()}
    assert [s["step"] for s in seen] == list(range(start + 1, end + 1))
    assert sum(s["verify_rows"] for s in seen) > 0
    for s in seen:
        r = records[s["step"]]
        assert (s["verify_rows"], s["draft_tokens"], s["accepted_tokens"], s["speculation"]) \
            == (r.verify_rows, r.draft_tokens, r.accepted_tokens, r.speculation)
    assert {"verify_rows", "speculation"} <= set(last_state["batch"])


def test_decode_rate_counts_every_token_a_verify_group_emits():
    rate = RollingRate(window_s=1.0)
    entries = [StepEntry("a", "verify", 5, 20, 5, True, drafted=4, accepted=3, emitted=4),
               StepEntry("b", "decode", 1, 9, 3, True, emitted=1)]
    steps = [StepRecord(**{**record(i, 100.0 + i * 0.01, 0.01, 1).__dict__,
                           "entries": entries, "verify_rows": 5, "total_rows": 6})
             for i in range(200)]
    # Per 10 ms step: 1 decode token + 3 accepted drafts + the target's own = 5 tokens.
    assert [rate.add(r) for r in steps][-1] == pytest.approx(500.0)
