"""The load client: streamed requests to an OpenAI-compatible server, with Poisson arrivals
and/or a concurrency cap (both together as in `vllm bench serve`).

Each request asks for usage in the stream (`stream_options.include_usage`). Output tokens are
the server's `usage.completion_tokens` when it sends usage, else the number of chunks that
carried text (a server may merge tokens into one chunk, or send none for a token that ends
in the middle of a character, so that count is a lower bound). batchscope and mlx_lm.server
both send usage when asked.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np

from app.bench.dataset import BenchRequest
from app.bench.metrics import RequestResult

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_ERROR_CHARS = 500


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, bad arguments); the message says why."""


@dataclass
class ServerInfo:
    base_url: str
    models: list[str] = field(default_factory=list)
    owned_by: str | None = None
    max_model_len: int | None = None

    @property
    def is_batchscope(self) -> bool:
        return self.owned_by == "batchscope"


def base_url(url: str) -> str:
    """http://host:port from what users type: with or without a trailing / or /v1."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise BenchError(f"--url must start with http:// or https://, got {url!r}")
    return url


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return f"{type(e).__name__}: {text}"[:MAX_ERROR_CHARS]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe(url: str, timeout: float = 10.0, api_key: str | None = None) -> ServerInfo:
    """GET /v1/models: is the server there, what does it serve, and its context length."""
    info = ServerInfo(base_url(url))
    try:
        response = httpx.get(f"{info.base_url}/v1/models", timeout=timeout,
                             headers=auth_headers(api_key))
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {info.base_url}: {_short(e)}") from None
    if response.status_code in (401, 403):
        hint = ("the key given was refused" if api_key else
                "give its key with --api-key or $BATCHSCOPE_API_KEY")
        raise BenchError(f"{info.base_url} refused the request (HTTP {response.status_code}): "
                         f"{hint}")
    if response.status_code != 200:
        return info  # not every server lists models; requests will tell
    try:
        data = response.json().get("data") or []
    except (ValueError, AttributeError):
        return info
    for card in data:
        if isinstance(card, dict) and isinstance(card.get("id"), str):
            info.models.append(card["id"])
    if data and isinstance(data[0], dict):
        info.owned_by = data[0].get("owned_by")
        mml = data[0].get("max_model_len")
        info.max_model_len = mml if isinstance(mml, int) and mml > 0 else None
    return info


def choose_model(info: ServerInfo, requested: str | None) -> str | None:
    """The model to name in requests; None leaves the field out (the server's default).

    Without --model: the served model when the server lists exactly one it owns (batchscope,
    vLLM); otherwise none, because mlx_lm.server lists the models in the local Hugging Face
    cache and would load whichever is named.
    """
    if requested:
        return requested
    if len(info.models) == 1 and info.owned_by:
        return info.models[0]
    return None


def request_body(item: BenchRequest, endpoint: str, model: str | None, ignore_eos: bool,
                 response_format: dict | None = None) -> dict:
    body: dict = {"stream": True, "stream_options": {"include_usage": True},
                  "max_tokens": item.max_tokens, "temperature": 0.0}
    if model is not None:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        body["prompt"] = item.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if response_format is not None:
        body["response_format"] = response_format
    return body


def json_schema_format(schema: dict, name: str = "bench") -> dict:
    """OpenAI's response_format asking for JSON valid against `schema` (--json-schema)."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _error_text(status: int, raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        elif isinstance(err, str):
            text = err
    except ValueError:
        pass
    return f"HTTP {status}: {text}"[:MAX_ERROR_CHARS]


def _chunk_text(choice: dict, endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning") or "")
    return choice.get("text") or ""


async def send(client: httpx.AsyncClient, url: str, item: BenchRequest, index: int,
               endpoint: str, model: str | None, ignore_eos: bool, t0: float,
               response_format: dict | None = None) -> RequestResult:
    """One streamed request; never raises (a failure is a result with its error text). With
    a response_format, `parsed` says whether the output parsed as JSON."""
    clock = time.perf_counter
    result = RequestResult(index=index, input_len=item.input_len, max_tokens=item.max_tokens,
                           start=clock() - t0)
    try:
        await _stream(client, url, item, endpoint, model, ignore_eos, t0, result,
                      response_format)
    except httpx.HTTPError as e:
        result.error = _short(e)
    finally:
        if result.end is None:
            result.end = clock() - t0
    if result.error is not None:
        return result
    usage = result.usage or {}
    if isinstance(usage.get("completion_tokens"), int):
        result.output_tokens = usage["completion_tokens"]
        result.output_tokens_source = "usage"
    else:
        result.output_tokens = result.chunks
    if isinstance(usage.get("prompt_tokens"), int):
        result.prompt_tokens = usage["prompt_tokens"]
        result.prompt_tokens_source = "usage"
    else:
        result.prompt_tokens = item.input_len
    if result.ttft is None and result.output_tokens:
        # Output tokens without text (e.g. only an end-of-sequence token): the first token
        # arrived with the finish at the latest.
        result.ttft = result.end - result.start
    result.success = True
    return result


async def _stream(client: httpx.AsyncClient, url: str, item: BenchRequest, endpoint: str,
                  model: str | None, ignore_eos: bool, t0: float, result: RequestResult,
                  response_format: dict | None) -> None:
    """Read one response's SSE stream into `result` (sets error, or end on success)."""
    clock = time.perf_counter
    body = request_body(item, endpoint, model, ignore_eos, response_format)
    texts: list[str] | None = [] if response_format is not None else None
    last = 0.0
    done = False
    async with client.stream("POST", url + ENDPOINTS[endpoint], json=body) as response:
        if response.status_code != 200:
            result.error = _error_text(response.status_code, await response.aread())
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank lines, comments (keep-alive pings), event names
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            now = clock() - t0
            try:
                obj = json.loads(payload)
            except ValueError:
                result.error = f"not JSON in the stream: {payload[:200]!r}"
                return
            if not isinstance(obj, dict):
                continue
            if obj.get("error"):
                err = obj["error"]
                message = err.get("message") if isinstance(err, dict) else err
                result.error = f"error in the stream: {message}"[:MAX_ERROR_CHARS]
                return
            if isinstance(obj.get("usage"), dict):
                result.usage = obj["usage"]
            for choice in obj.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                text = _chunk_text(choice, endpoint)
                if texts is not None:
                    texts.append(text)
                if text:
                    if result.ttft is None:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunks += 1
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
        result.end = clock() - t0  # before closing the connection
    if not done and result.finish_reason is None:
        result.error = "the stream ended before the response was complete"
    elif texts is not None:
        result.parsed = _parses("".join(texts))


def arrival_delays(n: int, request_rate: float | None, seed: int) -> list[float]:
    """Gaps before each request: 0 for all at once (rate None/inf), else exponential with
    mean 1/rate (a Poisson process), seeded. The first request goes at once."""
    if request_rate is None or request_rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed + 1)  # not the dataset's stream
    gaps = rng.exponential(1.0 / request_rate, size=n)
    gaps[0] = 0.0
    return [float(g) for g in gaps]


async def run_load(url: str, requests: Sequence[BenchRequest], *, endpoint: str = "completions",
                   model: str | None = None, request_rate: float | None = None,
                   max_concurrency: int | None = None, ignore_eos: bool = False,
                   seed: int = 0, timeout: float = 600.0,
                   on_done: Callable[[RequestResult], None] | None = None,
                   api_key: str | None = None, response_format: dict | None = None,
                   transport: httpx.AsyncBaseTransport | None = None
                   ) -> tuple[list[RequestResult], float]:
    """Send every request; returns the results (in request order) and the duration.

    The duration runs from the first request sent to the last response finished."""
    if endpoint not in ENDPOINTS:
        raise BenchError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    url = base_url(url)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_concurrency or 64)
    timeouts = httpx.Timeout(connect=30.0, read=timeout, write=30.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeouts, transport=transport,
                                 headers=auth_headers(api_key)) as client:
        t0 = time.perf_counter()

        async def one(index: int, item: BenchRequest) -> RequestResult:
            if semaphore is None:
                result = await send(client, url, item, index, endpoint, model, ignore_eos, t0,
                                    response_format)
            else:
                async with semaphore:
                    result = await send(client, url, item, index, endpoint, model, ignore_eos,
                                        t0, response_format)
            if on_done is not None:
                on_done(result)
            return result

        tasks = []
        for index, (item, delay) in enumerate(zip(requests, arrival_delays(
                len(requests), request_rate, seed), strict=True)):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index, item)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return list(results), duration
