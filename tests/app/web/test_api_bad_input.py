"""Bad input and limits on the OpenAI-compatible API: every case a 4xx in OpenAI's error shape
naming the parameter (`param`), never a 500, and nothing left behind in the engine."""

from __future__ import annotations

import json
import threading

import pytest
from api_helpers import CHAT, MAX_BODY, assert_error, make_app
from starlette.testclient import TestClient

from app.cli.serve import settings_from_args
from app.runs import RunRequest
from app.web.api.routes import INLINE_TOKENIZE_CHARS
from engine.engine import Engine
from engine.sampling import SamplingParams

MAX_TOKENS_LIMIT = 100


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app(max_body_bytes=MAX_BODY)) as c:
        yield c


@pytest.fixture(scope="module")
def capped():
    with TestClient(make_app(max_tokens_limit=MAX_TOKENS_LIMIT)) as c:
        yield c


@pytest.fixture(scope="module")
def engine(client) -> Engine:
    return client.app.state.engine


ENDPOINTS = {"/v1/completions": {"prompt": "hi"}, "/v1/chat/completions": {"messages": CHAT}}


COMPLETION_ERRORS = [
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "hi", "model": 5}, 400, "model"),
    ({}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [True]}, 400, "prompt"),
    ({"prompt": [999999]}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ({"prompt": "hi", "seed": "x"}, 400, "seed"),
    ({"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "hi", "stop": ""}, 400, "stop"),
    ({"prompt": "hi", "stop": [1]}, 400, "stop"),
    ({"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ({"prompt": "hi", "n": 17}, 400, "n"),
    ({"prompt": "hi", "n": "1"}, 400, "n"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "stream": True, "stream_options": []}, 400, "stream_options"),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "hi", "presence_penalty": True}, 400, "presence_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "hi", "min_p": -0.1}, 400, "min_p"),
    ({"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "hi", "messages": CHAT}, 400, "messages"),
]


@pytest.mark.parametrize(("body", "status", "param"), COMPLETION_ERRORS)
def test_completion_errors(client, body, status, param):
    assert_error(client.post("/v1/completions", json=body), status, param)


CHAT_ERRORS = [
    ({"messages": CHAT, "model": "nope"}, 404, "model"),
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     400, "messages[0].content[0].text"),
    ({"messages": CHAT, "logprobs": "yes"}, 400, "logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": CHAT, "n": 17}, 400, "n"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"messages": CHAT, "prompt": "hi"}, 400, "prompt"),
]


@pytest.mark.parametrize(("body", "status", "param"), CHAT_ERRORS)
def test_chat_errors(client, body, status, param):
    assert_error(client.post("/v1/chat/completions", json=body), status, param)


def test_neutral_values_of_unsupported_parameters_are_accepted(client):
    r = client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 2, "n": 1, "presence_penalty": 0,
        "frequency_penalty": 0.0, "logit_bias": {}, "user": "me", "tools": [],
        "response_format": {"type": "text"}, "stream": False, "top_k": -1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b"", b"NaN",
                                 b"[" * 4000 + b"]" * 4000])
def test_malformed_bodies(client, path, raw):
    assert_error(client.post(path, content=raw), 400, None)


def test_nan_is_not_a_temperature(client):
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "temperature": NaN}')
    assert_error(r, 400, "temperature")


def test_body_too_large(client):
    big = json.dumps({"prompt": "x" * MAX_BODY})
    assert_error(client.post("/v1/completions", content=big), 413, None, "request_too_large")

    def chunked():  # no content-length: the limit holds while reading
        for _ in range(4):
            yield b" " * (MAX_BODY // 2)

    assert_error(client.post("/v1/completions", content=chunked()), 413, None)


def test_prompt_plus_max_tokens_beyond_the_context(client, engine):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 510})
    error = assert_error(r, 400, "max_tokens", "context_length_exceeded")
    assert "context window of 512" in error["message"]  # the engine's own words
    r = client.post("/v1/completions", json={"prompt": "x" * 600, "max_tokens": 1})
    assert_error(r, 400, "prompt", "context_length_exceeded")
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 600})
    assert_error(r, 400, "max_tokens", "context_length_exceeded")
    r = client.post("/v1/chat/completions", json={"messages": CHAT,
                                                  "max_completion_tokens": 600})
    assert_error(r, 400, "max_completion_tokens", "context_length_exceeded")
    long_chat = [{"role": "user", "content": "y" * 600}]
    assert_error(client.post("/v1/chat/completions", json={"messages": long_chat}), 400,
                 "messages", "context_length_exceeded")
    assert engine.block_manager.num_used_blocks == 0


# ---- the same checks on both endpoints ---------------------------------------------------------
BOTH = [
    # wrong types; bool is an int in Python, and must not pass for one
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 5.5}, "max_tokens"),
    ({"max_tokens": None, "temperature": True}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": False}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": True}, "seed"),
    ({"stream": 1}, "stream"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"speculative": "false"}, "speculative"),
    ({"speculative": 0}, "speculative"),
    ({"speculative": [True]}, "speculative"),
    ({"n": True}, "n"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop": ["a", None]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    # negative and huge numbers
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"temperature": 10**400}, "temperature"),
    ({"temperature": -10**400}, "temperature"),
    ({"temperature": 1e308}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -10**30}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    # unknown and unsupported fields
    ({"frobnicate": True}, "frobnicate"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"model": ["tiny-llama"]}, "model"),
]


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize(("extra", "param"), BOTH)
def test_both_endpoints(client, path, extra, param):
    assert_error(client.post(path, json=ENDPOINTS[path] | extra), 400, param)


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize(("name", "value"), [("temperature", "NaN"), ("temperature", "Infinity"),
                                             ("top_p", "NaN"), ("top_p", "-Infinity"),
                                             ("max_tokens", "Infinity"), ("seed", "NaN")])
def test_nan_and_infinity(client, path, name, value):
    raw = json.dumps(ENDPOINTS[path])[:-1] + f', "{name}": {value}}}'
    assert_error(client.post(path, content=raw.encode()), 400, name)


def test_integers_written_as_floats_are_integers(client):
    """5.0 is 5 in JSON (and an integer to JSON Schema, so to the OpenAPI document)."""
    as_ints = {"prompt": [107, 108], "max_tokens": 3, "top_k": 2, "seed": 4, "n": 1,
               "logprobs": 1, "temperature": 1}
    as_floats = {k: ([float(t) for t in v] if isinstance(v, list) else float(v))
                 for k, v in as_ints.items()}
    a, b = (client.post("/v1/completions", json=body) for body in (as_ints, as_floats))
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"] == b.json()["choices"]


@pytest.mark.parametrize("seed", [-(10**30), -1, 2**63 - 1, 2**64, 10**30])
def test_any_integer_is_a_seed(client, seed):
    body = {"prompt": "hi", "max_tokens": 2, "seed": seed, "temperature": 1.0}
    first, again = (client.post("/v1/completions", json=body) for _ in range(2))
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_unknown_model(client, path):
    error = assert_error(client.post(path, json=ENDPOINTS[path] | {"model": "gpt-4o"}), 404,
                         "model", "model_not_found")
    assert "tiny-llama" in error["message"]


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize("raw", [
    b'{"prompt": "\xff\xfe"}',  # never valid in UTF-8
    b'{"prompt": "\xe6\x97"}',  # a character cut short
    b'{"prompt": "caf\xe9"}',  # Latin-1, not UTF-8
])
def test_invalid_utf8_body(client, path, raw):
    assert_error(client.post(path, content=raw), 400, None, "invalid_json")


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\udfff"]}', "stop[0]"),
    ("/v1/completions", '{"prompt": "hi", "user": "\\ud800"}', "user"),
    ("/v1/completions", '{"prompt": "hi", "\\ud800": 1}', None),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "\\ud800", "content": "x"}]}',
     "messages[0].role"),
])
def test_lone_surrogates_are_not_text(client, path, body, param):
    """JSON may escape a lone surrogate; it cannot be encoded, so it must never reach a tokenizer
    or be echoed back in an error message."""
    assert_error(client.post(path, content=body.encode()), 400, param, "invalid_unicode")


@pytest.mark.parametrize("prompt", ["", " ", "   \n\t ", [""], ["  "]])
def test_empty_and_whitespace_prompts(client, prompt):
    assert_error(client.post("/v1/completions", json={"prompt": prompt}), 400, "prompt")


@pytest.mark.parametrize("prompt", [[259], [-1], [10**30], [3, 4, 5, 100000], [[1, 2], [3]]])
def test_token_ids_out_of_range(client, prompt):
    assert_error(client.post("/v1/completions", json={"prompt": prompt}), 400, "prompt")


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": None}, "messages"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages"),
    ({"messages": [{"role": "function", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": None, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [CHAT[1], {"role": "user", "content": {"text": "hi"}}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": True}]}, "messages[0].content"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": 1}, "logprobs"),
])
def test_chat_messages(client, body, param):
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("logprobs", [-1, 6, 10**9, 1.5, "2"])
def test_completion_logprobs_out_of_range(client, logprobs):
    assert_error(client.post("/v1/completions", json={"prompt": "hi", "logprobs": logprobs}),
                 400, "logprobs")


def test_max_tokens_limit(capped):
    client = capped
    for path, name in [("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_tokens"),
                       ("/v1/chat/completions", "max_completion_tokens")]:
        r = client.post(path, json=ENDPOINTS[path] | {name: MAX_TOKENS_LIMIT + 1})
        error = assert_error(r, 400, name)
        assert f"at most {MAX_TOKENS_LIMIT}" in error["message"]
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": MAX_TOKENS_LIMIT,
                                             "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT
    # Chat without max_tokens gets the room left in the context, capped by the limit.
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT


def test_body_size_declared_but_not_sent(client):
    """A Content-Length over the cap is refused before a byte of the body is read."""
    r = client.post("/v1/completions", content=b"{}",
                    headers={"content-length": str(MAX_BODY + 1)})
    assert_error(r, 413, None, "request_too_large")


def test_long_prompts_are_tokenized_off_the_event_loop(capped):
    """A 1 MiB prompt takes the real tokenizer ~1 s: on the loop, every stream would stall.
    (`capped`: `client` takes bodies of 8 KiB only.)"""
    client = capped
    service = client.app.state.runs
    seen: list[bool] = []
    originals = service.encode, service.encode_chat

    def on_loop() -> bool:
        import asyncio

        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    service.encode = lambda text: seen.append(on_loop()) or originals[0](text)
    service.encode_chat = lambda messages: seen.append(on_loop()) or originals[1](messages)
    try:
        for path, body in ENDPOINTS.items():  # short: inline, no thread hop
            assert client.post(path, json=body | {"max_tokens": 1}).status_code == 200
        long = "x" * (INLINE_TOKENIZE_CHARS + 1)  # then over the context: a 400, but tokenized
        for path, body in [("/v1/completions", {"prompt": long}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": long}]})]:
            assert client.post(path, json=body).status_code == 400
    finally:
        service.encode, service.encode_chat = originals
    assert seen == [True, True, False, False]


def test_declared_length_is_refused_before_the_body_arrives():
    """Over real HTTP: a huge Content-Length gets its 413 without the server waiting for (or
    reading) the body, and a chunked body is cut off once it passes the cap."""
    import socket

    from live_server import serving

    with serving(make_app(max_body_bytes=MAX_BODY)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
            head = sock.recv(4096)  # times out (and fails) if the server waits for the body
        assert head.startswith(b"HTTP/1.1 413"), head[:100]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b" " * 4096
            for _ in range(3):  # 12 KiB of an endless body, never its last chunk
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 413"), head[:100]


# ---- the queue bound -------------------------------------------------------------------------
def test_full_queue_is_a_429_with_retry_after():
    app = make_app(engine={"max_num_seqs": 1}, max_waiting_requests=1)
    with TestClient(app) as c:
        engine, service = c.app.state.engine, c.app.state.runs
        gate = threading.Event()
        engine.before_forward = lambda plan: gate.wait(30)  # hold the engine mid-step

        async def occupy():
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            return [service.start(RunRequest(engine.encode("x"), params, "/test"))
                    for _ in range(2)]  # one running (max_num_seqs) + one waiting

        runs = c.portal.call(occupy)
        try:
            assert service.in_flight == 2
            for path, body in ENDPOINTS.items():
                r = c.post(path, json=body | {"max_tokens": 2})
                error = assert_error(r, 429, None, "queue_full")
                assert "1 run at once and 1 wait" in error["message"]
                assert int(r.headers["retry-after"]) >= 1
            # The playground shares the bound.
            r = c.post("/playground", data={"mode": "raw", "prompt": "hi", "max_tokens": "2"},
                       headers={"accept": "application/json", "origin": "http://testserver"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        finally:
            engine.before_forward = None
            gate.set()
        for run in runs:
            c.portal.call(run.collect)
        assert service.in_flight == 0
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


# ---- nothing left behind -----------------------------------------------------------------------
def test_a_burst_of_bad_requests_leaks_nothing(client, engine):
    service = client.app.state.runs
    bodies = [
        ("/v1/completions", {"prompt": "x" * 600, "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 100}),
        ("/v1/completions", {"prompt": [5] * 511, "max_tokens": 2}),
        ("/v1/completions", {"prompt": [300]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 600}]}),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2}),
        ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 5}),
    ]
    for _ in range(5):
        for path, body in bodies:
            assert client.post(path, json=body).status_code in (200, 400)
        client.post("/v1/completions", content=b"{bad")
    # A streamed request the client leaves after the first chunk is cancelled, not left open.
    with client.stream("POST", "/v1/completions", json={
            "prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
        next(r.iter_lines())
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200
    for _ in range(200):
        if service.in_flight == 0 and not engine.scheduler.has_work():
            break
        threading.Event().wait(0.02)
    assert service.in_flight == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_limit_flags():
    from app.cli import build_parser
    from app.settings import Settings

    args = build_parser().parse_args(["serve", "--max-waiting-requests", "3",
                                      "--max-tokens-limit", "50"])
    s = settings_from_args(args, environ={})
    assert (s.max_waiting_requests, s.max_tokens_limit) == (3, 50)
    s = settings_from_args(build_parser().parse_args(["serve"]), environ={})
    assert (s.max_waiting_requests, s.max_tokens_limit) == (256, None)
    for bad in ({"max_waiting_requests": -1}, {"max_waiting_requests": None},
                {"max_tokens_limit": 0}, {"max_tokens_limit": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Settings(**bad)
