"""The playground: the page and its form, and live runs started from it, their result panels
streamed over SSE, stopped.

    GET  /                        the playground page
    POST /playground              start one run or N copies (the panels fragment, or JSON)
    GET  /runs/{id}/stream        SSE: the panels' token, stats and end fragments
    POST /runs/{id}/cancel        stop a live run

Playground runs live in a per-app registry (`app.state.live_runs`): a task drains each run's
events into a list that is replayed to every stream that follows the run, so a panel that
connects late (or twice) still sees every token, and a closed tab does not cancel the run. Runs
no longer in the registry are replayed from the database as their final state.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from pydantic import TypeAdapter, ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.bench.client import json_schema_format
from app.db import runs as queries
from app.runs import QueueFullError, Run, RunRequest, params_dict
from app.web.api.params import APIError
from app.web.api.routes import MAX_STOP
from app.web.api.structured import ResponseFormat, response_format_spec
from app.web.api.tool_calls import ToolCall, ToolParser, ToolStream
from app.web.api.tool_output import plan as tool_plan
from app.web.api.tools import ToolFields, Tools
from app.web.pages.runs import run_context
from app.web.render import (
    database,
    error_response,
    form_errors,
    in_thread,
    page_response,
    page_templates,
    read_form,
    run_service,
    token_decoder,
    token_view,
    tokens_per_s,
)
from engine.engine import EngineError
from engine.errors import RequestError
from engine.events import ErrorEvent, Event, FinishEvent, TokenEvent
from engine.sampling import SamplingParams

MAX_COPIES = 8
MAX_STOP_CHARS = 200
PLAYGROUND_LOGPROBS = 5  # alternatives kept per token, shown on hover
DEFAULTS = {"mode": "chat", "temperature": 0.0, "top_p": 1.0, "max_tokens": 64, "seed": None,
            "stop": "", "copies": 1, "ignore_eos": False, "speculative": True,
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "tool_choice": "auto"}
TOOL_CHOICES = ("auto", "required", "none")
# The form sends speculative=0 from a hidden input and =1 from the checkbox after it (the last
# one wins), so a form without the field at all keeps the default.
SWITCH_VALUES = {"1": True, "on": True, "true": True, "0": False, "off": False, "false": False}


# ---- playground ----------------------------------------------------------------------------
@dataclass
class PlaygroundInput:
    mode: str
    system: str
    prompt: str
    params: SamplingParams
    copies: int
    tools: Tools | None = None  # none: no tools, or tool_choice none
    tool_list: list[dict] | None = None  # the tools as given (what the run records)


def _form_number(form: dict[str, str], name: str, label: str, errors: dict[str, str],
                 lo: float, hi: float, *, integer: bool = False, lo_open: bool = False,
                 optional: bool = False) -> Any:
    raw = form.get(name, "").strip()
    if not raw:
        if optional:
            return None
        if name in DEFAULTS and DEFAULTS[name] is not None:
            return DEFAULTS[name]
        errors[name] = f"{label} is required"
        return None
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        errors[name] = f"{label} must be {'a whole number' if integer else 'a number'}, " \
                       f"got {raw[:40]!r}"
        return None
    low_ok = value > lo if lo_open else value >= lo
    if not math.isfinite(value) or not low_ok or value > hi:
        shown = (str(int(lo)), str(int(hi))) if integer else (f"{lo:g}", f"{hi:g}")
        errors[name] = f"{label} must be {'above' if lo_open else 'at least'} {shown[0]} and " \
                       f"at most {shown[1]}, got {raw[:40]}"
        return None
    return value


def parse_playground(form: dict[str, str], max_tokens_limit: int) -> tuple[PlaygroundInput | None,
                                                                             dict[str, str]]:
    """The playground form checked field by field: (input, {}) or (None, {field: message})."""
    errors: dict[str, str] = {}
    mode = form.get("mode", DEFAULTS["mode"])
    if mode not in ("chat", "raw"):
        errors["mode"] = f"prompt mode must be chat or raw, got {mode[:40]!r}"
    prompt = form.get("prompt", "")
    if not prompt.strip():
        errors["prompt"] = "prompt must not be empty"
    system = form.get("system", "") if mode == "chat" else ""
    temperature = _form_number(form, "temperature", "temperature", errors, 0.0, 2.0)
    top_p = _form_number(form, "top_p", "top-p", errors, 0.0, 1.0, lo_open=True)
    max_tokens = _form_number(form, "max_tokens", "max tokens", errors, 1, max_tokens_limit,
                              integer=True)
    seed = _form_number(form, "seed", "seed", errors, 0, 2**63 - 1, integer=True,
                        optional=True)
    copies = _form_number(form, "copies", "copies", errors, 1, MAX_COPIES, integer=True)
    penalties = {name: _form_number(form, name, name.replace("_", " "), errors, -2.0, 2.0)
                 for name in ("frequency_penalty", "presence_penalty")}
    # Stop strings: one per line, or comma separated on a line.
    stops = [s.strip() for line in form.get("stop", "").splitlines() for s in line.split(",")]
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOP:
        errors["stop"] = f"at most {MAX_STOP} stop strings, got {len(stops)}"
    elif any(len(s) > MAX_STOP_CHARS for s in stops):
        errors["stop"] = f"stop strings must be at most {MAX_STOP_CHARS} characters"
    raw = form.get("speculative")
    speculative = DEFAULTS["speculative"] if raw is None else SWITCH_VALUES.get(raw.strip().lower())
    if speculative is None:
        errors["speculative"] = f"speculative must be on or off, got {raw[:40]!r}"
    structured = _json_schema(form.get("json_schema", ""), errors)
    tools, tool_list = _tools(form, mode, structured is not None, errors)
    if errors:
        return None, errors
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            seed=seed, stop=tuple(stops), logprobs=PLAYGROUND_LOGPROBS,
                            ignore_eos=form.get("ignore_eos", "") not in ("", "0", "off"),
                            speculative=speculative, structured=structured, **penalties)
    return PlaygroundInput(mode, system, prompt, params, copies, tools, tool_list), {}


def _pydantic_error(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def _json_field(raw: str, name: str, label: str, errors: dict[str, str]) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:
        errors[name] = f"{label} is not valid JSON: {e}"
        return None


def _json_schema(raw: str, errors: dict[str, str]) -> Any:
    """The JSON-schema box as the API's response_format json_schema (None: empty box)."""
    if not raw.strip():
        return None
    schema = _json_field(raw, "json_schema", "the JSON schema", errors)
    if "json_schema" in errors:
        return None
    if not isinstance(schema, dict):
        errors["json_schema"] = "the JSON schema must be an object"
        return None
    fmt = json_schema_format(schema, "playground")
    return response_format_spec(TypeAdapter(ResponseFormat).validate_python(fmt))


def _tools(form: dict[str, str], mode: str, structured: bool,
           errors: dict[str, str]) -> tuple[Tools | None, list[dict] | None]:
    """The tools box (a JSON list of OpenAI tool definitions) and the tool_choice select."""
    raw, choice = form.get("tools", ""), form.get("tool_choice", DEFAULTS["tool_choice"])
    if choice not in TOOL_CHOICES:
        errors["tool_choice"] = f"tool choice must be one of {', '.join(TOOL_CHOICES)}"
        return None, None
    if not raw.strip():
        if choice == "required":
            errors["tool_choice"] = "tool choice required needs tools"
        return None, None
    given = _json_field(raw, "tools", "the tools", errors)
    if "tools" in errors:
        return None, None
    if mode != "chat":
        errors["tools"] = "tools need the chat prompt mode (the chat template renders them)"
        return None, None
    if choice == "required" and structured:
        errors["tool_choice"] = "tool choice required cannot be combined with a JSON schema"
        return None, None
    try:
        fields = ToolFields.model_validate({"tools": given, "tool_choice": choice})
    except ValidationError as e:
        errors["tools"] = f"tools: {_pydantic_error(e)}"
        return None, None
    return fields.tool_request, given


async def playground(request: Request) -> Response:
    service = run_service(request)
    speculation = getattr(service.engine, "speculation", None)
    context = {"model": service.model_name, "max_model_len": service.max_model_len,
               "max_tokens_limit": service.max_context_tokens(), "max_copies": MAX_COPIES,
               "max_stop": MAX_STOP, "defaults": DEFAULTS, "tool_choices": TOOL_CHOICES,
               "database": database(request) is not None,
               # The engine's speculative decoding ("off", or its method and limits).
               "speculation": {"enabled": bool(speculation and speculation.enabled),
                               "describe": speculation.describe() if speculation else "off"}}
    return page_response(request, "playground.html", context)


# ---- live runs -----------------------------------------------------------------------------
class LiveRun:
    """A run's events so far; each follower gets them all, then the rest as they come."""

    def __init__(self, run: Run, parser: ToolParser | None = None):
        self.run = run
        self.parser = parser  # a run given tools: its output is read for calls
        self.events: list[Event] = []
        self.finish: FinishEvent | None = None
        self._followers: set[asyncio.Queue] = set()
        self.task = asyncio.get_running_loop().create_task(self._drain(), name=f"live-{run.id}")

    @property
    def id(self) -> str:
        return self.run.id

    async def _drain(self) -> None:
        async for event in self.run.events():
            self.events.append(event)
            if isinstance(event, FinishEvent):
                self.finish = event
            for queue in list(self._followers):
                queue.put_nowait((self, event))
        self._followers.clear()

    def follow(self, queue: asyncio.Queue) -> None:
        for event in self.events:
            queue.put_nowait((self, event))
        if self.finish is None:
            self._followers.add(queue)

    def unfollow(self, queue: asyncio.Queue) -> None:
        self._followers.discard(queue)


class LiveRuns:
    """Playground runs by id: every unfinished one, and the latest finished ones."""

    keep_finished = 256

    def __init__(self) -> None:
        self._runs: OrderedDict[str, LiveRun] = OrderedDict()

    def add(self, run: Run, parser: ToolParser | None = None) -> LiveRun:
        live = self._runs[run.id] = LiveRun(run, parser)
        finished = [k for k, v in self._runs.items() if v.finish is not None]
        for run_id in finished[:max(0, len(finished) - self.keep_finished)]:
            del self._runs[run_id]
        return live

    def get(self, run_id: str) -> LiveRun | None:
        return self._runs.get(run_id)

    def __len__(self) -> int:
        """How many runs it holds, finished ones included."""
        return len(self._runs)


def live_runs(app: Any) -> LiveRuns:
    """The app's registry (made by the lifespan: app/web/app.py)."""
    return app.state.live_runs


# ---- starting and stopping playground runs ------------------------------------------------
async def start_runs(request: Request) -> Response:
    service = run_service(request)
    form = await read_form(request)
    if isinstance(form, Response):
        return form
    data, errors = parse_playground(form, service.max_context_tokens())
    if data is None:
        return form_errors(request, errors)
    params, parser, record = data.params, None, {}
    if data.mode == "chat":
        messages = ([{"role": "system", "content": data.system}] if data.system.strip() else [])
        messages.append({"role": "user", "content": data.prompt})
        if data.tools is None:
            prompt_ids = service.encode_chat(messages)
        else:  # as /v1/chat/completions does it (app/web/api/tool_output.py)
            try:
                plan = tool_plan(service, request.app.state.settings.tool_call_parser,
                                 data.tools, messages)
                messages = plan.messages
                prompt_ids = plan.encode(messages)
            except APIError as e:
                return form_errors(request, {e.param or "tools": e.message})
            except ValueError as e:
                return form_errors(request, {"tools": f"tools: {e}"})
            params, parser = plan.sampling(params), plan.parser
            record = {"tools": data.tool_list, "tool_choice": data.tools.choice,
                      "tool_parser": parser.name if parser else None}
        prompt_text = None
    else:
        messages, prompt_ids, prompt_text = None, service.encode(data.prompt), data.prompt
    registry = live_runs(request.app)
    started: list[LiveRun] = []
    for _ in range(data.copies):
        run_request = RunRequest(prompt_ids, params, "/playground", "playground",
                                 prompt_text, messages, record)
        try:
            run = service.start(run_request)
        except QueueFullError as e:
            return error_response(request, 429, str(e), None, "queue_full", fragment=True)
        except EngineError as e:
            return error_response(request, 503, f"the engine is not running: {e}", fragment=True)
        except RequestError as e:  # too long for the context window, and the like
            return form_errors(request, {e.param: str(e)})
        started.append(registry.add(run, parser))
    ids = [live.id for live in started]
    context = {"runs": [{"id": i, "url": f"/runs/{i}", "cancel_url": f"/runs/{i}/cancel",
                         "stream_url": f"/runs/{i}/stream"} for i in ids],
               "stream_url": _stream_url(ids), "saved": database(request) is not None,
               "prompt_tokens": len(prompt_ids), "params": params_dict(params),
               "tools": parser is not None}
    return page_response(request, "_run_panels.html", context)


def _stream_url(ids: list[str]) -> str:
    """One stream for a group of copies: browsers allow ~6 connections per host."""
    query = urlencode([("with", i) for i in ids[1:]])
    return f"/runs/{ids[0]}/stream" + (f"?{query}" if query else "")


async def cancel_run(request: Request) -> Response:
    run_id = request.path_params["run_id"]
    live = live_runs(request.app).get(run_id)
    if live is None:
        return error_response(request, 404, f"no live run {run_id!r} (only playground runs of this "
                                    "server can be stopped here)", "run_id", "not_found")
    running = live.finish is None
    if running:
        live.run.cancel()
    context = {"id": run_id, "cancelled": running,
               "finish_reason": live.finish.reason if live.finish else None}
    return page_response(request, "_cancelled.html", context)


# ---- the SSE stream of result panels --------------------------------------------------------
@dataclass
class PanelStats:
    tokens: int = 0
    ttft: float | None = None
    tokens_per_s: float | None = None
    e2e: float | None = None
    finish_reason: str | None = None
    error: str | None = None


class _Meter:
    """Panel stats of a live run, computed as the saved run's metrics are (app.db.runs)."""

    def __init__(self, queued_at: float):
        self.queued_at = queued_at
        self.first: float | None = None
        self.last: float | None = None
        self.stats = PanelStats()

    def token(self, event: TokenEvent) -> None:
        s = self.stats
        s.tokens += 1
        self.first = event.time if self.first is None else self.first
        self.last = event.time
        s.ttft = self.first - self.queued_at
        if s.tokens > 1:
            s.tokens_per_s = tokens_per_s((self.last - self.first) / (s.tokens - 1))

    def finish(self, event: FinishEvent, error: str | None) -> None:
        s = self.stats
        s.tokens = event.completion_tokens
        s.ttft = (None if event.first_token_time is None
                  else event.first_token_time - self.queued_at)
        s.e2e = event.finish_time - self.queued_at
        s.finish_reason = event.reason
        s.error = event.error or error


def _sse(event: str, html: str) -> dict:
    # A lone CR would split an SSE data line; as a character reference it stays text.
    # Empty data is never dispatched by EventSource, hence the fallback.
    return {"event": event, "data": html.replace("\r", "&#13;") or " "}


async def stream_runs(request: Request) -> Response:
    """SSE for one run's panel, or a group of copies (`?with=ID&with=ID`), ending with `done`.

    Events per run: token-ID (a token's HTML, appended), stats-ID (the stats), end-ID (finish
    reason and link); then one `done` for the whole stream."""
    ids = list(dict.fromkeys([request.path_params["run_id"],
                              *request.query_params.getlist("with")]))
    if len(ids) > MAX_COPIES:
        return error_response(request, 400, f"a stream follows at most {MAX_COPIES} runs", "with")
    registry = live_runs(request.app)
    lives = [live for i in ids if (live := registry.get(i)) is not None]
    saved: list[dict] = []
    for run_id in ids:
        if registry.get(run_id) is not None:
            continue
        record = await in_thread(request, queries.get_run, run_id) if database(request) else None
        if record is None:
            return error_response(request, 404, f"no run {run_id!r}", "run_id", "not_found")
        saved.append(record)
    env = page_templates(request)
    has_db = database(request) is not None
    service = run_service(request)

    def fragment(name: str, **context: Any) -> str:
        return env.get_template(name).render(context)

    def calls(run_id: str, found: list[ToolCall]) -> list[dict]:
        return [_sse(f"calls-{run_id}", fragment("_tool_calls.html", calls=found))] if found \
            else []

    def end(run_id: str, stats: PanelStats) -> dict:
        return _sse(f"end-{run_id}", fragment("_end.html", id=run_id, stats=stats, saved=has_db))

    async def events() -> AsyncIterator[dict]:
        for record in saved:  # finished before this stream: the final state at once
            run = run_context(record, token_decoder(request, record["model"]))
            tokens = ([t.model_dump() for t in run.tokens]
                      + ([{"text": run.text_tail}] if run.text_tail else []))
            stats = _saved_stats(record)
            yield _sse(f"token-{record['id']}", fragment("_tokens.html", tokens=tokens))
            yield _sse(f"stats-{record['id']}", fragment("_stats.html", stats=stats))
            yield end(record["id"], stats)
        queue: asyncio.Queue = asyncio.Queue()
        meters = {live.id: _Meter(live.run.created) for live in lives}
        # The calls as the API streams them: each once complete (app/web/api/tool_calls.py).
        streams = {live.id: ToolStream(live.parser) for live in lives if live.parser}
        errors: dict[str, str] = {}
        pending = set(meters)
        for live in lives:
            live.follow(queue)
        try:
            while pending:
                live, event = await queue.get()
                meter = meters[live.id]
                if isinstance(event, TokenEvent):
                    meter.token(event)
                    token = token_view(event.index, event.token_id, event.text, event.logprob,
                                       event.top_logprobs, event.time, live.run.created,
                                       event.step, service.token_text, event.drafted)
                    yield _sse(f"token-{live.id}", fragment("_tokens.html", tokens=[token]))
                    yield _sse(f"stats-{live.id}", fragment("_stats.html", stats=meter.stats))
                    if live.id in streams:
                        for sse in calls(live.id, streams[live.id].feed(event.text)[1]):
                            yield sse
                elif isinstance(event, ErrorEvent):
                    errors[live.id] = event.message
                elif isinstance(event, FinishEvent):
                    if event.text_delta:  # text held back for a possible stop string
                        yield _sse(f"token-{live.id}",
                                   fragment("_tokens.html", tokens=[{"text": event.text_delta}]))
                    if live.id in streams:
                        for sse in calls(live.id, streams[live.id].finish(event.text_delta)[1]):
                            yield sse
                    meter.finish(event, errors.get(live.id))
                    yield _sse(f"stats-{live.id}", fragment("_stats.html", stats=meter.stats))
                    yield end(live.id, meter.stats)
                    pending.discard(live.id)
            yield {"event": "done", "data": "done"}
        finally:
            for live in lives:
                live.unfollow(queue)

    return EventSourceResponse(events(), sep="\n", ping=15)


def _saved_stats(record: dict) -> PanelStats:
    metrics = record["metrics"]
    return PanelStats(tokens=record["completion_tokens"], ttft=metrics["ttft"],
                      tokens_per_s=tokens_per_s(metrics["tpot"]), e2e=metrics["e2e_latency"],
                      finish_reason=record["finish_reason"] or record["status"],
                      error=record["error"])



routes = [
    Route("/", playground, methods=["GET"]),
    Route("/playground", start_runs, methods=["POST"]),
    Route("/runs/{run_id}/stream", stream_runs, methods=["GET"]),
    Route("/runs/{run_id}/cancel", cancel_run, methods=["POST"]),
]
