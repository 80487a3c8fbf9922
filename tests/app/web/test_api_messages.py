"""POST /v1/messages (Anthropic's Messages API) on a real uvicorn server (tiny model), driven by
the official `anthropic` client and by plain HTTP for the raw shapes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import anthropic
import httpx
import pytest
from api_helpers import MODEL, FakeRecorder, make_app
from live_server import serving

from app.web.api.messages import MessagesRequest, _stop, chat_messages
from app.web.api.params import validate
from engine.engine import Engine
from engine.events import FinishEvent

TIMEOUT = 20.0
USER = [{"role": "user", "content": "hi"}]
# The client has no temperature argument any more (the server still takes it): greedy through
# the body, for outputs to compare.
GREEDY = {"temperature": 0}


@dataclass
class Live:
    url: str
    engine: Engine
    recorder: FakeRecorder

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=TIMEOUT)

    def finish(self, run_id: str) -> FinishEvent:
        return self.recorder.finish_of(run_id)

    def started(self, run_id: str) -> dict:
        return next(s for s in self.recorder.started if s["run_id"] == run_id)


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    recorder = FakeRecorder()
    app = make_app(recorder)
    with serving(app, TIMEOUT) as url:
        live = Live(url, app.state.engine, recorder)
        yield live
        # Nothing left running: every run finished, every KV block back in the pool.
        assert app.state.runs.in_flight == 0
        assert live.engine.block_manager.num_used_blocks == 0
        assert {s["run_id"] for s in recorder.started} == {f.request_id for f in
                                                          recorder.finished}


@pytest.fixture(scope="module")
def client(live) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0,
                             timeout=TIMEOUT) as c:
        yield c


def chat(live: Live, messages: list[dict], **params) -> dict:
    r = live.post("/v1/chat/completions", {"model": MODEL, "messages": messages, **params})
    assert r.status_code == 200, r.text
    return r.json()


# ---- answers -----------------------------------------------------------------------------------
def test_a_message_is_the_chat_completion_of_the_same_conversation(live, client):
    out = client.messages.create(model=MODEL, max_tokens=12, messages=USER,
                                 extra_body=GREEDY)
    assert out.type == "message" and out.role == "assistant" and out.model == MODEL
    assert out.id.startswith("msg")
    same = chat(live, USER, max_tokens=12, temperature=0)
    assert [block.type for block in out.content] == ["text"]
    assert out.content[0].text == same["choices"][0]["message"]["content"]
    # The same prompt, the same greedy tokens.
    started, other = live.started(out.id), live.started(same["id"])
    assert started["endpoint"] == "/v1/messages" and started["messages"] == USER
    assert started["prompt_token_ids"] == other["prompt_token_ids"]
    assert live.finish(out.id).token_ids == live.finish(same["id"]).token_ids
    assert out.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert out.usage.output_tokens == same["usage"]["completion_tokens"] == 12
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None


def test_a_system_prompt_as_text_or_blocks_is_the_chats_system_message(live, client):
    system = [{"role": "system", "content": "be brief"}]
    same = chat(live, system + USER, max_tokens=8, temperature=0)
    for given in ("be brief", [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]):
        out = client.messages.create(model=MODEL, max_tokens=8, system=given, messages=USER,
                                     extra_body=GREEDY)
        assert live.started(out.id)["messages"] == system + USER
        assert live.finish(out.id).token_ids == live.finish(same["id"]).token_ids
        assert out.content[0].text == same["choices"][0]["message"]["content"]


def test_max_tokens_stops_with_max_tokens(client):
    out = client.messages.create(model=MODEL, max_tokens=3, messages=USER, extra_body=GREEDY)
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert out.usage.output_tokens == 3


def _clean_pair(text: str) -> str:
    """Two characters of the output (no U+FFFD of a partial byte), past its start."""
    return next(text[i:i + 2] for i in range(2, len(text) - 1)
                if "\ufffd" not in text[i:i + 2])


def test_a_stop_sequence_stops_with_stop_sequence(client):
    whole = client.messages.create(model=MODEL, max_tokens=40, messages=USER,
                                   extra_body=GREEDY).content[0].text
    stop = _clean_pair(whole)
    out = client.messages.create(model=MODEL, max_tokens=40, messages=USER,
                                 stop_sequences=["\x00never", stop], extra_body=GREEDY)
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert out.content[0].text == whole[:whole.find(stop)]
    assert out.usage.output_tokens < 40


def test_end_of_sequence_is_end_turn_and_the_earliest_stop_sequence_wins():
    class Service:
        def token_bytes(self, token_id: int) -> bytes:
            return bytes([token_id])

    def finish(reason: str, text: bytes) -> FinishEvent:
        return FinishEvent("r", reason, "", "", list(text), 1, len(text), 0, 0, 0.0, None,
                           None, 0.0)

    assert _stop(Service(), finish("stop", b"done"), []) == ("end_turn", None)
    assert _stop(Service(), finish("stop", b"done"), ["x"]) == ("end_turn", None)
    assert _stop(Service(), finish("length", b"done"), ["on"]) == ("max_tokens", None)
    assert _stop(Service(), finish("stop", b"a bc"), ["bc", "b", " "]) == ("stop_sequence", " ")


# ---- streams -----------------------------------------------------------------------------------
def _events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) for each SSE event, checking each names its own `type`."""
    assert response.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in response.text.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 2 and lines[0].startswith("event: "), block
        assert lines[1].startswith("data: "), block
        name, data = lines[0][len("event: "):], json.loads(lines[1][len("data: "):])
        assert data["type"] == name
        out.append((name, data))
    return out


def test_a_stream_is_anthropics_event_sequence_of_the_same_text(live, client):
    body = {"model": MODEL, "max_tokens": 16, "messages": USER}
    whole = client.messages.create(**body, extra_body=GREEDY)
    events = _events(live.post("/v1/messages", body | GREEDY | {"stream": True}))
    names = [name for name, _ in events]
    deltas = [data for name, data in events if name == "content_block_delta"]
    assert names == (["message_start", "content_block_start", "ping"]
                     + ["content_block_delta"] * len(deltas)
                     + ["content_block_stop", "message_delta", "message_stop"])
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == whole.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"output_tokens": 16}
    # The official client reads the same stream into the same message.
    with client.messages.stream(**body, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16


def test_a_streamed_stop_sequence_is_in_the_message_delta(live, client):
    whole = client.messages.create(model=MODEL, max_tokens=40, messages=USER,
                                   extra_body=GREEDY).content[0].text
    stop = _clean_pair(whole)
    events = _events(live.post("/v1/messages", {
        "model": MODEL, "max_tokens": 40, "temperature": 0, "messages": USER, "stream": True,
        "stop_sequences": [stop]}))
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole[:whole.find(stop)]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    # A stop sequence that never comes holds the output's last characters back until the end.
    events = _events(live.post("/v1/messages", {
        "model": MODEL, "max_tokens": 40, "temperature": 0, "messages": USER, "stream": True,
        "stop_sequences": ["\x00never"]}))
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


# ---- tool blocks -------------------------------------------------------------------------------
TOOL_TURNS = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "checking"},
        {"type": "tool_use", "id": "t1", "name": "get", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "15C"},
        {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
         "content": [{"type": "text", "text": "down"}]},
        {"type": "text", "text": "so?"}]},
]


def test_tool_blocks_are_text_for_a_template_without_tools(live, client):
    out = client.messages.create(model=MODEL, max_tokens=2, messages=TOOL_TURNS)
    assert live.started(out.id)["messages"] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": 'checking\n[tool_use id=t1 name=get] {"city": "Paris"}'},
        {"role": "user", "content": "[tool_result id=t1] 15C\n[tool_result id=t2 error] down\n"
                                    "so?"}]


def test_tool_blocks_are_tool_calls_and_tool_messages_for_a_template_with_tools():
    req = validate(MessagesRequest, {"model": MODEL, "max_tokens": 2, "messages": TOOL_TURNS,
                                     "system": "s"}, {})
    assert chat_messages(req, speaks_tools=True) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "get", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "15C"},
        {"role": "tool", "tool_call_id": "t2", "content": "[error] down"},
        {"role": "user", "content": "so?"}]


# ---- bad input ---------------------------------------------------------------------------------
def _anthropic_error(r: httpx.Response, status: int, kind: str, *words: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    for word in words:
        assert word in body["error"]["message"], (word, body)


BASE = {"model": MODEL, "max_tokens": 4, "messages": USER}


@pytest.mark.parametrize("change, words", [
    ({"max_tokens": None}, ["max_tokens", "required"]),
    ({"messages": [{"role": "system", "content": "x"}]}, ["messages[0].role"]),
    ({"messages": []}, ["messages"]),
    ({"tools": [{"name": "get"}]}, ["tools[0].input_schema"]),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, ["thinking"]),
    ({"surprise": 1}, ["surprise"]),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, ["messages[0].content[0]"]),
    ({"messages": USER + [{"role": "assistant", "content": "pre"}]}, ["prefill"]),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]}, ["tool_use"]),
    ({"stop_sequences": ["a"] * 5}, ["stop_sequences"]),
    ({"temperature": 1.5}, ["temperature"]),
])
def test_bad_input_is_a_400_in_anthropics_shape_naming_it(live, change, words):
    started = len(live.recorder.started)
    body = {k: v for k, v in (BASE | change).items() if v is not None}
    _anthropic_error(live.post("/v1/messages", body), 400, "invalid_request_error", *words)
    assert len(live.recorder.started) == started  # refused before the engine


def test_errors_raise_the_clients_exceptions(live, client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "robot", "content": "x"}])
    assert info.value.status_code == 400
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-x", max_tokens=4, messages=USER)
    assert info.value.body["error"]["type"] == "not_found_error"
    _anthropic_error(live.post("/v1/messages", BASE | {"max_tokens": 10**6}), 400,
                     "invalid_request_error", "context window")
