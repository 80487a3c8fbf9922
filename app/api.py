"""The OpenAI-compatible JSON API: /v1/completions, /v1/chat/completions, /v1/models.

Each route reads the body (size-capped), checks every parameter into SamplingParams and a token
prompt, hands them to RunService, and shapes the engine's events like OpenAI's responses: one
JSON object, or SSE `data: {chunk}` lines ending with `data: [DONE]`. Bad input is always a 4xx
JSON error in OpenAI's shape; nothing here touches MLX.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from app.runs import Run, RunRequest, RunResult, RunService
from engine.engine import EngineError
from engine.events import ErrorEvent, FinishEvent, TokenEvent
from engine.sampling import SamplingParams

log = logging.getLogger("batchscope.api")

MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_TEMPERATURE = 1e-5  # below this, dividing the logits overflows: treat as greedy
ROLES = ("system", "user", "assistant")


# ---- errors --------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    """Routing errors (404, 405) as OpenAI-shaped JSON under /v1; Starlette's default elsewhere."""
    assert isinstance(exc, HTTPException)
    if not request.url.path.startswith("/v1"):
        if exc.status_code in (204, 304):
            return Response(status_code=exc.status_code, headers=exc.headers)
        return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
               else str(exc.detail))
    return JSONResponse(error_body(message, param=None, code=code),
                        status_code=exc.status_code, headers=exc.headers)


async def server_error_handler(request: Request, exc: Exception) -> Response:
    """Any bug becomes a JSON 500 (Starlette re-raises afterwards, so the server logs it too)."""
    log.error("unhandled %s on %s %s: %s", type(exc).__name__, request.method, request.url.path,
              exc)
    return JSONResponse(error_body("internal server error: the failure has been logged",
                                   "server_error", None, "internal_error"), status_code=500)


exception_handlers: dict[Any, Callable] = {
    APIError: api_error_handler,
    HTTPException: http_error_handler,
    Exception: server_error_handler,
}


# ---- reading the body ------------------------------------------------------------------------
async def read_json(request: Request) -> dict:
    limit: int = request.app.state.settings.max_body_bytes
    too_large = APIError(413, f"request body is larger than {limit} bytes", None,
                         "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        data = json.loads(bytes(body))
    except (ValueError, RecursionError):
        raise bad("could not parse the request body as JSON", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    return data


# ---- parameters ------------------------------------------------------------------------------
def _type_error(name: str, expected: str) -> APIError:
    return bad(f"{name} must be {expected}", name, "invalid_type")


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
        raise bad(f"{name} must be {span}, got {value}", name)
    return value


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(name, "a number")
    ok = math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        raise bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value}", name)
    return float(value)


def _bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean")
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or any(not isinstance(s, str) for s in stops):
        raise _type_error("stop", "a string or a list of strings")
    if len(stops) > MAX_STOP:
        raise bad(f"stop may hold at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad("stop sequences must not be empty", "stop")
    return tuple(stops)


def _neutral_or_absent(value: Any, *neutral: Any) -> bool:
    return value is None or any(value == n and type(value) is type(n) for n in neutral)


# Parameters OpenAI defines that this server does not implement: accepted only at their neutral
# value (what clients send by default), otherwise a 400 naming them.
_UNSUPPORTED_UNLESS_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": lambda v: _neutral_or_absent(v, 0, 0.0),
    "presence_penalty": lambda v: _neutral_or_absent(v, 0, 0.0),
    "logit_bias": lambda v: _neutral_or_absent(v, {}),
    "best_of": lambda v: _neutral_or_absent(v, 1),
    "echo": lambda v: _neutral_or_absent(v, False),
    "suffix": lambda v: _neutral_or_absent(v, ""),
    "tools": lambda v: _neutral_or_absent(v, []),
    "functions": lambda v: _neutral_or_absent(v, []),
    "tool_choice": lambda v: _neutral_or_absent(v, "none", "auto"),
    "function_call": lambda v: _neutral_or_absent(v, "none", "auto"),
    "response_format": lambda v: _neutral_or_absent(v, {"type": "text"}),
    "modalities": lambda v: _neutral_or_absent(v, ["text"]),
}
# Accepted and ignored whatever their value: they change nothing about generation.
_IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "service_tier"}
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed",
           "stop", "n", "top_k", "ignore_eos"}
_COMPLETIONS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}


def _check_keys(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        neutral = _UNSUPPORTED_UNLESS_NEUTRAL.get(key)
        if neutral is not None:
            if not neutral(value):
                raise bad(f"{key} is not supported by this server", key, "unsupported_parameter")
        elif key not in allowed and key not in _IGNORED:
            raise bad(f"unrecognized request argument supplied: {key}", key, "unknown_parameter")


def _check_model(body: dict, service: RunService) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise _type_error("model", "a string")
    if model != service.model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                            f"'{service.model_name}'", "model", "model_not_found")


@dataclass
class Common:
    stream: bool
    include_usage: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool


def _common(body: dict) -> Common:
    n = _int(body, "n")
    if n is not None and n != 1:
        raise bad(f"n must be 1: this server returns one choice per request, got {n}", "n",
                  "unsupported_value")
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise _type_error("stream_options", "an object")
        include_usage = bool(_bool(options, "include_usage"))
    temperature = _number(body, "temperature", 0.0, 2.0)
    temperature = 1.0 if temperature is None else temperature  # OpenAI's default
    top_k = _int(body, "top_k", lo=-1)
    return Common(
        stream=stream, include_usage=include_usage,
        temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True) or 1.0,
        top_k=0 if top_k in (None, -1) else top_k,  # -1: no cut (vLLM's convention)
        seed=_int(body, "seed"), stop=_stop(body), ignore_eos=bool(_bool(body, "ignore_eos")))


def _params(common: Common, max_tokens: int, logprobs: int) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=common.temperature, top_p=common.top_p,
            top_k=common.top_k, seed=common.seed, stop=common.stop, logprobs=logprobs,
            ignore_eos=common.ignore_eos)
    except ValueError as e:  # checked above already; the engine's own words if not
        raise bad(str(e), str(e).split(" ", 1)[0]) from None


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    """A completions prompt: (text, None) or (None, token ids)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt must not be empty", "prompt")
        return prompt, None
    if not isinstance(prompt, list):
        raise _type_error("prompt", "a string, a list of one string, or a list of token ids")
    if not prompt:
        raise bad("prompt must not be empty", "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, list(prompt)
    if all(isinstance(p, str | list) for p in prompt):
        raise bad(f"this server takes one prompt per request, got {len(prompt)}", "prompt",
                  "unsupported_value")
    raise _type_error("prompt", "a string, a list of one string, or a list of token ids")


def _messages(body: dict) -> list[dict]:
    """Chat messages checked and flattened to {role, content: str}."""
    messages = body.get("messages")
    if messages is None:
        raise bad("messages is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise _type_error("messages", "a list of message objects")
    if not messages:
        raise bad("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}",
                      f"{where}.role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            content = _text_parts(content, f"{where}.content")
        if not isinstance(content, str):
            raise _type_error(f"{where}.content", "a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def _text_parts(parts: list, where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad(f"{where}[{j}] must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                      "this server takes text only", f"{where}[{j}]", "unsupported_value")
        if not isinstance(part.get("text"), str):
            raise _type_error(f"{where}[{j}].text", "a string")
        texts.append(part["text"])
    return "".join(texts)


# ---- submitting ------------------------------------------------------------------------------
def _start(service: RunService, request: RunRequest, id_prefix: str, prompt_param: str,
           max_tokens_param: str | None) -> Run:
    """Submit, turning the engine's refusals into 400s that name the parameter to change."""
    try:
        return service.start(request, id_prefix=id_prefix)
    except EngineError as e:
        raise APIError(503, str(e), None, "engine_unavailable") from None
    except ValueError as e:
        message = str(e)
        n_prompt = len(request.prompt_ids)
        if "context window" not in message and "KV blocks" not in message:
            raise bad(message, prompt_param) from None  # empty, or token ids out of range
        # Too long: blame max_tokens when the caller set it and lowering it would help.
        param = (max_tokens_param if max_tokens_param and n_prompt < service.max_model_len
                 else prompt_param)
        raise bad(message, param, "context_length_exceeded") from None


def _default_max_tokens(service: RunService, n_prompt: int, prompt_param: str) -> int:
    """Chat without max_tokens: whatever room the context window (and KV pool) leaves."""
    room = service.max_context_tokens() - n_prompt
    if room < 1:
        raise bad(f"the prompt is {n_prompt} tokens, which fills the context window of "
                  f"{service.max_context_tokens()} tokens", prompt_param,
                  "context_length_exceeded")
    return room


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, run: Run) -> RunResult:
    """Wait for the whole output, cancelling the run if the client leaves first."""
    collect = asyncio.ensure_future(run.collect())
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()  # leaving run.events() cancels the request
    if collect not in done:
        raise APIError(499, "client closed the request", None, "client_closed_request")
    return collect.result()


def _raise_for_failure(result: RunResult) -> None:
    if result.finish.reason == "cancelled":
        raise APIError(503, f"request cancelled: {result.error}", None, "request_cancelled")
    if result.error is not None:
        raise APIError(500, f"the engine failed this request: {result.error}", None,
                       "engine_error")


# ---- response shapes ---------------------------------------------------------------------------
def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -Infinity; OpenAI uses -9999


def _usage(finish: FinishEvent) -> dict:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finish.cached_prompt_tokens}}


class _Shape:
    """Builds one endpoint's response objects for one run."""

    object_name = ""
    chunk_name = ""

    def __init__(self, service: RunService, run: Run, logprobs: bool, include_usage: bool):
        self.service, self.run = service, run
        self.logprobs, self.include_usage = logprobs, include_usage
        self.created = int(run.created)

    def _head(self, obj: str) -> dict:
        return {"id": self.run.id, "object": obj, "created": self.created,
                "model": self.service.model_name}

    def chunk(self, choice: dict) -> dict:
        out = self._head(self.chunk_name) | {"choices": [{"index": 0} | choice]}
        if self.include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last
        return out

    def usage_chunk(self, finish: FinishEvent) -> dict:
        return self._head(self.chunk_name) | {"choices": [], "usage": _usage(finish)}

    def opening(self) -> list[dict]:
        return []

    def token_chunk(self, event: TokenEvent) -> dict | None:
        raise NotImplementedError

    def final_chunk(self, finish: FinishEvent) -> dict:
        raise NotImplementedError

    def response(self, result: RunResult) -> dict:
        raise NotImplementedError


class _CompletionShape(_Shape):
    object_name = chunk_name = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._offset = 0  # characters of completion text released so far

    def _logprobs(self, events: list[TokenEvent]) -> dict | None:
        if not self.logprobs:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for e in events:
            text = self.service.token_text(e.token_id)
            tokens.append(text)
            token_lps.append(_lp(e.logprob))
            # The alternatives plus the sampled token: up to logprobs + 1 entries, as OpenAI.
            # Tokens that decode alike (partial UTF-8 bytes) share a key: the likeliest stays.
            top: dict[str, float] = {}
            for t, lp in e.top_logprobs:
                top.setdefault(self.service.token_text(t), _lp(lp))
            top.setdefault(text, _lp(e.logprob))
            tops.append(top)
            offsets.append(self._offset)
            self._offset += len(e.text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def token_chunk(self, event: TokenEvent) -> dict | None:
        if not event.text and not self.logprobs:
            return None  # text held back (stop string or partial character): nothing to say
        return self.chunk({"text": event.text, "logprobs": self._logprobs([event]),
                           "finish_reason": None})

    def final_chunk(self, finish: FinishEvent) -> dict:
        return self.chunk({"text": finish.text_delta, "logprobs": None,
                           "finish_reason": finish.reason})

    def response(self, result: RunResult) -> dict:
        choice = {"index": 0, "text": result.finish.text,
                  "logprobs": self._logprobs(result.tokens),
                  "finish_reason": result.finish.reason}
        return self._head(self.object_name) | {"choices": [choice],
                                               "usage": _usage(result.finish)}


class _ChatShape(_Shape):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.service.token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, events: list[TokenEvent]) -> dict | None:
        if not self.logprobs:
            return None
        content = [self._entry(e.token_id, e.logprob)
                   | {"top_logprobs": [self._entry(t, lp) for t, lp in e.top_logprobs]}
                   for e in events]
        return {"content": content, "refusal": None}

    def opening(self) -> list[dict]:
        return [self.chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})]

    def token_chunk(self, event: TokenEvent) -> dict | None:
        if not event.text and not self.logprobs:
            return None
        return self.chunk({"delta": {"content": event.text},
                           "logprobs": self._logprobs([event]), "finish_reason": None})

    def final_chunk(self, finish: FinishEvent) -> dict:
        delta = {"content": finish.text_delta} if finish.text_delta else {}
        return self.chunk({"delta": delta, "logprobs": None, "finish_reason": finish.reason})

    def response(self, result: RunResult) -> dict:
        message = {"role": "assistant", "content": result.finish.text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(result.tokens),
                  "finish_reason": result.finish.reason}
        return self._head(self.object_name) | {"choices": [choice],
                                               "usage": _usage(result.finish)}


def _sse(obj: dict | str) -> dict:
    return {"data": obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}


async def _stream(run: Run, shape: _Shape) -> AsyncIterator[dict]:
    """SSE events for one run. Leaving early (client gone) ends run.events(), which cancels."""
    for chunk in shape.opening():
        yield _sse(chunk)
    error: str | None = None
    async for event in run.events():
        if isinstance(event, TokenEvent):
            chunk = shape.token_chunk(event)
            if chunk is not None:
                yield _sse(chunk)
        elif isinstance(event, ErrorEvent):
            error = event.message
        elif isinstance(event, FinishEvent):
            if event.reason in ("error", "cancelled"):
                message = error or event.error or f"request {event.reason}"
                yield _sse(error_body(f"the request ended early: {message}", "server_error",
                                      None, "engine_error"))
            else:
                yield _sse(shape.final_chunk(event))
                if shape.include_usage:
                    yield _sse(shape.usage_chunk(event))
    yield _sse("[DONE]")


async def _respond(request: Request, run: Run, shape: _Shape, stream: bool) -> Response:
    if stream:
        # sse-starlette: keep-alive pings while a request waits in the queue, client-disconnect
        # detection that cancels the generator, and a graceful end on server shutdown.
        return EventSourceResponse(_stream(run, shape), sep="\n")
    result = await _collect(request, run)
    _raise_for_failure(result)
    return JSONResponse(shape.response(result))


# ---- routes ----------------------------------------------------------------------------------
def _service(request: Request) -> RunService:
    return request.app.state.runs


async def completions(request: Request) -> Response:
    service = _service(request)
    body = await read_json(request)
    _check_keys(body, _COMPLETIONS)
    _check_model(body, service)
    text, ids = _prompt(body)
    common = _common(body)
    max_tokens = _int(body, "max_tokens", lo=1)
    logprobs = _int(body, "logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS)
    params = _params(common, max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, logprobs or 0)
    prompt_ids = ids if ids is not None else service.encode(text)
    run = _start(service, RunRequest(prompt_ids, params, "/v1/completions", "api", text),
                 "cmpl", "prompt", "max_tokens" if max_tokens else None)
    shape = _CompletionShape(service, run, logprobs is not None, common.include_usage)
    return await _respond(request, run, shape, common.stream)


async def chat_completions(request: Request) -> Response:
    service = _service(request)
    body = await read_json(request)
    _check_keys(body, _CHAT)
    _check_model(body, service)
    messages = _messages(body)
    common = _common(body)
    # max_completion_tokens is the newer name; when both are set it wins, as at OpenAI.
    given = {name: value for name in ("max_completion_tokens", "max_tokens")
             if (value := _int(body, name, lo=1)) is not None}
    max_param = next(iter(given), None)
    max_tokens = given.get(max_param) if max_param else None
    logprobs = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs", lo=0, hi=MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs requires logprobs to be true", "top_logprobs")
    prompt_ids = service.encode_chat(messages)
    if max_tokens is None:
        max_tokens = _default_max_tokens(service, len(prompt_ids), "messages")
    params = _params(common, max_tokens, top or 0)
    run = _start(service, RunRequest(prompt_ids, params, "/v1/chat/completions", "api",
                                     None, messages),
                 "chatcmpl", "messages", max_param)
    shape = _ChatShape(service, run, logprobs, common.include_usage)
    return await _respond(request, run, shape, common.stream)


def _model_card(request: Request) -> dict:
    state = request.app.state
    return {"id": _service(request).model_name, "object": "model",
            "created": int(state.started_at), "owned_by": "batchscope",
            "max_model_len": _service(request).max_model_len}


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


async def get_model(request: Request) -> Response:
    model = request.path_params["model"]
    if model != _service(request).model_name:
        raise APIError(404, f"the model '{model}' does not exist", "model", "model_not_found")
    return JSONResponse(_model_card(request))


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]

__all__ = ["APIError", "error_body", "exception_handlers", "read_json", "routes"]
