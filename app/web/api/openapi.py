"""GET /openapi.json: an OpenAPI 3.1 description of the JSON API.

It covers the OpenAI-compatible `/v1/*` routes (request bodies with their types and ranges,
responses, errors in OpenAI's shape, streams as `text/event-stream`), generated from the models
that check the requests and the answers (app/web/api/schemas.py), and the pages' JSON twins
(`/runs.json`, `/runs/{run_id}.json`, `/compare.json`, `/dashboard.json`, `/steps.json`,
`/calibration.json`, `/divergence.json`), written here. Ranges that depend on the server
(vocabulary size, context window, --max-tokens-limit, --max-waiting-requests) are filled in from
the running app, so the document describes this server, not a generic one.

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

from app.web.api import schemas

JSON = "application/json"
SSE = "text/event-stream"
REQUESTS = (schemas.CompletionRequest, schemas.ChatCompletionRequest)
RESPONSES = (schemas.Completion, schemas.ChatCompletion, schemas.CompletionChunk,
             schemas.ChatCompletionChunk, schemas.ModelList, schemas.ErrorResponse)


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


def _api_schemas(model: str, vocab: int | None, max_tokens: int) -> dict:
    """The /v1 schemas from the request models (as validated) and the responses (as sent)."""
    _, doc = models_json_schema(
        [(m, "validation") for m in REQUESTS] + [(m, "serialization") for m in RESPONSES],
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


_NUM = {"type": ["number", "null"]}
_NULLABLE_STR = {"type": ["string", "null"]}
# The pages' JSON twins: the same context their templates render.
TWINS = {
    "RunSummary": {
        "type": "object", "required": ["id", "created_at", "model", "status"],
        "properties": {
            "id": {"type": "string"}, "created_at": {"type": "number"},
            "source": {"type": "string"}, "endpoint": {"type": "string"},
            "model": {"type": "string"}, "weights": {"type": "string"},
            "kernel_policy": {"type": "string"}, "status": {"type": "string"},
            "finish_reason": _NULLABLE_STR, "prompt_preview": _NULLABLE_STR,
            "output_preview": _NULLABLE_STR,
            "prompt_tokens": {"type": ["integer", "null"]},
            "completion_tokens": {"type": ["integer", "null"]},
            "ttft": _NUM, "e2e_latency": _NUM,
        },
    },
    "RunList": {
        "type": "object",
        "required": ["runs", "total", "page", "per_page", "pages", "filters", "links"],
        "properties": {
            "runs": {"type": "array", "items": _ref("RunSummary")},
            "total": {"type": "integer", "minimum": 0},
            "page": {"type": "integer", "minimum": 1},
            "per_page": {"type": "integer", "minimum": 1},
            "pages": {"type": "integer", "minimum": 1},
            "filters": {"type": "object", "additionalProperties": {"type": "string"}},
            "options": {"type": "object"},
            "links": {"type": "object", "required": ["prev", "next", "json"],
                      "properties": {"prev": _NULLABLE_STR, "next": _NULLABLE_STR,
                                     "json": {"type": "string"}}},
        },
    },
    "TokenView": {
        "type": "object", "required": ["idx", "token_id", "logprob", "alternatives"],
        "properties": {
            "idx": {"type": "integer", "minimum": 0}, "token_id": {"type": "integer"},
            "text": _NULLABLE_STR, "logprob": _NUM, "offset": _NUM, "gap": _NUM,
            "step": {"type": ["integer", "null"]},
            "alternatives": {"type": "array", "items": {
                "type": "object", "required": ["token_id", "logprob"],
                "properties": {"token_id": {"type": "integer"}, "text": _NULLABLE_STR,
                               "logprob": _NUM}}},
        },
    },
    "Run": {
        "type": "object",
        "required": ["id", "created_at", "model", "status", "params", "tokens", "steps",
                     "metrics", "prompt_token_ids"],
        "properties": {
            "id": {"type": "string"}, "session_id": {"type": ["integer", "null"]},
            "created_at": {"type": "number"}, "model": {"type": "string"},
            "status": {"type": "string"}, "finish_reason": _NULLABLE_STR,
            "error": _NULLABLE_STR, "prompt_text": _NULLABLE_STR,
            "output_text": _NULLABLE_STR, "text_tail": {"type": "string"},
            "messages": {"type": ["array", "null"]},
            "params": {"type": ["object", "null"]},
            "prompt_token_ids": {"type": "array", "items": {"type": "integer"}},
            "output_token_ids": {"type": ["array", "null"], "items": {"type": "integer"}},
            "tokens": {"type": "array", "items": _ref("TokenView")},
            "steps": {"type": "array", "items": {"type": "object", "required": ["step"]}},
            "metrics": {"type": "object", "properties": {
                "ttft": _NUM, "tpot": _NUM, "e2e_latency": _NUM, "queue_time": _NUM,
                "tokens_per_s": _NUM}},
        },
    },
    "RunPending": {
        "type": "object", "required": ["id", "status", "message"],
        "properties": {"id": {"type": "string"},
                       "status": {"enum": ["running", "saving"]},
                       "message": {"type": "string"}},
    },
    "Comparison": {
        "type": "object",
        "required": ["a", "b", "params", "params_differing", "tokens", "first_difference",
                     "same_tokens"],
        "properties": {
            "a": {"type": "object", "required": ["id"]},
            "b": {"type": "object", "required": ["id"]},
            "params": {"type": "array", "items": {
                "type": "object", "required": ["name", "a", "b", "differs"],
                "properties": {"name": {"type": "string"},
                               "differs": {"type": "boolean"}}}},
            "params_differing": {"type": "array", "items": {"type": "string"}},
            "tokens": {"type": "array", "items": {
                "type": "object", "required": ["idx", "a", "b", "same", "logprob_diff"],
                "properties": {"idx": {"type": "integer"}, "same": {"type": "boolean"},
                               "logprob_diff": _NUM,
                               "a": {"anyOf": [{"type": "null"}, _ref("TokenView")]},
                               "b": {"anyOf": [{"type": "null"}, _ref("TokenView")]}}}},
            "first_difference": {"type": ["integer", "null"]},
            "same_tokens": {"type": "integer", "minimum": 0},
        },
    },
    "Dashboard": {
        "type": "object",
        "required": ["model", "config", "frames_per_s", "chart_steps", "state", "steps"],
        "properties": {
            "model": {"type": "string"},
            "config": {"type": "object", "required": ["max_num_seqs", "block_size",
                                                      "num_kv_blocks"]},
            "speculation": {"type": "object", "required": ["enabled", "describe"],
                            "description": "the engine's speculative decoding setting; each "
                            "step's `speculation` says whether it speculated",
                            "properties": {"enabled": {"type": "boolean"},
                                           "describe": {"type": "string"}}},
            "frames_per_s": {"type": "number"}, "chart_steps": {"type": "integer"},
            "acceptance_steps": {"type": "integer", "minimum": 1},
            "state": {"type": "object",
                      "required": ["time", "step", "running", "waiting", "idle", "kv"],
                      "properties": {"running": {"type": "integer", "minimum": 0},
                                     "waiting": {"type": "integer", "minimum": 0},
                                     "idle": {"type": "boolean"},
                                     "batch": {"type": ["object", "null"]}}},
            "steps": {"type": ["array", "object"]},
        },
    },
    "Steps": {
        "type": "object",
        "required": ["since", "last_step", "oldest_step", "missed", "next_since", "more",
                     "steps"],
        "properties": {
            "since": {"type": "integer", "minimum": 0},
            "last_step": {"type": "integer", "minimum": 0},
            "oldest_step": {"type": ["integer", "null"]},
            "missed": {"type": "integer", "minimum": 0},
            "next_since": {"type": "integer", "minimum": 0},
            "more": {"type": "boolean"},
            "steps": {"type": "array", "items": {
                "type": "object",
                "required": ["step", "started_at", "total_rows", "kernel_path", "entries"],
                "properties": {"step": {"type": "integer", "minimum": 1},
                               "total_rows": {"type": "integer", "minimum": 0},
                               "kernel_path": {"type": "string"},
                               "entries": {"type": "array"}}}},
        },
    },
    "Calibration": {"type": "object", "description": "the calibration for the served "
                    "model, weights and backend, if one was measured"},
    "Divergence": {"type": "object", "required": ["experiments", "persisted"],
                   "properties": {
                       "experiments": {"type": "array", "description": "newest first: "
                                       "queued and running ones, then the saved ones"},
                       "experiment": {"type": ["object", "null"], "description": "with "
                                      "?id=: its record, and `runs` (its two sides' run "
                                      "ids) once saved"},
                       "persisted": {"type": "boolean", "description": "whether finished "
                                     "experiments are saved in the runs database (false: "
                                     "kept in memory only)"},
                       "saved_total": {"type": ["integer", "null"], "minimum": 0}}},
}


# ---- operations --------------------------------------------------------------------------------
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
                "shape and name the parameter to change. Unknown request fields are refused."),
        },
        "paths": {
            "/v1/completions": {"post": _generation(
                "Complete a prompt", "CompletionRequest", "Completion")},
            "/v1/chat/completions": {"post": _generation(
                "Answer a chat", "ChatCompletionRequest", "ChatCompletion")},
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
        },
        "components": {
            "schemas": _api_schemas(model, vocab, cap) | {
                "CompletionEvent": _event("CompletionChunk"),
                "ChatCompletionEvent": _event("ChatCompletionChunk"),
            } | TWINS,
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
