"""GET /openapi.json: an OpenAPI 3.1 description of the JSON API, written by hand.

It covers the OpenAI-compatible `/v1/*` routes (request bodies with their types and ranges,
responses, errors in OpenAI's shape, streams as `text/event-stream`) and the pages' JSON twins
(`/runs.json`, `/runs/{run_id}.json`, `/compare.json`, `/dashboard.json`, `/steps.json`,
`/calibration.json`, `/divergence.json`). Ranges that depend on the server (vocabulary size,
context window, --max-tokens-limit, --max-waiting-requests) are filled in from the running app,
so the document describes this server, not a generic one.

The request schemas are strict where the server is (unknown fields are refused, numbers are
JSON numbers, booleans are booleans): tests/app/test_openapi.py runs schemathesis against a live
server with it, checking that no input makes a 5xx, that responses match these schemas, and
that bodies the schemas forbid are refused with a 4xx.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.web.api.params import (
    IGNORED,
    MAX_CHAT_TOP_LOGPROBS,
    MAX_COMPLETION_LOGPROBS,
    MAX_STOP,
    MAX_TEMPERATURE,
    ROLES,
)

JSON = "application/json"
SSE = "text/event-stream"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _null(schema: dict) -> dict:
    """The schema, or JSON null (the server treats null as absent for every parameter)."""
    return {"anyOf": [schema, {"type": "null"}]}


def _error_response(description: str, headers: dict | None = None) -> dict:
    out: dict[str, Any] = {"description": description,
                           "content": {JSON: {"schema": _ref("Error")}}}
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
def _event(chunk: str) -> dict:
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": JSON,
         "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}}]}}}


def _needs(*rules: tuple[str, dict, str]) -> dict:
    """`name` (when it holds `schema`; null is absent) requires `other` to be true."""
    conditions = [{"if": {"required": [name], "properties": {name: schema}},
                   "then": {"required": [other], "properties": {other: {"const": True}}}}
                  for name, schema, other in rules]
    return {"allOf": conditions}


def _schemas(model: str, vocab: int | None, max_tokens: int, context: int) -> dict:
    token_id = {"type": "integer", "minimum": 0}
    if vocab:
        token_id["maximum"] = vocab - 1
    n_tokens = {"type": "integer", "minimum": 1, "maximum": max_tokens}
    stop = {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string", "minLength": 1}},
    ], "description": f"up to {MAX_STOP} strings; generation stops before the first one"}
    common = {
        "model": _null({"type": "string", "enum": [model],
                        "description": "the served model's id (GET /v1/models); others: 404"}),
        "stream": _null({"type": "boolean"}),
        "stream_options": _null({
            "type": "object", "description": "only with stream: true",
            "properties": {"include_usage": _null({"type": "boolean"})}}),
        "max_tokens": _null(n_tokens | {
            "description": f"new tokens at most; prompt + max_tokens must fit the context "
                           f"window ({context} tokens)"}),
        "temperature": _null({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE,
                              "description": "0 (or below 1e-5): greedy; default 1"}),
        "top_p": _null({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _null({"type": "integer", "minimum": -1,
                        "description": "extension: keep the k likeliest tokens; 0 or -1: all"}),
        "seed": _null({"type": "integer"}),
        "stop": _null(stop),
        "n": _null({"type": "integer", "const": 1,
                    "description": "one choice per request"}),
        "ignore_eos": _null({"type": "boolean",
                             "description": "extension: keep generating past end-of-sequence"}),
        # Accepted only at their neutral value: not implemented.
        "frequency_penalty": _null({"type": "number", "const": 0}),
        "presence_penalty": _null({"type": "number", "const": 0}),
        "logit_bias": _null({"type": "object", "maxProperties": 0}),
        "tools": _null({"type": "array", "maxItems": 0}),
        "functions": _null({"type": "array", "maxItems": 0}),
        "tool_choice": _null({"type": "string", "enum": ["none", "auto"]}),
        "function_call": _null({"type": "string", "enum": ["none", "auto"]}),
        "response_format": _null({"type": "object", "required": ["type"],
                                  "properties": {"type": {"const": "text"}},
                                  "additionalProperties": False}),
        "modalities": _null({"type": "array", "items": {"const": "text"},
                             "minItems": 1, "maxItems": 1}),
    } | {name: {"description": "accepted and ignored"} for name in sorted(IGNORED)}
    prompt = {"anyOf": [
        {"type": "string", "minLength": 1,
         "description": "text with at least one non-whitespace character"},
        {"type": "array", "minItems": 1, "items": token_id, "description": "token ids"},
        {"type": "array", "minItems": 1, "maxItems": 1,
         "items": {"type": "string", "minLength": 1}, "description": "a batch of one text"},
        {"type": "array", "minItems": 1, "maxItems": 1,
         "items": {"type": "array", "minItems": 1, "items": token_id},
         "description": "a batch of one list of token ids"},
    ]}
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    message = {"anyOf": [
        {"type": "object", "required": ["role", "content"],
         "properties": {"role": {"enum": [r for r in ROLES if r != "assistant"]},
                        "content": content}},
        {"type": "object", "required": ["role"],
         "properties": {"role": {"const": "assistant"},
                        "content": {"anyOf": [*content["anyOf"], {"type": "null"}]}}},
    ], "description": "text, or text parts; an assistant's content may be null or left out"}
    # Parameters that only make sense with another: {"if": given, "then": needed}.
    stream_options_needs_stream = ("stream_options", {"type": "object"}, "stream")
    top_logprobs_needs_logprobs = ("top_logprobs", {"type": "number"}, "logprobs")
    usage = {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
        "properties": {
            "prompt_tokens": {"type": "integer", "minimum": 1},
            "completion_tokens": {"type": "integer", "minimum": 0},
            "total_tokens": {"type": "integer", "minimum": 1},
            "prompt_tokens_details": {"type": "object", "properties": {
                "cached_tokens": {"type": "integer", "minimum": 0}}},
        },
    }
    finish_reason = {"type": "string", "enum": ["stop", "length"]}
    head = {"id": {"type": "string"}, "created": {"type": "integer"},
            "model": {"type": "string"}}
    lp_entry = {"type": "object", "required": ["token", "logprob", "bytes"], "properties": {
        "token": {"type": "string"}, "logprob": {"type": "number", "maximum": 0},
        "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}}}
    num = {"type": ["number", "null"]}
    nullable_str = {"type": ["string", "null"]}
    return {
        "Error": {
            "type": "object", "required": ["error"], "additionalProperties": False,
            "properties": {"error": {
                "type": "object", "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
                "properties": {
                    "message": {"type": "string", "minLength": 1},
                    "type": {"type": "string", "enum": [
                        "invalid_request_error", "rate_limit_error", "server_error",
                        "authentication_error"]},
                    "param": {"type": ["string", "null"],
                              "description": "the parameter to change"},
                    "code": {"type": ["string", "null"]},
                }}},
        },
        "CompletionRequest": {
            "type": "object", "required": ["prompt"], "additionalProperties": False,
            **_needs(stream_options_needs_stream),
            "properties": common | {
                "prompt": prompt,
                "logprobs": _null({"type": "integer", "minimum": 0,
                                   "maximum": MAX_COMPLETION_LOGPROBS}),
                "echo": _null({"const": False}),
                "best_of": _null({"type": "integer", "const": 1}),
                "suffix": _null({"const": ""}),
            },
        },
        "ChatCompletionRequest": {
            "type": "object", "required": ["messages"], "additionalProperties": False,
            **_needs(stream_options_needs_stream, top_logprobs_needs_logprobs),
            "properties": common | {
                "messages": {"type": "array", "minItems": 1, "items": message},
                "max_completion_tokens": _null(n_tokens | {
                    "description": "the newer name of max_tokens; wins when both are set"}),
                "logprobs": _null({"type": "boolean"}),
                "top_logprobs": _null({"type": "integer", "minimum": 0,
                                       "maximum": MAX_CHAT_TOP_LOGPROBS,
                                       "description": "requires logprobs: true"}),
            },
        },
        "Usage": usage,
        "Completion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices",
                                           "usage"],
            "properties": head | {
                "object": {"const": "text_completion"},
                "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                    "type": "object", "required": ["index", "text", "logprobs", "finish_reason"],
                    "properties": {
                        "index": {"const": 0}, "text": {"type": "string"},
                        "finish_reason": finish_reason,
                        "logprobs": {"anyOf": [{"type": "null"}, {
                            "type": "object",
                            "required": ["tokens", "token_logprobs", "top_logprobs",
                                         "text_offset"],
                            "properties": {
                                "tokens": {"type": "array", "items": {"type": "string"}},
                                "token_logprobs": {"type": "array",
                                                   "items": {"type": "number"}},
                                "top_logprobs": {"type": "array", "items": {
                                    "type": "object",
                                    "additionalProperties": {"type": "number"}}},
                                "text_offset": {"type": "array",
                                                "items": {"type": "integer", "minimum": 0}},
                            }}]},
                    }}},
                "usage": _ref("Usage"),
            },
        },
        "ChatCompletion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices",
                                           "usage"],
            "properties": head | {
                "object": {"const": "chat.completion"},
                "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                    "type": "object",
                    "required": ["index", "message", "logprobs", "finish_reason"],
                    "properties": {
                        "index": {"const": 0}, "finish_reason": finish_reason,
                        "message": {"type": "object", "required": ["role", "content"],
                                    "properties": {"role": {"const": "assistant"},
                                                   "content": {"type": "string"}}},
                        "logprobs": {"anyOf": [{"type": "null"}, {
                            "type": "object", "required": ["content"],
                            "properties": {"content": {"type": "array", "items": lp_entry | {
                                "required": ["token", "logprob", "bytes", "top_logprobs"],
                                "properties": lp_entry["properties"] | {
                                    "top_logprobs": {"type": "array", "items": lp_entry}}}}}}]},
                    }}},
                "usage": _ref("Usage"),
            },
        },
        # Each server-sent event: its `data` is a chunk (JSON), an error (JSON, when the engine
        # fails the request mid-stream), or the final "[DONE]".
        "CompletionEvent": _event("CompletionChunk"),
        "ChatCompletionEvent": _event("ChatCompletionChunk"),
        "CompletionChunk": {
            "type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": head | {
                "object": {"const": "text_completion"},
                "choices": {"type": "array", "maxItems": 1, "items": {
                    "type": "object", "required": ["index", "text", "finish_reason"],
                    "properties": {
                        "index": {"const": 0}, "text": {"type": "string"},
                        "finish_reason": {"anyOf": [{"type": "null"}, finish_reason]},
                        "logprobs": {"type": ["object", "null"]}}}},
                "usage": {"anyOf": [{"type": "null"}, _ref("Usage")],
                          "description": "with stream_options.include_usage: null on every "
                                         "chunk but the last, which has no choices"},
            },
        },
        "ChatCompletionChunk": {
            "type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": head | {
                "object": {"const": "chat.completion.chunk"},
                "choices": {"type": "array", "maxItems": 1, "items": {
                    "type": "object", "required": ["index", "delta", "finish_reason"],
                    "properties": {
                        "index": {"const": 0},
                        "delta": {"type": "object", "properties": {
                            "role": {"const": "assistant"}, "content": {"type": "string"}}},
                        "finish_reason": {"anyOf": [{"type": "null"}, finish_reason]},
                        "logprobs": {"anyOf": [{"type": "null"}, {
                            "type": "object", "required": ["content"],
                            "properties": {"content": {"type": "array", "items": lp_entry}}}]},
                    }}},
                "usage": {"anyOf": [{"type": "null"}, _ref("Usage")]},
            },
        },
        "Model": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                           "created": {"type": "integer"}, "owned_by": {"type": "string"},
                           "max_model_len": {"type": "integer", "minimum": 1}},
        },
        "ModelList": {
            "type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"},
                           "data": {"type": "array", "items": _ref("Model")}},
        },
        # ---- the pages' JSON twins (the same context their templates render) ----
        "RunSummary": {
            "type": "object", "required": ["id", "created_at", "model", "status"],
            "properties": {
                "id": {"type": "string"}, "created_at": {"type": "number"},
                "source": {"type": "string"}, "endpoint": {"type": "string"},
                "model": {"type": "string"}, "weights": {"type": "string"},
                "kernel_policy": {"type": "string"}, "status": {"type": "string"},
                "finish_reason": nullable_str, "prompt_preview": nullable_str,
                "output_preview": nullable_str,
                "prompt_tokens": {"type": ["integer", "null"]},
                "completion_tokens": {"type": ["integer", "null"]},
                "ttft": num, "e2e_latency": num,
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
                          "properties": {"prev": nullable_str, "next": nullable_str,
                                         "json": {"type": "string"}}},
            },
        },
        "TokenView": {
            "type": "object", "required": ["idx", "token_id", "logprob", "alternatives"],
            "properties": {
                "idx": {"type": "integer", "minimum": 0}, "token_id": {"type": "integer"},
                "text": nullable_str, "logprob": num, "offset": num, "gap": num,
                "step": {"type": ["integer", "null"]},
                "alternatives": {"type": "array", "items": {
                    "type": "object", "required": ["token_id", "logprob"],
                    "properties": {"token_id": {"type": "integer"}, "text": nullable_str,
                                   "logprob": num}}},
            },
        },
        "Run": {
            "type": "object",
            "required": ["id", "created_at", "model", "status", "params", "tokens", "steps",
                         "metrics", "prompt_token_ids"],
            "properties": {
                "id": {"type": "string"}, "session_id": {"type": ["integer", "null"]},
                "created_at": {"type": "number"}, "model": {"type": "string"},
                "status": {"type": "string"}, "finish_reason": nullable_str,
                "error": nullable_str, "prompt_text": nullable_str,
                "output_text": nullable_str, "text_tail": {"type": "string"},
                "messages": {"type": ["array", "null"]},
                "params": {"type": ["object", "null"]},
                "prompt_token_ids": {"type": "array", "items": {"type": "integer"}},
                "output_token_ids": {"type": ["array", "null"], "items": {"type": "integer"}},
                "tokens": {"type": "array", "items": _ref("TokenView")},
                "steps": {"type": "array", "items": {"type": "object", "required": ["step"]}},
                "metrics": {"type": "object", "properties": {
                    "ttft": num, "tpot": num, "e2e_latency": num, "queue_time": num,
                    "tokens_per_s": num}},
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
                                   "logprob_diff": num,
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
                "frames_per_s": {"type": "number"}, "chart_steps": {"type": "integer"},
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
                "responses": {"200": _json_response("the model", _ref("Model")),
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
            "schemas": _schemas(model, vocab, cap, context),
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
