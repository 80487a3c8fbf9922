"""Request checks for the OpenAI-compatible API: a JSON body in, a typed request out.

Everything a client sends is checked here, before anything reaches the engine, and every
refusal is an APIError in OpenAI's shape naming the parameter (`param`) to change. Choices:

- Unknown fields are rejected (400, code `unknown_parameter`), as OpenAI does; fields OpenAI
  defines that this server does not implement are accepted only at their neutral value.
- A number parameter must be a finite JSON number (NaN and Infinity, which Python's parser
  lets through, are refused by name): `true` is not 1 and `"5"` is not 5 (Python's bool is an
  int, so it is turned away explicitly). An integer parameter takes 5 or 5.0 (the same number
  in JSON, and an integer to JSON Schema), never 5.5.
- A completions prompt must hold something besides whitespace; text must be valid Unicode
  (no lone UTF-16 surrogates such as "\\ud800", which JSON allows).
- Limits come from `Limits` (the server's settings): `max_tokens` at most `max_tokens`, bodies
  at most `max_body_bytes` (413, checked on Content-Length and on the bytes actually read).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from engine.sampling import SamplingParams

MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_TEMPERATURE = 1e-5  # below this, dividing the logits overflows: treat as greedy
MAX_TEMPERATURE = 2.0
ROLES = ("system", "user", "assistant")


# ---- errors --------------------------------------------------------------------------------
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


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def _type_error(name: str, expected: str) -> APIError:
    return bad(f"{name} must be {expected}", name, "invalid_type")


# ---- the body ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int | None = None  # the most new tokens one request may ask for; None: no cap


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


# ---- single values -----------------------------------------------------------------------------
def as_int(value: Any) -> int | None:
    """An integer as JSON means it (5, or 5.0: JSON Schema counts both), else None (true, 2.5)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():  # finite, no fraction
        return int(value)
    return None


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    raw = body.get(name)
    if raw is None:
        return None
    value = as_int(raw)
    if value is None:
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
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        number = math.inf
    ok = math.isfinite(number) and (lo < number if lo_open else lo <= number) and number <= hi
    if not ok:
        shown = f"{number:g}" if math.isfinite(number) else "out of range"
        raise bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {shown}",
                  name)
    return number


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


def _max_tokens(body: dict, name: str, limits: Limits) -> int | None:
    value = _int(body, name, lo=1)
    if value is not None and limits.max_tokens is not None and value > limits.max_tokens:
        raise bad(f"{name} must be at most {limits.max_tokens} on this server, got {value}",
                  name)
    return value


# ---- which keys a body may hold -----------------------------------------------------------------
def _neutral_or_absent(value: Any, *neutral: Any) -> bool:
    return value is None or any(value == n and type(value) is type(n) for n in neutral)


# Parameters OpenAI defines that this server does not implement: accepted only at their neutral
# value (what clients send by default), otherwise a 400 naming them.
UNSUPPORTED_UNLESS_NEUTRAL: dict[str, Callable[[Any], bool]] = {
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
IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "service_tier"}
COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed",
          "stop", "n", "top_k", "ignore_eos"}
COMPLETIONS = COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}


def _check_keys(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        neutral = UNSUPPORTED_UNLESS_NEUTRAL.get(key)
        if neutral is not None:
            if not neutral(value):
                raise bad(f"{key} is not supported by this server", key, "unsupported_parameter")
        elif key not in allowed and key not in IGNORED:
            raise bad(f"unrecognized request argument supplied: {key}", key, "unknown_parameter")


def check_model(model: Any, served: str) -> None:
    if model is None:
        return
    if not isinstance(model, str):
        raise _type_error("model", "a string")
    if model != served:
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                            f"'{served}'", "model", "model_not_found")


# ---- typed requests ----------------------------------------------------------------------------
@dataclass
class Common:
    """What both endpoints take."""

    stream: bool
    include_usage: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool

    def sampling(self, max_tokens: int, logprobs: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=self.stop, logprobs=logprobs,
            ignore_eos=self.ignore_eos)


@dataclass
class CompletionRequest:
    common: Common
    text: str | None  # the prompt as text, or
    token_ids: list[int] | None  # as token ids
    max_tokens: int | None  # None: the caller left it to the default
    logprobs: int | None  # None: no logprobs; 0..5 alternatives otherwise
    prompt_param = "prompt"

    @property
    def max_tokens_param(self) -> str | None:
        return "max_tokens" if self.max_tokens is not None else None


@dataclass
class ChatRequest:
    common: Common
    messages: list[dict]  # {role, content: str}
    max_tokens: int | None
    max_tokens_param: str | None  # "max_completion_tokens" or "max_tokens", whichever was set
    logprobs: bool
    top_logprobs: int | None
    prompt_param = "messages"


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
    temperature = _number(body, "temperature", 0.0, MAX_TEMPERATURE)
    temperature = 1.0 if temperature is None else temperature  # OpenAI's default
    top_k = _int(body, "top_k", lo=-1)
    return Common(
        stream=stream, include_usage=include_usage,
        temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
        top_p=_number(body, "top_p", 0.0, 1.0, lo_open=True) or 1.0,
        top_k=0 if top_k in (None, -1) else top_k,  # -1: no cut (vLLM's convention)
        seed=_int(body, "seed"), stop=_stop(body), ignore_eos=bool(_bool(body, "ignore_eos")))


def _prompt(body: dict) -> tuple[str | None, list[int] | None]:
    """A completions prompt: (text, None) or (None, token ids)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad("prompt must not be empty or only whitespace", "prompt")
        return prompt, None
    if not isinstance(prompt, list):
        raise _type_error("prompt", "a string, a list of one string, or a list of token ids")
    if not prompt:
        raise bad("prompt must not be empty", "prompt")
    ids = [as_int(t) for t in prompt]
    if all(t is not None for t in ids):
        return None, ids  # the engine checks the ids against the vocabulary
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
            shown = repr(role) if isinstance(role, str) else type(role).__name__
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {shown[:40]}",
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


def parse_completion(body: dict, served_model: str, limits: Limits) -> CompletionRequest:
    _check_keys(body, COMPLETIONS)
    check_model(body.get("model"), served_model)
    text, ids = _prompt(body)
    common = _common(body)
    return CompletionRequest(
        common=common, text=text, token_ids=ids,
        max_tokens=_max_tokens(body, "max_tokens", limits),
        logprobs=_int(body, "logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS))


def parse_chat(body: dict, served_model: str, limits: Limits) -> ChatRequest:
    _check_keys(body, CHAT)
    check_model(body.get("model"), served_model)
    messages = _messages(body)
    common = _common(body)
    # max_completion_tokens is the newer name; when both are set it wins, as at OpenAI.
    given = {name: value for name in ("max_completion_tokens", "max_tokens")
             if (value := _max_tokens(body, name, limits)) is not None}
    max_param = next(iter(given), None)
    logprobs = bool(_bool(body, "logprobs"))
    top = _int(body, "top_logprobs", lo=0, hi=MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs requires logprobs to be true", "top_logprobs")
    return ChatRequest(common=common, messages=messages,
                       max_tokens=given.get(max_param) if max_param else None,
                       max_tokens_param=max_param, logprobs=logprobs, top_logprobs=top)
