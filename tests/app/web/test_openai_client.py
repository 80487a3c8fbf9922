"""A real uvicorn server on 127.0.0.1 (tiny model), driven by the official `openai` client."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from api_helpers import FakeRecorder
from live_server import serving

from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import tiny_model

MODEL = "tiny-llama"
TIMEOUT = 20.0


@dataclass
class LiveServer:
    url: str
    engine: Engine
    recorder: FakeRecorder


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    recorder = FakeRecorder()
    engines: list[Engine] = []

    def engine_factory(config: EngineConfig) -> Engine:
        engines.append(Engine(config, loader=tiny_model))
        return engines[-1]

    settings = Settings(engine=EngineConfig(num_kv_blocks=128))
    app = create_app(settings, engine_factory=engine_factory,
                     recorder_factory=lambda s: recorder)
    with serving(app, TIMEOUT) as url:
        yield LiveServer(url, engines[0], recorder)
    assert not engines[0].running


@pytest.fixture(scope="module")
def client(live) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0,
                       timeout=TIMEOUT) as c:
        yield c


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_completion(client):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason in ("stop", "length")
    assert isinstance(out.choices[0].text, str)
    assert out.usage.prompt_tokens == 5
    assert out.usage.total_tokens == 5 + out.usage.completion_tokens <= 13


def test_streamed_chat_completion_with_usage(client):
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                           temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})
    deltas, finish_reasons, usage = [], [], None
    with stream:
        for chunk in stream:
            assert chunk.object == "chat.completion.chunk"
            if chunk.choices:
                deltas.append(chunk.choices[0].delta.content or "")
                finish_reasons.append(chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                assert not chunk.choices
                usage = chunk.usage
    assert "".join(deltas) == whole.choices[0].message.content
    assert finish_reasons[-1] == whole.choices[0].finish_reason
    assert all(r is None for r in finish_reasons[:-1])
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_models_list(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_errors_raise_the_clients_exceptions(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, n=17)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


def test_client_disconnect_cancels_the_request(live):
    engine = live.engine
    engine.before_forward = lambda plan: time.sleep(0.02)  # 400 tokens would take 8 s or more
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}],
                "max_tokens": 400, "ignore_eos": True, "stream": True,
                "logprobs": True}  # every token then sends a chunk, even with no text yet
        with httpx.Client(timeout=TIMEOUT) as http:
            with http.stream("POST", f"{live.url}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunk = json.loads(line[len("data: "):])
                        if chunk["choices"][0]["logprobs"]:  # a token came: it is running
                            run_id = chunk["id"]
                            break
                assert engine.block_manager.num_used_blocks > 0
            # Leaving the block closes the half-read response, and with it the connection.
        assert wait_for(lambda: any(f.request_id == run_id for f in live.recorder.finished))
        finish = next(f for f in live.recorder.finished if f.request_id == run_id)
        assert finish.reason == "cancelled"
        assert finish.completion_tokens < 400
        assert wait_for(lambda: engine.block_manager.num_used_blocks == 0)
    finally:
        engine.before_forward = None


def test_client_leaving_a_non_streamed_request_cancels_it(live):
    engine = live.engine
    engine.before_forward = lambda plan: time.sleep(0.02)
    try:
        body = {"model": MODEL, "prompt": "wait for it", "max_tokens": 400, "ignore_eos": True}
        started = len(live.recorder.started)
        with httpx.Client(timeout=httpx.Timeout(TIMEOUT, read=0.5)) as http:
            with pytest.raises(httpx.ReadTimeout):  # gives up, closing the connection
                http.post(f"{live.url}/v1/completions", json=body)
        run_id = live.recorder.started[started]["run_id"]
        assert wait_for(lambda: any(f.request_id == run_id for f in live.recorder.finished))
        finish = next(f for f in live.recorder.finished if f.request_id == run_id)
        assert finish.reason == "cancelled" and finish.completion_tokens < 400
        assert wait_for(lambda: engine.block_manager.num_used_blocks == 0)
    finally:
        engine.before_forward = None
