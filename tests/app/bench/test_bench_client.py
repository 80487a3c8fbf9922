"""The load client's stream reading, token counting, errors, arrivals and concurrency cap,
against scripted servers (httpx.MockTransport): no network."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from app.bench.client import (
    BenchError,
    ServerInfo,
    arrival_delays,
    base_url,
    choose_model,
    request_body,
    run_load,
    send,
)
from app.bench.dataset import BenchRequest
from app.bench.metrics import peak_concurrency

ITEM = BenchRequest("a b c", max_tokens=4, input_len=3)


def sse(*objs) -> bytes:
    out = []
    for obj in objs:
        out.append(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n")
    return "".join(out).encode()


def text_chunk(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


async def paced(parts: list[bytes], gap: float):
    for i, part in enumerate(parts):
        if i:
            await asyncio.sleep(gap)
        yield part


def one(handler, endpoint="completions", item=ITEM):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send(client, "http://server", item, 0, endpoint, None, False, 0.0)
    return asyncio.run(go())


def test_usage_wins_over_chunk_count_and_gaps_become_itls():
    # Four tokens in three text chunks (two merged), as mlx_lm.server may send them.
    parts = [sse(text_chunk("He")), sse(text_chunk("llo")), sse(text_chunk(" you", "length")),
             sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
                 "[DONE]")]

    def handler(request):
        body = json.loads(request.content)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert request.url.path == "/v1/completions"
        return httpx.Response(200, content=paced(parts, 0.03))

    r = one(handler)
    assert r.success and r.error is None
    assert (r.output_tokens, r.output_tokens_source) == (4, "usage")
    assert (r.prompt_tokens, r.prompt_tokens_source) == (3, "usage")
    assert r.chunks == 3 and len(r.itl) == 2
    assert all(g >= 0.02 for g in r.itl)
    assert 0 <= r.ttft <= r.latency
    assert r.finish_reason == "length"
    assert r.tpot == pytest.approx((r.latency - r.ttft) / 3)


def test_without_usage_tokens_are_counted_from_text_chunks():
    def handler(request):
        return httpx.Response(200, content=sse(text_chunk("x"), text_chunk(""),
                                               text_chunk("y"), text_chunk("", "stop"),
                                               "[DONE]"))

    r = one(handler)
    assert r.success
    assert (r.output_tokens, r.output_tokens_source) == (2, "chunks")
    assert (r.prompt_tokens, r.prompt_tokens_source) == (3, "estimate")


def test_chat_role_chunk_is_not_the_first_token():
    def handler(request):
        assert request.url.path == "/v1/chat/completions"
        assert json.loads(request.content)["messages"] == [{"role": "user", "content": "a b c"}]
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        tok = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]}
        return httpx.Response(200, content=paced([sse(role), sse(tok, "[DONE]")], 0.05))

    r = one(handler, endpoint="chat")
    assert r.success and r.chunks == 1
    assert r.ttft >= 0.04  # from the content, not the empty role chunk


@pytest.mark.parametrize("response,expected", [
    (lambda: httpx.Response(429, json={"error": {"message": "too many waiting"}}),
     "HTTP 429: too many waiting"),
    (lambda: httpx.Response(500, text="plain failure"), "HTTP 500: plain failure"),
    (lambda: httpx.Response(200, content=sse(text_chunk("a"),
                                             {"error": {"message": "engine died"}}, "[DONE]")),
     "error in the stream: engine died"),
    (lambda: httpx.Response(200, content=sse(text_chunk("a"))),
     "the stream ended before the response was complete"),
    (lambda: httpx.Response(200, content=b"data: {nope\n\n"), "not JSON in the stream"),
])
def test_failures_carry_their_error_text(response, expected):
    r = one(lambda request: response())
    assert not r.success
    assert expected in r.error
    assert r.end is not None and r.latency is None


def test_connection_errors_are_results_not_exceptions():
    def handler(request):
        raise httpx.ConnectError("connection refused")

    r = one(handler)
    assert not r.success and r.error == "ConnectError: connection refused"


def test_request_body_sends_ignore_eos_and_model_only_when_set():
    body = request_body(ITEM, "completions", None, False)
    assert "ignore_eos" not in body and "model" not in body
    assert body["prompt"] == "a b c" and body["max_tokens"] == 4
    body = request_body(ITEM, "chat", "m", True)
    assert body["ignore_eos"] is True and body["model"] == "m" and "prompt" not in body


def test_model_choice_and_url_forms():
    assert choose_model(ServerInfo("u", ["x"], "batchscope"), None) == "x"
    assert choose_model(ServerInfo("u", ["x"], "batchscope"), "y") == "y"
    # mlx_lm.server lists the Hugging Face cache without owned_by: name none of them.
    assert choose_model(ServerInfo("u", ["a", "b"], None), None) is None
    assert choose_model(ServerInfo("u", ["/models/m"], None), None) is None
    assert base_url("http://h:1/v1/") == "http://h:1" == base_url("http://h:1")
    with pytest.raises(BenchError, match="http://"):
        base_url("h:1")


def test_arrivals_are_poisson_and_seeded():
    assert arrival_delays(5, None, 0) == [0.0] * 5
    assert arrival_delays(3, float("inf"), 0) == [0.0] * 3
    gaps = arrival_delays(4000, 20.0, seed=5)
    assert gaps == arrival_delays(4000, 20.0, seed=5) != arrival_delays(4000, 20.0, seed=6)
    assert gaps[0] == 0.0
    assert np.mean(gaps[1:]) == pytest.approx(1 / 20, rel=0.06)
    assert np.std(gaps[1:]) == pytest.approx(1 / 20, rel=0.08)  # exponential: std = mean


def test_concurrency_cap_holds_and_every_request_gets_a_result():
    in_flight = {"now": 0, "peak": 0}

    async def handler(request):
        in_flight["now"] += 1
        in_flight["peak"] = max(in_flight["peak"], in_flight["now"])

        async def body():
            yield sse(text_chunk("a"))
            await asyncio.sleep(0.02)
            yield sse(text_chunk("b", "length"))
            in_flight["now"] -= 1
            yield sse("[DONE]")
        return httpx.Response(200, content=body())

    done = []
    results, duration = asyncio.run(run_load(
        "http://server", [ITEM] * 7, max_concurrency=2, on_done=done.append,
        transport=httpx.MockTransport(handler)))
    assert len(results) == len(done) == 7 and all(r.success for r in results)
    assert [r.index for r in results] == list(range(7))
    assert in_flight["peak"] == 2
    assert peak_concurrency(results) <= 2
    assert duration >= 4 * 0.02  # 7 requests two at a time: at least four rounds
