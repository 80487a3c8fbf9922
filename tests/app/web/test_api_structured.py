"""Structured outputs on the API: OpenAI's response_format (json_object, json_schema) and vLLM's
structured_outputs, in chat and completions, streamed and not; refusals naming the parameter
with nothing left running; and the official client's `.parse()` on the embedded model."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from api_helpers import CHAT, FakeRecorder, assert_error, make_app
from live_server import serving
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

from app.settings import Settings
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                 "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client():
    with TestClient(make_app()) as c:
        yield c


def idle(client) -> bool:
    engine = client.app.state.engine
    return (client.app.state.runs.in_flight == 0 and not engine.scheduler.has_work()
            and engine.block_manager.num_used_blocks == 0)


@pytest.mark.parametrize(("extra", "check"), [
    ({"structured_outputs": {"regex": "[a-d]{3,5}"}},
     lambda text: re.fullmatch("[a-d]{3,5}", text)),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda text: text in ("red", "green")),
    ({"structured_outputs": {"grammar": 'start: "x" ("y" | "z")'}},
     lambda text: text in ("xy", "xz")),
    ({"structured_outputs": {"json": SCHEMA}}, lambda text: 1 <= json.loads(text)["n"] <= 9),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
     lambda text: 1 <= json.loads(text)["n"] <= 9),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": True,
                                                                 "schema": SCHEMA}}},
     lambda text: 1 <= json.loads(text)["n"] <= 9),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_output_follows_the_structure(client, path, extra, check):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    r = client.post(path, json={**body, **extra, "max_tokens": 40, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
    assert check(text), text
    assert choice["finish_reason"] == "stop"


def test_json_object_and_streaming(client):
    body = {"messages": CHAT, "response_format": {"type": "json_object"}, "max_tokens": 60,
            "temperature": 0, "structured_outputs": None}
    whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == whole["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    if whole["finish_reason"] == "stop":  # the tiny model may fill max_tokens inside a string
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


@pytest.mark.parametrize(("extra", "param"), [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_structures_are_400s_naming_the_parameter_and_nothing_runs(client, path, extra,
                                                                      param):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    assert_error(client.post(path, json={**body, **extra}), 400, param)
    assert idle(client)


def test_the_run_record_keeps_the_structure():
    recorder = FakeRecorder()
    with TestClient(make_app(recorder)) as c:
        r = c.post("/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 8, "response_format": {
                "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}})
        assert r.status_code == 200, r.text
    params = recorder.started[-1]["params"]
    assert params["structured"] == {"kind": "json", "spec": json.dumps(SCHEMA)}
    assert params["speculative"] is True  # a constrained request takes drafts too


# ---- the official client on the embedded model ------------------------------------------------
class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)


class Owner(BaseModel):
    name: str = Field(max_length=16)
    pets: list[Pet] = Field(min_length=1, max_length=2)


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=100)


class Point(BaseModel):
    x: int = Field(ge=-10, le=10)
    y: int = Field(ge=-10, le=10)


class Shape(BaseModel):
    label: str = Field(max_length=10)
    points: list[Point] = Field(min_length=2, max_length=3)


@pytest.fixture(scope="module")
def embedded() -> Iterator[openai.OpenAI]:
    settings = Settings(engine=EngineConfig(num_kv_blocks=256))
    app = create_app(settings, engine_factory=lambda config: Engine(config))
    with serving(app, 120) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x",
                                                 max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.slow
@pytest.mark.parametrize(("model", "question"), [
    (Pet, "Describe a pet as JSON."),
    (Owner, "Describe a person and their pets as JSON."),
    (Answer, "Is the sky blue? Answer as JSON."),
    (Shape, "Give a triangle as JSON."),
])
def test_the_official_client_parses_pydantic_models(embedded, model, question):
    served = embedded.models.list().data[0].id
    out = embedded.chat.completions.parse(
        model=served, messages=[{"role": "user", "content": question}], response_format=model,
        temperature=0, max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)
    assert model.model_validate_json(choice.message.content) == choice.message.parsed
