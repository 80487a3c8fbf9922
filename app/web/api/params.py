"""Reading a request for the OpenAI-compatible API: the JSON body in, a checked model out.

Every refusal is an APIError in OpenAI's shape naming the parameter (`param`) to change: the
checks themselves are the request models' (app/web/api/schemas.py); here the body is read
(413 past the server's max_body_bytes, checked on Content-Length and on the bytes actually
read; valid JSON holding an object; text valid Unicode, without the lone UTF-16 surrogates such
as "\\ud800" that JSON allows) and pydantic's errors are worded as OpenAI's.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from pydantic_core.core_schema import ErrorType
from starlette.requests import Request

from app.web.api.schemas import error_body, shown

M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


# ---- the body ------------------------------------------------------------------------------
async def read_json(request: Request, limit: int | None = None) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (default: the app's max_body_bytes),
    400 for anything but an object."""
    if limit is None:
        limit = request.app.state.settings.max_body_bytes
    too_large = APIError(413, f"request body is larger than {limit} bytes", None,
                         "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():  # chunked bodies have no Content-Length: count
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        # NaN and Infinity parse (as Python does) and are refused by the parameter they were
        # given for, which the error then names.
        data = json.loads(bytes(body))
    except (ValueError, RecursionError):  # includes UnicodeDecodeError (invalid UTF-8)
        raise bad("could not parse the request body as JSON", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    _check_unicode(data)
    return data


def _check_unicode(data: dict) -> None:
    """Reject strings (keys too) holding lone surrogates: they cannot be encoded as UTF-8."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            _utf8(value, where or None)
        elif isinstance(value, dict):
            for k, v in value.items():
                path = f"{where}.{k}" if where else k
                _utf8(k, where or None, key=True)
                stack.append((path, v))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))


def _utf8(text: str, where: str | None, key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        what = "a key" if key else "a string"
        place = f" in {where}" if where else ""
        raise bad(f"{what}{place} holds a lone UTF-16 surrogate, which is not valid Unicode",
                  where, "invalid_unicode") from None


# ---- the checks ------------------------------------------------------------------------------
async def read_request(request: Request, model: type[M]) -> M:
    """The body as `model`, checked against this server: its model and --max-tokens-limit."""
    settings = request.app.state.settings
    body = await read_json(request, settings.max_body_bytes)
    return validate(model, body, {"model": request.app.state.runs.model_name,
                                  "max_tokens": settings.max_tokens_limit})


def validate(model: type[M], body: dict, context: dict) -> M:
    """`body` as `model` (context: see schemas.py), or the APIError for its first problem."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as e:
        # As OpenAI: unknown parameters first, then what the request is about, then the rest.
        first = min(e.errors(), key=lambda err: (err["type"] not in _KEY_LEVEL,
                                                 err["loc"][:1] not in _SUBJECT))
        raise _api_error(first) from None


_KEY_LEVEL = {"extra_forbidden", "unsupported_parameter"}
_SUBJECT = {("model",), ("prompt",), ("messages",)}
_BUILT_IN = frozenset(get_args(ErrorType))  # pydantic's own error types; ours are OpenAI codes
# pydantic's words that speak Python, in JSON's terms (after the parameter's name).
_SAID = {"model_type": "should be an object", "dict_type": "should be an object",
         "list_type": "should be an array"}


def _api_error(error: ErrorDetails) -> APIError:
    loc = error["loc"]
    where = str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    param = where if loc[0] == "messages" else str(loc[0])  # a message, or a whole parameter
    kind = error["type"]
    if kind not in _BUILT_IN:  # one of ours: the code, and words about the parameter
        status = 404 if kind == "model_not_found" else 400
        return APIError(status, f"{where} {error['msg']}", param, kind)
    if kind == "extra_forbidden":
        return bad(f"unrecognized request argument supplied: {where}", param,
                   "unknown_parameter")
    if kind == "missing":
        return bad(f"{where} is required", param, "missing_required_parameter")
    # "Input should be ..." (or "List should have ..."): the parameter, and what came.
    said = _SAID.get(kind) or error["msg"].split(" ", 1)[1].replace(" after validation", "")
    if kind not in ("too_short", "too_long"):  # these say the length that came
        said += f", got {shown(error['input'])}"
    return bad(f"{where} {said}", param, "invalid_type" if kind.endswith("_type")
               else "invalid_value")
