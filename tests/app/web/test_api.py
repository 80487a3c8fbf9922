"""The OpenAI-compatible API against the ASGI app, on the tiny random model (fast, real engine)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import pytest
from api_helpers import CHAT, MAX_BODY, MODEL, FakeRecorder, assert_error, make_app
from speculation import SPEC, ScriptedDrafts
from starlette.testclient import TestClient

from app.cli.serve import settings_from_args
from app.runs import RunRequest, RunService
from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import FinishEvent, TokenEvent
from engine.sampling import SamplingParams
from engine.testing import tiny_model


@pytest.fixture(scope="module")
def recorder() -> FakeRecorder:
    return FakeRecorder()


@pytest.fixture(scope="module")
def client(recorder):
    app = make_app(recorder, max_body_bytes=MAX_BODY)
    with TestClient(app) as c:
        yield c
    assert recorder.closed


@pytest.fixture(scope="module")
def engine(client) -> Engine:
    return client.app.state.engine


def greedy_text(engine: Engine, prompt, n: int) -> FinishEvent:
    return engine.generate(prompt, SamplingParams(max_tokens=n))


def sse_data(response) -> list[str]:
    """The raw `data:` payloads, checking the framing: `data: ...` blocks split by blank lines."""
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert "\r" not in body
    assert body.endswith("\n\n")
    blocks = body[:-2].split("\n\n")
    payloads = []
    for block in blocks:
        if block.startswith(":"):  # keep-alive comment
            continue
        assert block.startswith("data: ") and "\n" not in block, block
        payloads.append(block[len("data: "):])
    assert payloads[-1] == "[DONE]"
    assert "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def chunks(response) -> list[dict]:
    return [json.loads(p) for p in sse_data(response)]


# ---- completions ---------------------------------------------------------------------------
def test_completion_matches_the_engine_and_has_openai_shape(client, engine, recorder):
    before = time.time()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello",
                                             "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    expected = greedy_text(engine, "hello", 8)
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert int(before) <= body["created"] <= time.time() + 1
    [choice] = body["choices"]
    assert choice == {"index": 0, "text": expected.text, "logprobs": None,
                      "finish_reason": expected.reason}
    usage = body["usage"]
    assert usage["prompt_tokens"] == 5
    assert usage["completion_tokens"] == expected.completion_tokens
    assert usage["total_tokens"] == 5 + expected.completion_tokens

    # The recorder saw the run from start to finish under the same id.
    [started] = [s for s in recorder.started if s["run_id"] == body["id"]]
    assert started["session_id"] == 7
    assert started["source"] == "api" and started["endpoint"] == "/v1/completions"
    assert started["model"] == MODEL and started["weights"] == "q4"
    assert started["prompt_text"] == "hello" and started["messages"] is None
    assert started["prompt_token_ids"] == engine.encode("hello")
    assert started["params"]["max_tokens"] == 8 and started["params"]["temperature"] == 0.0
    assert started["queued_at"] >= before
    tokens = [t for t in recorder.tokens if t.request_id == body["id"]]
    assert [t.token_id for t in tokens] == expected.token_ids
    assert recorder.finish_of(body["id"]).reason == expected.reason


def test_penalties_and_logit_bias_reach_the_engine_and_the_run(client, engine, recorder):
    penalties = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {"70": 3}}
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "xxxxxxxx",
                                             "max_tokens": 12, "temperature": 0, **penalties})
    assert r.status_code == 200, r.text
    expected = engine.generate("xxxxxxxx", SamplingParams(
        max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5, logit_bias={70: 3.0}))
    assert r.json()["choices"][0]["text"] == expected.text
    assert expected.token_ids != engine.generate("xxxxxxxx", SamplingParams(
        max_tokens=12)).token_ids  # the adjustments change this output
    [started] = [s for s in recorder.started if s["run_id"] == r.json()["id"]]
    assert started["params"]["frequency_penalty"] == 1.5
    assert started["params"]["logit_bias"] == [[70, 3.0]]


def test_speculative_extension_opts_a_request_out_of_drafts():
    """`speculative` (default true) reaches SamplingParams: false means no verify rows."""
    drafts, recorder = ScriptedDrafts(), FakeRecorder()
    with TestClient(make_app(recorder, engine=SPEC, proposer=drafts)) as c:
        engine = c.app.state.engine
        for path, body in (("/v1/completions", {"prompt": "hello"}),
                           ("/v1/chat/completions", {"messages": CHAT})):
            plain = c.post(path, json=body | {"max_tokens": 12, "temperature": 0,
                                              "ignore_eos": True, "speculative": False})
            assert plain.status_code == 200, plain.text
            [started] = [s for s in recorder.started if s["run_id"] == plain.json()["id"]]
            assert started["params"]["speculative"] is False
            drafts.learn(started["prompt_token_ids"],
                         recorder.finish_of(started["run_id"]).token_ids)
            spec = c.post(path, json=body | {"max_tokens": 12, "temperature": 0,
                                             "ignore_eos": True})
            assert spec.status_code == 200, spec.text
            run_id = spec.json()["id"]
            assert [s for s in recorder.started if s["run_id"] == run_id][0]["params"][
                "speculative"] is True
            phases = {i: {e.phase for r in engine.steps.recent() for e in r.entries
                          if e.request_id == i} for i in (started["run_id"], run_id)}
            assert "verify" not in phases[started["run_id"]]
            assert "verify" in phases[run_id]
            # The same greedy text either way, drafted tokens marked on the events.
            assert recorder.finish_of(run_id).token_ids == \
                recorder.finish_of(started["run_id"]).token_ids
            assert any(t.drafted for t in recorder.tokens if t.request_id == run_id)


def test_prompt_forms_give_the_same_completion(client, engine):
    forms = ["hello", ["hello"], engine.encode("hello"), [engine.encode("hello")]]
    texts = []
    for prompt in forms:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert len(set(texts)) == 1


def test_default_max_tokens_is_16(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "temperature": 0,
                                             "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16


def test_streamed_completion_framing_and_text(client, engine):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 12,
                                             "temperature": 0, "stream": True})
    assert r.status_code == 200
    got = chunks(r)
    expected = greedy_text(engine, "abc", 12)
    assert {c["object"] for c in got} == {"text_completion"}
    assert len({c["id"] for c in got}) == 1 and got[0]["id"].startswith("cmpl-")
    assert all(c["model"] == MODEL and "usage" not in c for c in got)
    assert "".join(c["choices"][0]["text"] for c in got) == expected.text
    assert [c["choices"][0]["finish_reason"] for c in got[:-1]] == [None] * (len(got) - 1)
    assert got[-1]["choices"][0]["finish_reason"] == expected.reason


def test_stream_include_usage_adds_a_final_usage_chunk(client):
    # A prompt no other test sends: nothing of it is cached (the prefix cache copies even a
    # row or two of an earlier request's last block).
    r = client.post("/v1/completions", json={"prompt": "qrs", "max_tokens": 5,
                                             "ignore_eos": True, "stream": True,
                                             "stream_options": {"include_usage": True}})
    got = chunks(r)
    *content, last = got
    assert all(c["usage"] is None for c in content)
    assert last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert content[-1]["choices"][0]["finish_reason"] == "length"


def test_completion_logprobs_shape(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "logprobs": 3,
                                             "temperature": 0, "ignore_eos": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(lp[k]) == 6 for k in lp)
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                   strict=True):
        assert isinstance(token, str) and logprob <= 0
        assert 1 <= len(top) <= 4 and token in top
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the best one
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_as_token_ids_in_both_endpoints(client, engine, stream):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N", N the engine's
    own id, in the sampled token and its alternatives."""
    expected = engine.generate("abc", SamplingParams(max_tokens=5, ignore_eos=True)).token_ids
    names = [f"token_id:{t}" for t in expected]
    common = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": stream,
              "return_tokens_as_token_ids": True}
    r = client.post("/v1/completions", json={"prompt": "abc", "logprobs": 2, **common})
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "abc"}], "logprobs": True, "top_logprobs": 2,
        **common})
    if stream:
        choices = [json.loads(d)["choices"] for d in sse_data(r)[:-1]]
        tokens = [t for c in choices if c for t in (c[0]["logprobs"] or {}).get("tokens", [])]
        tops = [k for c in choices if c for top in (c[0]["logprobs"] or {}).get(
            "top_logprobs", []) for k in top]
    else:
        lp = r.json()["choices"][0]["logprobs"]
        tokens, tops = lp["tokens"], [k for top in lp["top_logprobs"] for k in top]
    assert tokens == names
    assert all(k.startswith("token_id:") and int(k[9:]) >= 0 for k in tops)
    assert chat.status_code == 200
    if not stream:
        content = chat.json()["choices"][0]["logprobs"]["content"]
        assert all(e["token"].startswith("token_id:") for e in content)
        assert all(t["token"].startswith("token_id:") for e in content
                   for t in e["top_logprobs"])


def test_completion_logprobs_zero_still_gives_the_sampled_token(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "logprobs": 0,
                                             "ignore_eos": True})
    lp = r.json()["choices"][0]["logprobs"]
    assert all(len(top) == 1 for top in lp["top_logprobs"])


def test_streamed_completion_logprobs_per_chunk(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "logprobs": 2,
                                             "ignore_eos": True, "stream": True})
    token_chunks = [c for c in chunks(r) if c["choices"][0]["finish_reason"] is None]
    assert len(token_chunks) == 4
    for c in token_chunks:
        lp = c["choices"][0]["logprobs"]
        assert all(len(lp[k]) == 1 for k in ("tokens", "token_logprobs", "top_logprobs",
                                             "text_offset"))


def first_ascii(text: str, start: int = 2) -> str:
    return next(ch for ch in text[start:] if ch.isascii() and ch.isalnum())


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, engine, stream):
    full = greedy_text(engine, "hello", 40).text
    stop = first_ascii(full)
    expected = full[:full.index(stop)]
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 40,
                                             "temperature": 0, "stop": [stop, "zzzz"],
                                             "stream": stream})
    if stream:
        got = chunks(r)
        text = "".join(c["choices"][0]["text"] for c in got)
        reason = got[-1]["choices"][0]["finish_reason"]
    else:
        text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert (text, reason) == (expected, "stop")


# ---- chat ----------------------------------------------------------------------------------
def test_chat_completion_matches_the_engine(client, engine, recorder):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT,
                                                  "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    prompt_ids = engine.encode_chat(CHAT)
    expected = greedy_text(engine, prompt_ids, 10)
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == expected.text
    assert choice["finish_reason"] == expected.reason
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == expected.completion_tokens
    [started] = [s for s in recorder.started if s["run_id"] == body["id"]]
    assert started["endpoint"] == "/v1/chat/completions"
    assert started["messages"] == CHAT and started["prompt_token_ids"] == prompt_ids
    assert started["prompt_text"] == "<system>be brief\n<user>hi\n<assistant>"


def test_chat_content_parts_equal_plain_content(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"},
                                          {"type": "text", "text": "i"}]}]
    plain = [{"role": "user", "content": "hi"}]
    out = [client.post("/v1/chat/completions",
                       json={"messages": m, "max_tokens": 6, "temperature": 0}).json()
           for m in (parts, plain)]
    assert out[0]["choices"][0]["message"] == out[1]["choices"][0]["message"]


def test_chat_max_completion_tokens_wins(client):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 9,
                                                  "max_completion_tokens": 3,
                                                  "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 3


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "temperature": 0,
                                                  "seed": 1})
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["total_tokens"] <= engine.max_model_len


def test_streamed_chat_with_usage(client, engine):
    r = client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 10, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    got = chunks(r)
    expected = greedy_text(engine, engine.encode_chat(CHAT), 10)
    assert {c["object"] for c in got} == {"chat.completion.chunk"}
    assert len({c["id"] for c in got}) == 1
    first, *content, usage = got
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in content]
    assert "".join(d.get("content", "") for d in deltas) == expected.text
    assert all(c["choices"][0]["finish_reason"] is None for c in [first, *content[:-1]])
    assert content[-1]["choices"][0]["finish_reason"] == expected.reason
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == \
        expected.completion_tokens
    assert all(c["usage"] is None for c in [first, *content])


def test_chat_logprobs_shape(client):
    r = client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 3})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["refusal"] is None and len(lp["content"]) == 5
    for entry in lp["content"]:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        # A token may be part of a UTF-8 character: bytes are the token's own, not its text's.
        assert entry["token"] == bytes(entry["bytes"]).decode("utf-8", errors="replace")
        assert len(entry["top_logprobs"]) == 3
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
    joined = b"".join(bytes(e["bytes"]) for e in lp["content"])
    assert joined.decode("utf-8", errors="replace") == choice["message"]["content"]


def test_chat_logprobs_without_top(client):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2,
                                                  "ignore_eos": True, "logprobs": True})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in content] == [[], []]


def test_streamed_chat_logprobs(client):
    r = client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 3, "ignore_eos": True, "stream": True,
        "logprobs": True, "top_logprobs": 1})
    got = chunks(r)
    with_lp = [c for c in got if c["choices"][0]["logprobs"]]
    assert len(with_lp) == 3
    assert all(len(c["choices"][0]["logprobs"]["content"]) == 1 for c in with_lp)


# ---- models --------------------------------------------------------------------------------
def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(client.get("/v1/models/gpt-4"), 404, "model", "model_not_found")


def test_unknown_routes_and_methods_are_json(client):
    assert_error(client.get("/v1/nothing-here"), 404, None, "not_found")
    assert_error(client.get("/v1/completions"), 405, None, "method_not_allowed")


def test_bugs_are_json_500s(client, caplog):
    service = client.app.state.runs

    def broken(prompt):
        raise RuntimeError("boom")

    original = service.encode
    service.encode = broken
    try:
        # No `with`: the app's lifespan is already running under `client`.
        raw = TestClient(client.app, raise_server_exceptions=False)
        r = raw.post("/v1/completions", json={"prompt": "hi"})
    finally:
        service.encode = original
    assert_error(r, 500, None, "internal_error")
    assert "boom" not in r.text  # details go to the log, not to the client
    assert any("RuntimeError" in rec.getMessage() for rec in caplog.records)


@pytest.fixture
def failing_engine(engine):
    def fail(plan):
        raise RuntimeError("injected fault")

    engine.before_forward = fail
    yield engine
    engine.before_forward = None


def test_engine_failure_non_streamed_is_a_json_500(client, failing_engine):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    error = assert_error(r, 500, None, "engine_error")
    assert "injected fault" in error["message"]


def test_engine_failure_streamed_ends_with_an_error_chunk(client, failing_engine):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3,
                                                  "stream": True})
    *_, last = chunks(r)
    assert last["error"]["type"] == "server_error"
    assert "injected fault" in last["error"]["message"]


# ---- lifespan and recorder -------------------------------------------------------------------
def test_session_and_steps_recorded(client, recorder, engine):
    client.post("/v1/completions", json={"prompt": "steps", "max_tokens": 2})
    [session] = recorder.sessions
    assert session["model"] == MODEL and session["weights"] == "q4"
    assert session["kernel_policy"] == "gemm"
    assert session["config"]["num_kv_blocks"] == 128
    assert session["config"]["max_model_len"] == engine.max_model_len
    assert recorder.steps and all(sid == 7 for sid, _ in recorder.steps)
    assert recorder.steps[-1][1].step <= engine.step_count


def test_app_without_recorder_serves():
    with TestClient(make_app()) as c:
        assert c.app.state.recorder is None
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        engine = c.app.state.engine
    assert not engine.running  # stopped at shutdown


# ---- RunService on its own -------------------------------------------------------------------
def test_run_service_cancels_when_the_consumer_leaves(make_engine):
    engine = make_engine()
    recorder = FakeRecorder()
    service = RunService(engine, recorder, session_id=1)

    async def consume_one() -> str:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        run = service.start(RunRequest(engine.encode("hi"), params, "/test", "test"))
        async for event in run.events():
            assert isinstance(event, TokenEvent)
            break  # the consumer goes away after one token
        for _ in range(200):  # the pump records the engine's cancelled finish
            if run.finish is not None:
                break
            await asyncio.sleep(0.01)
        return run.id

    run_id = asyncio.run(asyncio.wait_for(consume_one(), 10))
    finish = recorder.finish_of(run_id)
    assert finish.reason == "cancelled" and finish.completion_tokens < 400
    assert engine.block_manager.num_used_blocks == 0
    assert recorder.started[0]["source"] == "test"


def test_run_service_value_errors_submit_nothing(make_engine):
    engine = make_engine()
    recorder = FakeRecorder()
    service = RunService(engine, recorder)

    async def start_empty() -> None:
        service.start(RunRequest([], SamplingParams(), "/test"))

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(start_empty())
    assert recorder.started == []


def test_settings_from_args_and_environment():
    from app.cli import build_parser

    args = build_parser().parse_args(["serve", "--port", "9001", "--num-kv-blocks", "64"])
    s = settings_from_args(args, environ={"BATCHSCOPE_DB": "/tmp/x.db",
                                          "BATCHSCOPE_PORT": "1234"})
    assert (s.host, s.port, s.db_path) == ("127.0.0.1", 9001, "/tmp/x.db")
    assert s.engine.num_kv_blocks == 64 and s.url == "http://127.0.0.1:9001"
    with pytest.raises(ValueError, match="port"):
        Settings(port=70000)
    args = build_parser().parse_args(["serve"])
    assert settings_from_args(args, environ={}).port == 8000


def test_a_thread_can_use_the_api_while_requests_run(client):
    """Concurrent requests share engine steps and all complete."""
    results: list[int] = []

    def call() -> None:
        r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8,
                                                 "ignore_eos": True})
        results.append(r.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [8, 8, 8, 8]


def test_recorder_factory_may_be_a_context_manager():
    events: list[str] = []
    recorder = FakeRecorder()

    @contextlib.contextmanager
    def factory(settings):
        events.append("enter")
        yield recorder
        events.append("exit")

    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=128)),
                     engine_factory=lambda config: Engine(config, loader=tiny_model),
                     recorder_factory=factory)
    with TestClient(app) as c:
        assert c.app.state.recorder is recorder and c.app.state.session_id == 7
        assert events == ["enter"]
    assert events == ["enter", "exit"] and not recorder.closed  # the context manager owns it


def test_serve_records_into_sqlite(tmp_path):
    """`batchscope serve`'s recorder: runs land in the database by the time the app stops."""
    from sqlalchemy import create_engine, select

    from app.cli.serve import runs_recorder
    from app.db.models import Run

    settings = Settings(db_path=str(tmp_path / "runs.db"), engine=EngineConfig(num_kv_blocks=128))
    app = create_app(settings, engine_factory=lambda config: Engine(config, loader=tiny_model),
                     recorder_factory=runs_recorder)
    with TestClient(app) as c:
        run_id = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                 "ignore_eos": True}).json()["id"]
    db = create_engine(f"sqlite:///{settings.db_path}")
    try:
        with db.connect() as conn:
            rows = conn.execute(select(Run.id, Run.status, Run.completion_tokens)).all()
    finally:
        db.dispose()
    assert [tuple(r) for r in rows] == [(run_id, "finished", 3)]
