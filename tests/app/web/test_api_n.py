"""n choices, best_of and echo through a real uvicorn server (tiny model) and the official
`openai` client: every choice by its index, whole and streamed, each recorded as a run."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace

import openai
import pytest
from api_helpers import FakeRecorder
from live_server import serving

from app.settings import Settings
from app.web.api.routes import _ChatShape, _CompletionShape, _sse
from app.web.app import create_app
from app.web.pages.dashboard import kv_map
from engine.config import EngineConfig
from engine.engine import Engine
from engine.events import TokenEvent
from engine.testing import tiny_model

MODEL = "tiny-llama"
PROMPT = "a shared prompt, long enough to fill some blocks"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def live() -> Iterator[SimpleNamespace]:
    recorder = FakeRecorder()
    engines: list[Engine] = []

    def engine_factory(config: EngineConfig) -> Engine:
        engines.append(Engine(config, loader=tiny_model))
        return engines[-1]

    settings = Settings(engine=EngineConfig(num_kv_blocks=128, block_size=4))
    app = create_app(settings, engine_factory=engine_factory,
                     recorder_factory=lambda s: recorder)
    with serving(app, 20.0) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x",
                                                  max_retries=0, timeout=20.0) as client:
        yield SimpleNamespace(client=client, engine=engines[0], recorder=recorder)


@pytest.fixture(autouse=True)
def _nothing_left(live):
    yield
    bm = live.engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_chat_n3_greedy_gives_three_choices_equal_to_one(live):
    one = live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                              temperature=0)
    three = live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                                temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_choices_carry_their_index_and_reassemble(live, endpoint):
    args = dict(model=MODEL, max_tokens=12, temperature=1.0, seed=11, n=3)
    if endpoint == "chat":
        create, args["messages"] = live.client.chat.completions.create, MESSAGES
    else:
        create, args["prompt"] = live.client.completions.create, PROMPT
    whole = create(**args)
    texts = [c.text if endpoint == "completions" else c.message.content for c in whole.choices]
    assert len(set(texts)) == 3  # seeded choices differ
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finishes: dict[int, str] = {}
    usage = None
    with create(**args, stream=True, stream_options={"include_usage": True}) as stream:
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                assert c.index not in finishes  # nothing after a choice's finish
                parts[c.index].append((c.text if endpoint == "completions"
                                       else c.delta.content) or "")
                if c.finish_reason is not None:
                    finishes[c.index] = c.finish_reason
    assert ["".join(parts[i]) for i in range(3)] == texts
    assert finishes == {i: c.finish_reason for i, c in enumerate(whole.choices)}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_each_choice_is_a_run_with_its_own_seed(live):
    before = len(live.recorder.started)
    out = live.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=3,
                                         temperature=1.0, seed=5)
    runs = live.recorder.started[before:]
    assert [r["run_id"] for r in runs] == [out.id, f"{out.id}-1", f"{out.id}-2"]
    assert [r["params"]["seed"] for r in runs] == [5, 6, 7]


def test_the_kv_map_shows_the_choices_sharing_the_prompt_blocks(live):
    engine = live.engine
    shared: list[dict] = []
    engine.before_forward = lambda plan: shared.append(kv_map(engine)["shared"])
    try:
        live.client.completions.create(model=MODEL, prompt=PROMPT + " (kv map)", max_tokens=6,
                                       temperature=0, n=3)
    finally:
        engine.before_forward = None
    assert any(len(holders) == 3 for step in shared for holders in step.values())


def test_best_of_returns_the_n_likeliest_choices(live):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, logprobs=0)
    four = live.client.completions.create(**args, n=4)
    cumulative = [math.fsum(c.logprobs.token_logprobs) for c in four.choices]
    ranked = sorted(range(4), key=lambda i: -cumulative[i])[:2]
    best = live.client.completions.create(**args, n=2, best_of=4)
    assert [c.text for c in best.choices] == [four.choices[i].text for i in ranked]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == four.usage.completion_tokens  # all four made


def test_echo_puts_the_prompt_before_each_choice(live):
    plain = live.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                           temperature=0, n=2)
    echoed = live.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                            temperature=0, n=2, echo=True)
    assert [c.text for c in echoed.choices] == [PROMPT + c.text for c in plain.choices]
    texts = {0: "", 1: ""}
    with live.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                        temperature=0, n=2, echo=True, stream=True) as stream:
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
    assert texts == {i: c.text for i, c in enumerate(echoed.choices)}


@pytest.mark.parametrize(("args", "param"), [
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of"), ({"best_of": 17}, "best_of"),
    ({"echo": True, "logprobs": 1}, "echo")])
def test_bad_choices_are_refused_naming_the_parameter(live, args, param):
    with pytest.raises(openai.BadRequestError) as info:
        live.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **args)
    assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        live.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                            n=17)
    assert info.value.body["param"] == "n"


@pytest.mark.parametrize("kind", [_CompletionShape, _ChatShape])
def test_each_choice_has_its_own_sse_frame(kind):
    runs = [SimpleNamespace(id="cmpl-0123456789abcdef01234567", created=1767225600.5)] * 3
    shape = kind(SimpleNamespace(model_name=MODEL), runs, False, False)
    for index in (2, 0, 1, 2):
        event = TokenEvent(runs[0].id, 0, 42, f"text {index}", -0.5, [], 0.0, 1)
        assert shape.token_sse(event, index) == _sse(shape.token_chunk(event, index))
