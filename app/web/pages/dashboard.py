"""The live dashboard: what the scheduler does each step, as HTML, JSON and an SSE stream.

    GET /dashboard           the page (rendered with the current state, then kept live over SSE)
    GET /dashboard.json      its JSON twin: the same state + the recent steps the charts draw
    GET /dashboard/stream    SSE: one `frame` event per update, at most FRAMES_PER_S a second,
                             each with every step since the previous frame + the current state
    GET /steps.json?since=N  full step records after step N (for scripts)

One function builds the state; the page, the twin and the stream all show that dict.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, fields
from typing import Any

import numpy as np
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.web.api.routes import error_body
from app.web.feeds import (
    ACCEPTANCE_STEPS,
    RATE_WINDOW_S,
    FeedClient,
    compact_steps,
    decode_rate,
    feed_for,
)
from app.web.render import page_response, view_routes
from app.web.views import (
    Dashboard,
    EngineLimits,
    EngineState,
    SpeculationSetting,
    Steps,
    StepSummary,
)
from engine.telemetry import STATE_POOL_FIELDS, RankTimes

CHART_STEPS = 300  # steps the charts and the kernel-path strip show
EXPERT_STEPS = 32  # recent steps the expert-load strip sums (mixture-of-experts models)
FRAMES_PER_S = 10  # the most updates a client gets; steps in between ride in the next frame
PING_S = 15  # SSE keep-alive comment while the engine is idle
IDLE_FRAME_S = RATE_WINDOW_S + 0.1  # after the last step: the frame that shows it idle
MAX_STEPS_PAGE = 2048  # most records one /steps.json answer holds
RANK_TIMES = tuple(f.name for f in fields(RankTimes) if f.name != "rank")  # seconds, per rank

# ---- the state -------------------------------------------------------------------------------
def hue(request_id: str) -> int:
    """A stable colour per request, the same on the page and in every frame: FNV-1a, then a
    final mix so ids that differ in one character still land far apart on the wheel."""
    h = 0x811C9DC5
    for byte in request_id.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    return h % 360


def label(request_id: str) -> str:
    return request_id if len(request_id) <= 14 else request_id[:13] + "…"


def _request(request_id: str) -> dict[str, Any]:
    return {"id": request_id, "label": label(request_id), "hue": hue(request_id)}


def _kv_snapshot(engine: Any) -> dict[str, Any]:
    # Read while the engine thread may change the tables: retry a torn read.
    for _ in range(5):
        try:
            return engine.kv_snapshot()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return engine.kv_snapshot()


def kv_map(engine: Any) -> dict[str, Any]:
    """Every block as one small int: 0 free, -1 cached (no holder, kept for prefix reuse),
    k >= 1 held by requests[k - 1]; blocks with several holders list them all in `shared`."""
    snap = _kv_snapshot(engine)
    cells = [0] * snap["num_blocks"]
    for block in snap["cached"]:
        cells[block] = -1
    requests: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    shared: dict[str, list[int]] = {}
    for block, holders in sorted(snap["holders"].items(), key=lambda kv: int(kv[0])):
        ks = []
        for request_id in holders:
            if request_id not in index:
                requests.append(_request(request_id))
                index[request_id] = len(requests)
            ks.append(index[request_id])
        cells[int(block)] = ks[0]
        if len(ks) > 1:
            shared[block] = ks
    used = sum(1 for c in cells if c > 0)
    cached = sum(1 for c in cells if c < 0)
    return {"num_blocks": snap["num_blocks"], "block_size": snap["block_size"], "used": used,
            "cached": cached, "free": len(cells) - used - cached, "requests": requests,
            "cells": cells, "shared": shared}


def _expert_layers(engine: Any, records: list) -> dict[int, int]:
    """MoE layer index -> experts, from the model's family (or, failing that, the steps)."""
    family = getattr(getattr(engine, "runner", None), "family", None)
    layers = family.expert_layers() if hasattr(family, "expert_layers") else {}
    if not layers:
        for record in reversed(records):
            if record.expert_rows:
                return {int(i): len(rows) for i, rows in record.expert_rows.items()}
    return dict(layers)


def expert_load(engine: Any) -> dict[str, Any] | None:
    """Rows each expert received in each MoE layer, summed over the steps among the last
    EXPERT_STEPS that ran the model (a row counts once per expert it chose), or None for a
    dense model."""
    records = [r for r in engine.steps.recent(EXPERT_STEPS) if r.expert_rows]
    layers = _expert_layers(engine, records)
    if not layers:
        return None
    out = []
    for i, n in sorted(layers.items()):
        counts = [r.expert_rows[str(i)] for r in records
                  if len(r.expert_rows.get(str(i), ())) == n]
        rows = np.sum(counts, axis=0).tolist() if counts else [0] * n
        out.append({"layer": i, "rows": rows, "max": max(rows), "total": sum(rows)})
    return {"steps": len(records), "first_step": records[0].step if records else None,
            "last_step": records[-1].step if records else None,
            "num_experts": max(layers.values()), "layers": out}


def state_pool(engine: Any) -> dict[str, int] | None:
    """The recurrent-state pool of a model with recurrent layers, now: StepRecord's state_*
    fields without their prefix (slots_total, slots_used, checkpoints, ...); None for a model
    without such layers."""
    slots = getattr(engine, "state_slots", None)  # engine/state_slots.py: StateSlots
    usage = slots.usage() if slots is not None else None
    if not usage or not usage["state_slots_total"]:
        return None
    return {name.removeprefix("state_"): usage[name] for name in STATE_POOL_FIELDS}


def _steps_since(engine: Any, since: float) -> list:
    """The recent steps that ended after `since` (epoch seconds), in step order."""
    records = engine.steps.recent()
    first = len(records)
    while first and records[first - 1].started_at + records[first - 1].wall_time > since:
        first -= 1
    return records[first:]


def dashboard_state(engine: Any) -> dict[str, Any]:
    """What the engine is doing now: live queue lengths, the latest step's batch, the KV map,
    the recurrent-state pool and the expert load (None for models without them)."""
    latest = engine.steps.recent(1)
    batch = None
    if latest:
        record = latest[0]
        batch = {"step": record.step, "started_at": record.started_at,
                 "wall_time": record.wall_time, "kernel_path": record.kernel_path,
                 "total_rows": record.total_rows, "prefill_rows": record.prefill_rows,
                 "decode_rows": record.decode_rows, "verify_rows": record.verify_rows,
                 "draft_tokens": record.draft_tokens,
                 "accepted_tokens": record.accepted_tokens,
                 "speculation": record.speculation, "error": record.error,
                 "constrained_rows": record.constrained_rows, "mask_ms": record.mask_ms,
                 "overlapped": record.overlapped, "discarded_rows": record.discarded_rows,
                 "entries": [{**_request(e.request_id), "phase": e.phase, "rows": e.rows,
                              "context_len": e.context_len, "blocks_held": e.blocks_held,
                              "sampled": e.sampled, "drafted": e.drafted,
                              "accepted": e.accepted} for e in record.entries]}
    scheduler = engine.scheduler
    running, waiting = len(scheduler.running), len(scheduler.waiting)
    now = time.time()
    # The rate now, not the last step's: it falls to 0 once no step ran in the window.
    rate = decode_rate(_steps_since(engine, now - RATE_WINDOW_S), now)
    return {"time": now, "step": engine.step_count, "running": running,
            "waiting": waiting, "idle": running == 0 and waiting == 0,
            "tokens_per_s": round(rate, 2), "batch": batch,
            "kv": kv_map(engine), "state_pool": state_pool(engine),
            "experts": expert_load(engine)}


def rank_state(engine: Any) -> list[dict[str, Any]]:
    """Tensor parallelism: each rank, its loopback port and its times in the latest step that
    ran on every rank (null before one); empty for one rank."""
    ports = getattr(getattr(engine, "runner", None), "ports", None)
    if not ports:
        return []
    latest = next((r.ranks for r in reversed(engine.steps.recent()) if r.ranks), [])
    times = {t.rank: asdict(t) for t in latest}
    return [{"rank": rank, "port": port, **times.get(rank, dict.fromkeys(RANK_TIMES))}
            for rank, port in enumerate(ports)]


def speculation_setting(engine: Any) -> SpeculationSetting:
    """The engine's speculative decoding as configured (each step says whether it ran)."""
    spec = getattr(engine, "speculation", None)
    if spec is None or not spec.enabled:
        return SpeculationSetting(enabled=False, describe="off", method="off", num_tokens=None,
                                  max_batch=None)
    return SpeculationSetting(enabled=True, describe=spec.describe(), method=spec.method,
                              num_tokens=spec.num_tokens, max_batch=spec.max_batch)


def dashboard_context(engine: Any) -> Dashboard:
    config = engine.config
    return Dashboard(
        model=engine.loaded.name,
        config=EngineLimits(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            block_size=config.block_size, num_kv_blocks=config.num_kv_blocks),
        speculation=speculation_setting(engine),
        ranks=rank_state(engine),
        frames_per_s=FRAMES_PER_S,
        chart_steps=CHART_STEPS,
        acceptance_steps=ACCEPTANCE_STEPS,
        expert_steps=EXPERT_STEPS,
        state=EngineState(**dashboard_state(engine)),
        steps=compact_steps(engine.steps.recent(CHART_STEPS)),
    )


# ---- routes ----------------------------------------------------------------------------------
class ParamError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), param=self.param, code="invalid_value"),
                            status_code=400)


def _int_param(request: Request, name: str, default: int | None, lo: int,
               hi: int | None = None) -> int | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ParamError(f"{name} must be an integer, got {raw!r}", name) from None
    if value < lo or (hi is not None and value > hi):
        span = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
        raise ParamError(f"{name} must be {span}, got {value}", name)
    return value


async def dashboard(request: Request) -> Response:
    context = dashboard_context(request.app.state.engine)
    # The page hands its script the whole context (`data`) as well.
    return page_response(request, "dashboard.html", context,
                         page_only=lambda: {"data": context.model_dump()})


async def steps_json(request: Request) -> Response:
    try:
        since = _int_param(request, "since", 0, 0)
        limit = _int_param(request, "limit", MAX_STEPS_PAGE, 1, MAX_STEPS_PAGE)
    except ParamError as e:
        return e.response()
    engine = request.app.state.engine
    records = engine.steps.recent()
    newer = [r for r in records if r.step > since]
    page = newer[:limit]
    oldest = records[0].step if records else None
    return JSONResponse(Steps(
        since=since, last_step=engine.step_count, oldest_step=oldest,
        # Steps after `since` that fell out of the ring buffer before this call.
        missed=max(0, (oldest - since - 1)) if oldest is not None else 0,
        next_since=page[-1].step if page else since, more=len(newer) > len(page),
        steps=[StepSummary(**r.to_dict()) for r in page]).model_dump(mode="json"))


def _frame(engine: Any, client: FeedClient) -> tuple[ServerSentEvent, bool]:
    """The frame, and whether it shows the engine settled (idle, its decode rate 0)."""
    steps = client.take()
    state = dashboard_state(engine)
    data = {"steps": steps, "dropped": client.dropped, "state": state,
            "ranks": rank_state(engine)}
    # The id is the last step sent: a reconnecting EventSource resumes from it.
    event = ServerSentEvent(json.dumps(data, separators=(",", ":")), event="frame",
                            id=str(client.last_step))
    return event, state["idle"] and state["tokens_per_s"] == 0


async def _frames(request: Request, since: int | None):
    engine = request.app.state.engine
    feed = feed_for(request.app.state)
    client = feed.connect(since)
    loop = asyncio.get_running_loop()
    interval = 1.0 / FRAMES_PER_S
    try:
        frame, settled = _frame(engine, client)  # the current state at once (and backlog)
        yield frame
        sent_at = loop.time()
        while True:
            # Settled: nothing runs here until the next step. Else, once no step came for a
            # rate window, one more frame shows the idle values (the rate fallen to 0).
            try:
                await asyncio.wait_for(client.wait(), None if settled else IDLE_FRAME_S)
            except TimeoutError:
                pass
            delay = sent_at + interval - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # steps arriving meanwhile join this frame
            frame, settled = _frame(engine, client)
            yield frame
            sent_at = loop.time()
    finally:
        feed.disconnect(client)


async def dashboard_stream(request: Request) -> Response:
    try:
        since = _int_param(request, "since", None, 0)
    except ParamError as e:
        return e.response()
    last_event = request.headers.get("last-event-id", "")
    if last_event.isdigit():  # an EventSource reconnecting: resume after the last step it got
        since = int(last_event)
    return EventSourceResponse(_frames(request, since), ping=PING_S, sep="\n")


routes = [
    *view_routes("/dashboard", dashboard),
    Route("/dashboard/stream", dashboard_stream, methods=["GET"]),
    Route("/steps.json", steps_json, methods=["GET"]),
]
