"""GET /openapi.json: an OpenAPI 3.1 description of the JSON API.

It covers the OpenAI-compatible `/v1/*` routes (request bodies with their types and ranges,
responses, errors in OpenAI's shape, streams as `text/event-stream`), generated from the models
that check the requests and the answers (app/web/api/schemas.py), Anthropic's `/v1/messages`
(app/web/api/messages.py: its models, errors in Anthropic's shape), and the pages' JSON twins
(`/runs.json`, `/runs/{run_id}.json`, `/compare.json`, `/dashboard.json`, `/steps.json`,
`/calibration.json`, `/divergence.json`, `/benchmarks.json`, `/benchmarks/{run_id}.json`), from
the models of their contexts (app/web/views.py).
Ranges that depend on the server (vocabulary size, context window, --max-tokens-limit,
--max-waiting-requests) are filled in from the running app, so the document describes this
server, not a generic one.

tests/app/web/test_openapi.py runs schemathesis against a live server with it, checking that no
input makes a 5xx, that responses match these schemas, and that bodies the schemas forbid are
refused with a 4xx.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import GenerateJsonSchema, models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.web import views
from app.web.api import messages, schemas

JSON = "application/json"
SSE = "text/event-stream"
REQUESTS = (schemas.CompletionRequest, schemas.ChatCompletionRequest, messages.MessagesRequest)
RESPONSES = (schemas.Completion, schemas.ChatCompletion, schemas.CompletionChunk,
             schemas.ChatCompletionChunk, schemas.ModelList, schemas.ErrorResponse,
             messages.AnthropicMessage, *messages.STREAM_EVENTS.values())


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_response(description: str, headers: dict | None = None) -> dict:
    out: dict[str, Any] = {"description": description,
                           "content": {JSON: {"schema": _ref("ErrorResponse")}}}
    if headers:
        out["headers"] = headers
    return out


def _json_response(description: str, schema: dict) -> dict:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _common_errors(*statuses: str) -> dict:
    responses = {
        "400": {"$ref": "#/components/responses/BadRequest"},
        "401": {"$ref": "#/components/responses/Unauthorized"},
        "403": {"$ref": "#/components/responses/Forbidden"},
        "404": {"$ref": "#/components/responses/NotFound"},
        "405": {"$ref": "#/components/responses/MethodNotAllowed"},
        "413": {"$ref": "#/components/responses/TooLarge"},
        "429": {"$ref": "#/components/responses/QueueFull"},
        "500": {"$ref": "#/components/responses/ServerError"},
        "503": {"$ref": "#/components/responses/Unavailable"},
    }
    return {s: responses[s] for s in statuses}


# ---- schemas -----------------------------------------------------------------------------------
class _Untitled(GenerateJsonSchema):
    """Without a title per property (each would repeat its name)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _fill(node: Any, server: dict[str, dict]) -> Any:
    """This server's values where the models left a marker (schemas.SERVER)."""
    if isinstance(node, dict):
        if (key := node.pop(schemas.SERVER, None)) is not None:
            node.update(server[key])
        for value in node.values():
            _fill(value, server)
    elif isinstance(node, list):
        for value in node:
            _fill(value, server)
    return node


def _schemas(model: str, vocab: int | None, max_tokens: int) -> dict:
    """The /v1 schemas from the request models (as validated) and the responses (as sent), and
    the pages' JSON twins from their context models (as sent); the models they use are
    schemas of their own."""
    _, doc = models_json_schema(
        [(m, "validation") for m in REQUESTS]
        + [(m, "serialization") for m in (*RESPONSES, *views.TWINS)],
        ref_template="#/components/schemas/{model}", schema_generator=_Untitled)
    server = {"model": {"enum": [model]}, "max_tokens": {"maximum": max_tokens},
              "vocab": {"maximum": vocab - 1} if vocab else {}}
    return _fill(doc["$defs"], server)


def _event(chunk: str) -> dict:
    """A server-sent event: its `data` is a chunk (JSON), an error (JSON, when the engine fails
    the request mid-stream), or the final "[DONE]"."""
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": JSON,
         "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}}]}}}


def _named_event() -> dict:
    """An event of the Messages API's stream: its name, and its JSON (with the same `type`)."""
    return {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"enum": list(messages.STREAM_EVENTS)},
        "data": {"type": "string", "contentMediaType": JSON, "contentSchema": {
            "anyOf": [_ref(m.__name__) for m in messages.STREAM_EVENTS.values()]}}}}


# ---- operations --------------------------------------------------------------------------------
def _messages(retry_after: dict) -> dict:
    """POST /v1/messages: Anthropic's shapes, its errors too (but the security layer's)."""
    def error(description: str, headers: dict | None = None) -> dict:
        out: dict[str, Any] = {"description": description,
                               "content": {JSON: {"schema": _ref("AnthropicError")}}}
        return out | ({"headers": headers} if headers else {})

    return {
        "summary": "Answer a conversation (Anthropic's Messages API)",
        "requestBody": {"required": True,
                        "content": {JSON: {"schema": _ref("MessagesRequest")}}},
        "responses": {
            "200": {"description": "the message, or with stream: true Anthropic's named "
                                   "server-sent events (message_start ... message_stop)",
                    "content": {JSON: {"schema": _ref("AnthropicMessage")},
                                SSE: {"schema": _ref("AnthropicMessageEvent")}}},
            "400": error("bad input: the message names the parameter"),
            "404": error("no such model"),
            "413": error("the body is too large"),
            "429": error("too many requests are waiting", retry_after),
            "500": error("the engine failed the request"),
            "503": error("the engine is not running, or the request was cancelled"),
            **_common_errors("401", "403"),
        },
    }


def _generation(summary: str, request: str, response: str) -> dict:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the completion, or with stream: true its chunks as "
                                   "server-sent events (`data: {chunk}` ... `data: [DONE]`)",
                    "content": {JSON: {"schema": _ref(response)},
                                SSE: {"schema": _ref(f"{response}Event")}}},
            **_common_errors("400", "401", "403", "404", "413", "429", "500", "503"),
        },
    }


def _twin(summary: str, schema: str, parameters: list | None = None,
          errors: tuple[str, ...] = ("401",), extra: dict | None = None) -> dict:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": _json_response("the page's context as JSON", _ref(schema)),
                      **(extra or {}), **_common_errors(*errors)},
    }
    if parameters:
        op["parameters"] = parameters
    return {"get": op}


def _query(name: str, schema: dict, required: bool = False, description: str = "") -> dict:
    out = {"name": name, "in": "query", "required": required, "schema": schema}
    if description:
        out["description"] = description
    return out


def _query_int(lo: int, hi: int | None = None) -> dict:
    """An integer query parameter; empty (as an HTML form sends it) means the default."""
    number: dict[str, Any] = {"type": "integer", "minimum": lo}
    if hi is not None:
        number["maximum"] = hi
    return {"anyOf": [number, {"type": "string", "maxLength": 0}],
            "description": "empty: the default"}


def build(*, model: str, vocab: int | None, context: int, max_tokens: int | None,
          max_waiting: int, max_num_seqs: int, max_body_bytes: int) -> dict:
    """The OpenAPI document for a server with these limits."""
    cap = min(max_tokens, context) if max_tokens else context
    retry_after = {"Retry-After": {"description": "seconds to wait before retrying",
                                   "required": True,
                                   "schema": {"type": "integer", "minimum": 1}}}
    no_db = ("503",)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "batchscope",
            "version": "0.1.0",
            "description": (
                f"OpenAI-compatible API and the pages' JSON twins, serving {model!r} "
                f"(context {context} tokens). Limits: request bodies up to {max_body_bytes} "
                f"bytes (413), max_tokens up to {cap}, at most {max_num_seqs} requests running "
                f"and {max_waiting} waiting (429 with Retry-After beyond). Errors use OpenAI's "
                "shape (/v1/messages: Anthropic's) and name the parameter to change. Unknown "
                "request fields are refused."),
        },
        "paths": {
            "/v1/completions": {"post": _generation(
                "Complete a prompt", "CompletionRequest", "Completion")},
            "/v1/chat/completions": {"post": _generation(
                "Answer a chat", "ChatCompletionRequest", "ChatCompletion")},
            "/v1/messages": {"post": _messages(retry_after)},
            "/v1/models": {"get": {
                "summary": "The served model",
                "responses": {"200": _json_response("one model", _ref("ModelList")),
                              **_common_errors("401")}}},
            "/v1/models/{model}": {"get": {
                "summary": "One model",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string", "enum": [model]},
                                "description": "the served model's id; others: 404"}],
                "responses": {"200": _json_response("the model", _ref("ModelCard")),
                              **_common_errors("401", "404")}}},
            "/runs.json": _twin("Recorded runs, newest first", "RunList", [
                _query("page", _query_int(1)),
                _query("per_page", _query_int(1, 500)),
                _query("model", {"type": "string"}),
                _query("kernel_policy", {"type": "string"}),
                _query("finish_reason", {"type": "string"}),
                _query("q", {"type": "string"}, description="substring of prompt or output"),
            ], ("400", "401", "503")),
            "/runs/{run_id}.json": _twin(
                "One recorded run: tokens, logprobs, the steps it shared", "Run",
                [{"name": "run_id", "in": "path", "required": True,
                  "schema": {"type": "string", "minLength": 1}}],
                ("401", "404", "503"),
                {"202": _json_response("still running, or not saved yet",
                                       _ref("RunPending"))}),
            "/compare.json": _twin("Two recorded runs side by side", "Comparison", [
                _query("a", {"type": "string", "minLength": 1}, required=True),
                _query("b", {"type": "string", "minLength": 1}, required=True),
            ], ("400", "401", *no_db)),
            "/dashboard.json": _twin("The engine now: batch, KV blocks, recent steps",
                                     "Dashboard"),
            "/steps.json": _twin("Step records after a step id", "Steps", [
                _query("since", _query_int(0)),
                _query("limit", _query_int(1, 2048)),
            ], ("400", "401")),
            "/calibration.json": _twin("The kernel-path calibration for this model",
                                       "Calibration"),
            "/divergence.json": _twin("Divergence experiments (saved in the runs database; "
                                      "in memory without one)", "Divergence",
                                      [_query("id", {"type": "string"})], ("401", "404")),
            "/benchmarks.json": _twin("Recorded serving benchmarks, newest first", "Benchmarks",
                                      [_query("runs", {"type": "string"},
                                              description="the run ids to plot, separated by "
                                                          "commas (empty: the newest 6)")],
                                      ("400", "401", "404", *no_db)),
            "/benchmarks/{run_id}.json": _twin(
                "One recorded serving benchmark: its report and requests", "Benchmark",
                [{"name": "run_id", "in": "path", "required": True,
                  "schema": {"type": "string", "minLength": 1}}],
                ("401", "404", *no_db)),
        },
        "components": {
            "schemas": _schemas(model, vocab, cap) | {
                "CompletionEvent": _event("CompletionChunk"),
                "ChatCompletionEvent": _event("ChatCompletionChunk"),
                "AnthropicMessageEvent": _named_event(),
            },
            "responses": {
                "BadRequest": _error_response("bad input: the error names the parameter"),
                "Unauthorized": _error_response("an API key is required (--api-key)"),
                "Forbidden": _error_response("a cross-site request was refused"),
                "NotFound": _error_response("no such model, run or route"),
                "MethodNotAllowed": _error_response("the route takes another method"),
                "TooLarge": _error_response(f"the body is over {max_body_bytes} bytes"),
                "QueueFull": _error_response("too many requests are waiting", retry_after),
                "ServerError": _error_response("the engine failed the request"),
                "Unavailable": _error_response(
                    "the engine is not running, the request was cancelled, or (pages) "
                    "there is no runs database"),
            },
        },
    }


def for_app(state: Any) -> dict:
    """The document for a running app (its engine, settings and limits)."""
    settings, engine = state.settings, state.engine
    loaded = engine.loaded
    return build(
        model=loaded.name, vocab=(loaded.config or {}).get("vocab_size"),
        context=state.runs.max_context_tokens(),
        max_tokens=getattr(settings, "max_tokens_limit", None),
        max_waiting=settings.max_waiting_requests, max_num_seqs=engine.config.max_num_seqs,
        max_body_bytes=settings.max_body_bytes)


async def openapi_json(request: Request) -> Response:
    state = request.app.state
    doc = getattr(state, "openapi", None)
    if doc is None:
        doc = state.openapi = for_app(state)
    return JSONResponse(doc)


routes = [Route("/openapi.json", openapi_json, methods=["GET"])]
