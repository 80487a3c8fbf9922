"""The OpenAI-compatible JSON API: /v1/completions, /v1/chat/completions, /v1/models.

Each route reads the body into a checked request model (app/web/api/params.py, the models in
app/web/api/schemas.py), encodes the prompt, hands it to RunService, and shapes the engine's
events into OpenAI's responses, built as the response models and serialized by them: one JSON
object, or SSE `data: {chunk}` lines ending with `data: [DONE]`. Bad input is always a 4xx JSON
error in OpenAI's shape naming the parameter; a full queue is a 429 with Retry-After. Nothing
here touches MLX.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio.to_thread
import pydantic_core
from pydantic import BaseModel
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from app.runs import QueueFullError, Run, RunRequest, RunResult, RunService
from app.web.api.params import APIError, bad, read_json, read_request
from app.web.api.schemas import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_STOP,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
    error_body,
    error_model,
)
from app.web.api.tool_output import ToolOutput
from app.web.api.tool_output import plan as tool_plan
from engine.engine import EngineError
from engine.errors import RequestError
from engine.events import ErrorEvent, Event, FinishEvent, TokenEvent
from engine.sampling import SamplingParams

log = logging.getLogger("batchscope.api")


# ---- errors ----------------------------------------------------------------------------------
async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


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


# ---- submitting ------------------------------------------------------------------------------
INLINE_TOKENIZE_CHARS = 8192  # short enough that tokenizing inline beats a thread hop


async def _encode(encode: Callable[[Any], list[int]], prompt: Any, param: str,
                  chars: int) -> list[int]:
    """Tokenize a long prompt off the event loop (a prompt near the 1 MiB body limit keeps the
    real tokenizer busy far longer than a step, and it releases the GIL, so streams keep
    flowing meanwhile); a short one inline, without the thread hop. The tokenizer's refusals
    (a chat template raising) are the caller's 400."""
    from jinja2 import TemplateError

    try:
        if chars <= INLINE_TOKENIZE_CHARS:
            return encode(prompt)
        return await anyio.to_thread.run_sync(encode, prompt)
    except (TemplateError, ValueError) as e:
        raise bad(f"the {param} could not be tokenized: {e}", param) from None


def _params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
            logprobs: int) -> SamplingParams:
    try:
        return req.sampling(max_tokens, logprobs)
    except ValueError as e:  # the request models checked it already; the engine's words if not
        raise bad(str(e)) from None


def _start(service: RunService, run_request: RunRequest, id_prefix: str,
           req: CompletionRequest | ChatCompletionRequest) -> Run:
    return _start_choices(service, run_request, id_prefix, req, 1)[0]


def _start_choices(service: RunService, run_request: RunRequest, id_prefix: str,
                   req: CompletionRequest | ChatCompletionRequest, n: int) -> list[Run]:
    """Submit n choices, turning the engine's refusals into 4xx that name the parameter to
    change."""
    try:
        return service.start_choices(run_request, n, id_prefix=id_prefix)
    except QueueFullError as e:
        raise APIError(429, str(e), None, "queue_full", "rate_limit_error",
                       headers={"Retry-After": str(e.retry_after)}) from None
    except EngineError as e:
        raise APIError(503, str(e), None, "engine_unavailable") from None
    except RequestError as e:
        # The engine blames the prompt, max_tokens, logit_bias or the structured output (a
        # schema, regex or grammar it cannot compile); max_tokens is the caller's to
        # change only when they set it (under whichever name), otherwise the prompt is too long.
        param = (req.max_tokens_param if e.param == "max_tokens" and req.max_tokens_param
                 else "logit_bias" if e.param == "logit_bias"
                 else req.structured_param if e.param == "structured" else req.prompt_param)
        raise bad(e.message, param, e.code) from None


def _default_max_tokens(service: RunService, n_prompt: int, prompt_param: str,
                        cap: int | None) -> int:
    """Chat without max_tokens: whatever room the context window (and KV pool) leaves."""
    room = service.max_context_tokens() - n_prompt
    if room < 1:
        raise bad(f"the prompt is {n_prompt} tokens, which fills the context window of "
                  f"{service.max_context_tokens()} tokens", prompt_param,
                  "context_length_exceeded")
    return room if cap is None else min(room, cap)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, run: Run) -> RunResult:
    return (await _collect_all(request, [run]))[0]


async def _collect_all(request: Request, runs: list[Run]) -> list[RunResult]:
    """Wait for every run's whole output, cancelling them all if the client leaves first."""
    collect = asyncio.ensure_future(asyncio.gather(*(run.collect() for run in runs)))
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()  # leaving run.events() cancels the request
            for run in runs:  # also those whose collect had not started
                run.cancel()
    if collect not in done:
        raise APIError(499, "client closed the request", None, "client_closed_request")
    return collect.result()


def _best(results: list[RunResult], n: int) -> list[RunResult]:
    """best_of: the n results with the highest cumulative logprob of their sampled tokens
    (ties keep their order); all of them, in order, when there are n."""
    if len(results) == n:
        return results
    return sorted(results, key=lambda r: -math.fsum(t.logprob for t in r.tokens))[:n]


def _raise_for_failure(result: RunResult) -> None:
    if result.finish.reason == "cancelled":
        raise APIError(503, f"request cancelled: {result.error}", None, "request_cancelled")
    if result.error is not None:
        raise APIError(500, f"the engine failed this request: {result.error}", None,
                       "engine_error")


# ---- response shapes ---------------------------------------------------------------------------
def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -Infinity; OpenAI uses -9999


def _usage(finishes: list[FinishEvent]) -> Usage:
    """The prompt once (as the first choice computed it), the tokens of every choice made."""
    first = finishes[0]
    completion = sum(f.completion_tokens for f in finishes)
    return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=completion,
                 total_tokens=first.prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=first.cached_prompt_tokens))


class _Shape:
    """Builds one endpoint's response models for the runs of one request (a choice each; the
    first run's id is the response's). They are sent without the keys left unset (a chunk's
    usage, a delta's role: `_out`)."""

    object_name = ""
    chunk_name = ""
    Response: type[Completion] | type[ChatCompletion]
    Chunk: type[CompletionChunk] | type[ChatCompletionChunk]

    def __init__(self, service: RunService, runs: list[Run], logprobs: bool,
                 include_usage: bool, token_ids: bool = False):
        """token_ids: logprobs name tokens "token_id:N" (vLLM's return_tokens_as_token_ids),
        not by their text."""
        self.service, self.id, self.choices = service, runs[0].id, len(runs)
        self.logprobs, self.include_usage = logprobs, include_usage
        self.token_ids = token_ids
        self.created = int(runs[0].created)
        self._text_frames: dict[int, tuple[bytes, bytes]] = {}  # per choice: see token_sse

    def token_name(self, token_id: int) -> str:
        """How logprobs name a token: its text, or "token_id:N"."""
        return f"token_id:{token_id}" if self.token_ids else self.service.token_text(token_id)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.service.model_name}

    def chunk(self, choice: BaseModel) -> BaseModel:
        # OpenAI: usage is null on every chunk but the last.
        usage = {"usage": None} if self.include_usage else {}
        return self.Chunk(**self._head(self.chunk_name), choices=[choice], **usage)

    def usage_chunk(self, finishes: list[FinishEvent]) -> BaseModel:
        return self.Chunk(**self._head(self.chunk_name), choices=[], usage=_usage(finishes))

    def opening(self) -> list[BaseModel]:
        return []

    def token_chunk(self, event: TokenEvent, index: int) -> BaseModel | None:
        raise NotImplementedError

    def token_sse(self, event: TokenEvent, index: int) -> bytes | None:
        """`_sse(self.token_chunk(event, index))`, without building the models for every token.

        Without logprobs a token's chunk differs from the choice's next only in its text, so
        the chunk is serialized once per choice with a marker for the text, and each token puts
        its own text, as the models serialize a string, between the two halves."""
        if self.logprobs:
            chunk = self.token_chunk(event, index)
            return None if chunk is None else _sse(chunk)
        if not event.text:
            return None  # as token_chunk: nothing to say
        frame = self._text_frames.get(index)
        if frame is None:
            marker = pydantic_core.to_json(f"text-{uuid.uuid4().hex}")
            chunk = self.token_chunk(dataclasses.replace(event, text=marker[1:-1].decode()),
                                     index)
            assert chunk is not None
            head, *tail = _sse(chunk).split(marker)
            if len(tail) != 1:  # the marker must stand for the text alone
                raise AssertionError("the token chunk's text marker was not found once")
            frame = self._text_frames[index] = (head, tail[0])
        head, tail = frame
        return head + pydantic_core.to_json(event.text) + tail

    def final_chunk(self, finish: FinishEvent, index: int) -> BaseModel:
        raise NotImplementedError

    def final_sse(self, finish: FinishEvent, index: int) -> bytes:
        """The choice's last events (a chat with tools may have calls left to send)."""
        return _sse(self.final_chunk(finish, index))

    def response(self, results: list[RunResult], usage: Usage) -> BaseModel:
        """The choices' results in order (best_of: those kept); usage: of every choice made."""
        raise NotImplementedError


class _CompletionShape(_Shape):
    object_name = chunk_name = "text_completion"
    Response, Chunk = Completion, CompletionChunk

    def __init__(self, *args: Any, echo: str = "", **kwargs: Any):
        """echo: the prompt's text, put before each choice's (empty: echo is off)."""
        super().__init__(*args, **kwargs)
        self.echo = echo
        self._offsets = [0] * self.choices  # characters of each choice's text released so far

    def _logprobs(self, events: list[TokenEvent], index: int) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for e in events:
            text = self.token_name(e.token_id)
            tokens.append(text)
            token_lps.append(_lp(e.logprob))
            # The alternatives plus the sampled token: up to logprobs + 1 entries, as OpenAI.
            # Tokens that decode alike (partial UTF-8 bytes) share a key: the likeliest stays.
            top: dict[str, float] = {}
            for t, lp in e.top_logprobs:
                top.setdefault(self.token_name(t), _lp(lp))
            top.setdefault(text, _lp(e.logprob))
            tops.append(top)
            offsets.append(self._offsets[index])
            self._offsets[index] += len(e.text)
        return CompletionLogprobs(tokens=tokens, token_logprobs=token_lps, top_logprobs=tops,
                                  text_offset=offsets)

    def opening(self) -> list[BaseModel]:
        if not self.echo:
            return []
        return [self.chunk(CompletionChunkChoice(index=i, text=self.echo, logprobs=None,
                                                 finish_reason=None))
                for i in range(self.choices)]

    def token_chunk(self, event: TokenEvent, index: int) -> BaseModel | None:
        if not event.text and not self.logprobs:
            return None  # text held back (stop string or partial character): nothing to say
        return self.chunk(CompletionChunkChoice(index=index, text=event.text,
                                                logprobs=self._logprobs([event], index),
                                                finish_reason=None))

    def final_chunk(self, finish: FinishEvent, index: int) -> BaseModel:
        return self.chunk(CompletionChunkChoice(index=index, text=finish.text_delta,
                                                logprobs=None, finish_reason=finish.reason))

    def response(self, results: list[RunResult], usage: Usage) -> BaseModel:
        choices = [CompletionChoice(index=i, text=self.echo + r.finish.text,
                                    logprobs=self._logprobs(r.tokens, i),
                                    finish_reason=r.finish.reason)
                   for i, r in enumerate(results)]
        return Completion(**self._head(self.object_name), choices=choices, usage=usage)


class _ChatShape(_Shape):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    Response, Chunk = ChatCompletion, ChatCompletionChunk

    def __init__(self, *args: Any, tools: ToolOutput | None = None, **kwargs: Any):
        """tools: the answer is read for tool calls (app/web/api/tool_output.py)."""
        super().__init__(*args, **kwargs)
        self.tools = tools

    def _deltas_sse(self, index: int, deltas: list[Delta], reason: str | None = None) -> bytes:
        out = [ChatChunkChoice(index=index, delta=d, logprobs=None, finish_reason=None)
               for d in deltas]
        if reason is not None:
            out.append(ChatChunkChoice(index=index, delta=Delta(), logprobs=None,
                                       finish_reason=reason))
        return b"".join(_sse(self.chunk(choice)) for choice in out)

    def token_sse(self, event: TokenEvent, index: int) -> bytes | None:
        if self.tools is None:
            return super().token_sse(event, index)
        return self._deltas_sse(index, self.tools.feed(index, event.text)) or None

    def final_sse(self, finish: FinishEvent, index: int) -> bytes:
        if self.tools is None:
            return super().final_sse(finish, index)
        return self._deltas_sse(index, *self.tools.finish(index, finish))

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.token_name(token_id), "logprob": _lp(logprob),
                "bytes": list(self.service.token_bytes(token_id))}

    def _logprobs(self, events: list[TokenEvent]) -> ChatLogprobs | None:
        if not self.logprobs:
            return None
        content = [TokenLogprob(**self._entry(e.token_id, e.logprob),
                                top_logprobs=[TopLogprob(**self._entry(t, lp))
                                              for t, lp in e.top_logprobs])
                   for e in events]
        return ChatLogprobs(content=content, refusal=None)

    def opening(self) -> list[BaseModel]:
        return [self.chunk(ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""),
                                           logprobs=None, finish_reason=None))
                for i in range(self.choices)]

    def token_chunk(self, event: TokenEvent, index: int) -> BaseModel | None:
        if not event.text and not self.logprobs:
            return None
        return self.chunk(ChatChunkChoice(index=index, delta=Delta(content=event.text),
                                          logprobs=self._logprobs([event]), finish_reason=None))

    def final_chunk(self, finish: FinishEvent, index: int) -> BaseModel:
        delta = Delta(content=finish.text_delta) if finish.text_delta else Delta()
        return self.chunk(ChatChunkChoice(index=index, delta=delta, logprobs=None,
                                          finish_reason=finish.reason))

    def _message(self, finish: FinishEvent) -> tuple[AssistantMessage, str]:
        if self.tools is not None:
            return self.tools.message(finish)
        return (AssistantMessage(role="assistant", content=finish.text, refusal=None),
                finish.reason)

    def response(self, results: list[RunResult], usage: Usage) -> BaseModel:
        choices = [ChatChoice(index=i, message=message, logprobs=self._logprobs(r.tokens),
                              finish_reason=reason)
                   for i, r in enumerate(results)
                   for message, reason in [self._message(r.finish)]]
        return ChatCompletion(**self._head(self.object_name), choices=choices, usage=usage)


def _out(model: BaseModel) -> bytes:
    """A response model as JSON: the keys it leaves unset (a chunk's usage, a delta's role)
    stay out."""
    return model.model_dump_json(exclude_unset=True).encode()


def _json(model: BaseModel) -> Response:
    return Response(_out(model), media_type="application/json")


def _sse(model: BaseModel) -> bytes:
    """One SSE event, encoded as sse-starlette encodes `{"data": json}` with sep "\n" (JSON
    holds no line break), so that it passes the bytes through as they are."""
    return _SSE_DATA + _out(model) + _SSE_END


_SSE_DATA, _SSE_END = b"data: ", b"\n\n"


async def _events(runs: list[Run]) -> AsyncIterator[tuple[int, Event]]:
    """Each run's events with its choice index, as they come, until every run has finished.
    Leaving early (client gone) cancels every run."""
    if len(runs) == 1:  # no hand-over: run.events() cancels when left
        async for event in runs[0].events():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    async def forward(index: int, run: Run) -> None:
        async for event in run.events():
            queue.put_nowait((index, event))

    tasks = [asyncio.ensure_future(forward(i, run)) for i, run in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            index, event = await queue.get()
            left -= isinstance(event, FinishEvent)
            yield index, event
    finally:
        for task, run in zip(tasks, runs, strict=True):
            if not task.done():
                task.cancel()
                run.cancel()  # also one whose forward had not started


async def _stream(runs: list[Run], shape: _Shape) -> AsyncIterator[bytes]:
    """SSE events for the runs of one request, each chunk naming its choice's index."""
    for chunk in shape.opening():
        yield _sse(chunk)
    errors: dict[int, str] = {}
    finishes: list[FinishEvent] = []
    async for index, event in _events(runs):
        if isinstance(event, TokenEvent):
            data = shape.token_sse(event, index)
            if data is not None:
                yield data
        elif isinstance(event, ErrorEvent):
            errors[index] = event.message
        elif isinstance(event, FinishEvent):
            if event.reason in ("error", "cancelled"):
                message = errors.get(index) or event.error or f"request {event.reason}"
                yield _sse(error_model(f"the request ended early: {message}",
                                       "server_error", None, "engine_error"))
            else:
                yield shape.final_sse(event, index)
                finishes.append(event)
    if shape.include_usage and len(finishes) == len(runs):
        finishes.sort(key=lambda f: f.request_id != runs[0].id)  # the first choice's prompt
        yield _sse(shape.usage_chunk(finishes))
    yield _SSE_DATA + b"[DONE]" + _SSE_END


async def _respond(request: Request, runs: list[Run], shape: _Shape, stream: bool,
                   n: int) -> Response:
    """The n choices (best_of: the n best of the runs) as one response or one stream."""
    if stream:
        # sse-starlette: keep-alive pings while a request waits in the queue, client-disconnect
        # detection that cancels the generator, and a graceful end on server shutdown.
        return EventSourceResponse(_stream(runs, shape), sep="\n")
    results = await _collect_all(request, runs)
    for result in results:
        _raise_for_failure(result)
    return _json(shape.response(_best(results, n), _usage([r.finish for r in results])))


# ---- routes ----------------------------------------------------------------------------------
def _service(request: Request) -> RunService:
    return request.app.state.runs


async def completions(request: Request) -> Response:
    service = _service(request)
    req = await read_request(request, CompletionRequest)
    text = req.prompt if isinstance(req.prompt, str) else None  # or token ids
    prompt_ids = (await _encode(service.encode, text, "prompt", len(text)) if text is not None
                  else req.prompt)
    cap = request.app.state.settings.max_tokens_limit or DEFAULT_COMPLETION_MAX_TOKENS
    if req.echo and req.logprobs is not None:
        raise bad("echo cannot be combined with logprobs: this server does not compute the "
                  "prompt's logprobs", "echo")
    params = _params(req, req.max_tokens or min(DEFAULT_COMPLETION_MAX_TOKENS, cap),
                     req.logprobs or 0)
    n = req.n or 1
    runs = _start_choices(service, RunRequest(prompt_ids, params, "/v1/completions", "api",
                                              text), "cmpl", req, req.best_of or n)
    echo = "" if not req.echo else text if text is not None else service.decode(prompt_ids)
    shape = _CompletionShape(service, runs[:n], req.logprobs is not None, req.include_usage,
                             bool(req.return_tokens_as_token_ids), echo=echo)
    return await _respond(request, runs, shape, req.stream, n)


async def chat_completions(request: Request) -> Response:
    service = _service(request)
    req = await read_request(request, ChatCompletionRequest)
    tools = req.tool_request
    if tools is not None and req.logprobs:
        raise bad("logprobs cannot be combined with tools: the answer's text is read into "
                  "tool calls", "logprobs")
    plan = tool_plan(service, request.app.state.settings.tool_call_parser, tools, req.chat())
    messages = plan.messages
    prompt_ids = await _encode(plan.encode, messages, "messages",
                               sum(len(m["content"]) for m in messages))
    max_tokens = req.max_new_tokens
    if max_tokens is None:
        max_tokens = _default_max_tokens(service, len(prompt_ids), "messages",
                                         request.app.state.settings.max_tokens_limit)
    params = plan.sampling(_params(req, max_tokens, req.top_logprobs or 0))
    n = req.n or 1
    record = ({**req.model_dump(include={"tools", "tool_choice"}, exclude_none=True),
               "tool_parser": plan.parser.name if plan.parser else None} if req.tools else {})
    runs = _start_choices(service, RunRequest(prompt_ids, params, "/v1/chat/completions",
                                              "api", None, messages, record), "chatcmpl", req, n)
    shape = _ChatShape(service, runs, bool(req.logprobs), req.include_usage,
                       bool(req.return_tokens_as_token_ids), tools=plan.output(n))
    return await _respond(request, runs, shape, req.stream, n)


def _model_card(request: Request) -> ModelCard:
    state = request.app.state
    return ModelCard(id=_service(request).model_name, object="model",
                     created=int(state.started_at), owned_by="batchscope",
                     max_model_len=_service(request).max_model_len)


async def list_models(request: Request) -> Response:
    return _json(ModelList(object="list", data=[_model_card(request)]))


async def get_model(request: Request) -> Response:
    model = request.path_params["model"]
    if model != _service(request).model_name:
        raise APIError(404, f"the model '{model}' does not exist", "model", "model_not_found")
    return _json(_model_card(request))


routes = [
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]

__all__ = ["MAX_STOP", "APIError", "error_body", "exception_handlers", "read_json", "routes"]
