"""Tool calls: the parsers on fixed texts (every format, whole and streamed), the rendering of
tools and tool history, and /v1/chat/completions with tools driven by the official `openai`
client: forced calls (required, named) are well-formed even from the tiny model's random
weights, `auto` parses a scripted output, bad input is a 400 naming the field; and the
Messages API's tool_use blocks with the official `anthropic` client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import anthropic
import openai
import pytest
from api_helpers import FakeRecorder, assert_error
from live_server import serving
from starlette.testclient import TestClient

from app.settings import Settings
from app.web.api.tool_calls import PARSERS, ToolStream, detect, parse, parser
from app.web.api.tools import Tools, encode, fallback_messages, rendered
from app.web.app import create_app
from engine.config import EngineConfig
from engine.engine import Engine
from engine.testing import ByteTokenizer, FixedTextTokenizer, tiny_model

TIMEOUT = 30.0
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
USER = [{"role": "user", "content": "weather in Paris?"}]


# ---- the parsers, on fixed texts ---------------------------------------------------------------
CASES = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
               '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
     "Sure.\n", [("f", {"x": 1}), ("g", {})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": [1, "</tool_call>"]}}',  # unclosed
     "", [("f", {"x": [1, "</tool_call>"]})]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
               '{"name": "g", "parameters": {"y": "z"}}', "", [("f", {"x": 1}), ("g", {"y": "z"})]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, '
                '{"name": "g", "arguments": {}}]', "", [("f", {"x": 1}), ("g", {})]),
    ("qwen3-coder", "Let me check.\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n"
                    "<parameter=s>\ntwo words\n</parameter>\n</function>\n</tool_call>",
     "Let me check.\n", [("f", {"x": 1, "s": "two words"})]),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_each_format_parses_whole_and_streamed_alike(name, text, content, calls):
    text_out, found = parse(parser(name, None), text)
    assert (text_out, _calls(found)) == (content, calls)
    assert all(c.id.startswith("call_") for c in found)
    stream = ToolStream(parser(name, None))
    pieces = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert "".join(p[0] for p in pieces) == content  # never the raw tags
    assert _calls(c for p in pieces for c in p[1]) == calls


@pytest.mark.parametrize(("name", "text"), [
    ("hermes", "no call here, just <tool"),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>'),
    ("llama3", "{this is not a call"),
    ("llama3", '{"answer": 42}'),
    ("mistral", "[TOOL_CALLS] broken"),
    ("qwen3-coder", "<tool_call>\n<function=f>\n</tool_call>"),
])
def test_what_is_not_a_call_stays_the_models_text(name, text):
    assert parse(parser(name, None), text) == (text, [])


def test_text_before_a_call_is_released_as_it_comes():
    stream = ToolStream(parser("hermes", None))
    assert stream.feed("Hello <tool") == ("Hello ", [])  # "<tool" may open a call: held
    assert stream.feed("box> there") == ("<toolbox> there", [])
    assert stream.feed(" <tool_call>\n") == (" ", [])
    assert stream.feed('{"name": "f", "arguments": {}}\n</tool_call>')[1][0].name == "f"


@pytest.mark.parametrize(("template", "name"), [
    (None, "hermes"),
    ("{{ messages }}", "hermes"),
    ("{% for tool in tools %}<tool_call>{{ tool_calls }}", "hermes"),
    ("<tool_call>\n<function={{ name }}>", "qwen3-coder"),
    ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>ipython<|end_header_id|><|python_tag|>", "llama3"),
])
def test_the_format_is_picked_from_the_template(template, name):
    assert detect(template) == name
    assert parser("auto", template).name == name
    assert parser("mistral", template).name == "mistral"  # the flag wins
    assert set(PARSERS) == {"auto", "hermes", "llama3", "mistral", "qwen3-coder", "harmony"}


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral", "qwen3-coder"])
def test_each_formats_forced_grammar_compiles(name):
    from llguidance import LLMatcher, grammar_from

    tools = Tools((("get_weather", None, WEATHER), ("get_time", None, TIME)), "required")
    grammar = tools.grammar(parser(name, None))
    assert grammar is not None and grammar.kind == "grammar"
    assert LLMatcher.validate_grammar(grammar_from("lark", grammar.spec)) == ""


QWEN_SCHEMAS = [
    WEATHER,
    {"type": "object", "properties": {}},  # no parameters
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "1"]}},
                                      "at": {"$ref": "#/$defs/place"}},
     "required": ["at"], "$defs": {"place": {"type": "object", "properties": {
         "lat": {"type": "number"}}, "required": ["lat"]}}},
]


@pytest.mark.parametrize("schema", QWEN_SCHEMAS)
def test_qwen3_coder_forced_grammar_compiles_for_each_schema(schema):
    from llguidance import LLMatcher, grammar_from

    spec = parser("qwen3-coder", None).grammar([("f", schema)], many=False)
    assert LLMatcher.validate_grammar(grammar_from("lark", spec)) == ""


def test_qwen3_coder_refuses_a_schema_it_cannot_write_as_parameters():
    with pytest.raises(ValueError, match="'f'.*qwen3-coder"):
        parser("qwen3-coder", None).grammar([("f", {"anyOf": [WEATHER, TIME]})], many=False)


# ---- rendering ---------------------------------------------------------------------------------
HISTORY = USER + [
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "15C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def test_the_fallback_puts_the_tools_in_the_system_prompt_and_history_in_text():
    tools = Tools((("get_weather", "forecast", WEATHER),), "auto")
    out = fallback_messages([{"role": "system", "content": "Be brief."}, *HISTORY], tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and "<tool_call>" in system
    assert json.dumps(tools.openai()[0]) in system
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                 '{"city": "Paris", "days": 1}}\n</tool_call>')
    assert out[3]["content"] == ("<tool_response>\n15C\n</tool_response>\n"
                                 "<tool_response>\nrain\n</tool_response>")
    assert all(set(m) == {"role", "content"} for m in out)


class TemplateTokenizer:
    """A tokenizer whose chat template speaks of tools: it records what it was given."""

    chat_template = "{% for tool in tools %}{{ tool }}{% endfor %}{{ message.tool_calls }}"

    def __init__(self) -> None:
        self.given: dict = {}

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        self.given = {"messages": messages, "tools": tools}
        return [1, 2, 3]


def test_a_template_with_tools_gets_them_and_the_history_as_it_expects():
    tokenizer = TemplateTokenizer()
    service = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer))
    tools = Tools((("get_weather", None, WEATHER),), "auto")
    messages = rendered(tokenizer, HISTORY, tools)
    assert encode(service, tools, messages) == [1, 2, 3]
    assert tokenizer.given["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER}}]
    given = tokenizer.given["messages"]
    assert given[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 1}
    assert given[2] == {"role": "tool", "tool_call_id": "call_1", "content": "15C"}


# ---- the API, with the official client ---------------------------------------------------------
@dataclass
class Live:
    url: str
    app: object
    recorder: FakeRecorder

    def idle(self) -> bool:
        engine, runs = self.app.state.engine, self.app.state.runs
        return (runs.in_flight == 0 and not engine.scheduler.has_work()
                and engine.block_manager.num_used_blocks == 0)


def _app(recorder: FakeRecorder, loader=None):
    # The fallback's system prompt is long in bytes: a longer context than the tiny default.
    loader = loader or partial(tiny_model, max_position_embeddings=4096)
    return create_app(Settings(engine=EngineConfig(num_kv_blocks=512)),
                      engine_factory=lambda config: Engine(config, loader=loader),
                      recorder_factory=lambda s: recorder)


def _saying(text: str):
    """The tiny model (long context), every output token of which reads as `text`."""

    def load(*args, **kwargs):
        loaded = tiny_model(max_position_embeddings=4096)
        loaded.tokenizer = FixedTextTokenizer(text)
        return loaded

    return load


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    recorder = FakeRecorder()
    app = _app(recorder)
    with serving(app, TIMEOUT) as url:
        live = Live(url, app, recorder)
        yield live
        assert live.idle()  # every run finished, every KV block back in the pool


@pytest.fixture(scope="module")
def client(live) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0,
                       timeout=TIMEOUT) as c:
        yield c


def _valid(name: str, arguments: str) -> None:
    """The arguments follow the tool's schema (WEATHER or TIME)."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "days"}, args
        assert isinstance(args["city"], str) and len(args["city"]) <= 8, args
        assert type(args["days"]) is int and 1 <= args["days"] <= 7, args
    else:
        assert args in ({"zone": "UTC"}, {"zone": "CET"}), args


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_is_well_formed(client, live, choice):
    out = client.chat.completions.create(model="tiny-llama", messages=USER, tools=TOOLS,
                                         tool_choice=choice, parallel_tool_calls=False,
                                         max_tokens=120, temperature=0)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if choice == NAMED:
        assert call.function.name == "get_time"
    _valid(call.function.name, call.function.arguments)
    # The template's messages: the tools in the fallback's system prompt.
    started = next(s for s in live.recorder.started if s["run_id"] == out.id)
    assert started["messages"][0]["role"] == "system"
    assert '"name": "get_time"' in started["messages"][0]["content"]
    # The run records the tools it was given, so its page can show them and read its calls.
    params = started["params"]
    assert [t["function"]["name"] for t in params["tools"]] == [
        t["function"]["name"] for t in TOOLS]
    assert params["tool_choice"] == choice and params["tool_parser"] == "hermes"


def test_required_with_parallel_calls_makes_one_or_more(client):
    out = client.chat.completions.create(model="tiny-llama", messages=USER, tools=TOOLS,
                                         tool_choice="required", max_tokens=300,
                                         temperature=1.0, seed=3)
    choice = out.choices[0]
    if choice.finish_reason == "tool_calls":
        assert len(choice.message.tool_calls) >= 1
        for call in choice.message.tool_calls:
            _valid(call.function.name, call.function.arguments)
    else:  # random weights may write calls until max_tokens: the complete ones are kept
        assert choice.finish_reason == "length"


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_streamed_forced_call_reassembles_into_valid_arguments(client, choice):
    stream = client.chat.completions.create(model="tiny-llama", messages=USER, tools=TOOLS,
                                            tool_choice=choice, parallel_tool_calls=False,
                                            max_tokens=120, temperature=0, stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # never the raw tag text
    calls = [t for d in deltas for t in d.tool_calls or ()]
    first = calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name in SCHEMAS
    assert all(t.index == 0 and t.id is None for t in calls[1:])
    arguments = "".join(t.function.arguments or "" for t in calls)
    _valid(first.function.name, arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {
    "type": "function", "function": {"name": "get_weather"}}])
def test_a_streamed_call_sends_its_arguments_in_fragments_as_its_whole_twin(client, choice):
    ask = {"model": "tiny-llama", "messages": USER, "tools": TOOLS, "tool_choice": choice,
           "parallel_tool_calls": False, "max_tokens": 120, "temperature": 1.0, "seed": 11}
    whole = client.chat.completions.create(**ask).choices[0]
    chunks = list(client.chat.completions.create(**ask, stream=True))
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    header, fragments = pieces[0], [t.function.arguments for t in pieces[1:]]
    assert header.id is not None and all(t.id is None and t.function.name is None
                                         for t in pieces[1:])
    call = whole.message.tool_calls[0]
    assert (header.function.name, "".join(fragments)) == (call.function.name,
                                                          call.function.arguments)
    assert len(fragments) > 1  # sent as they came, not once complete
    _valid(call.function.name, call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason == "tool_calls"


def test_a_call_cut_by_max_tokens_is_a_call_with_the_text_so_far(client):
    # `<tool_call>\n{"name": "get_time", "arguments": {` is 47 bytes: cut in the arguments
    ask = {"model": "tiny-llama", "messages": USER, "tools": TOOLS, "tool_choice": NAMED,
           "max_tokens": 52, "temperature": 0}
    whole = client.chat.completions.create(**ask).choices[0]
    call = whole.message.tool_calls[0]
    assert (whole.finish_reason, whole.message.content) == ("length", None)
    assert call.function.name == "get_time" and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # the text so far: not a whole object
    chunks = list(client.chat.completions.create(**ask, stream=True))
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].function.name == "get_time"
    assert "".join(t.function.arguments or "" for t in pieces) == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_history_with_tool_results_renders(client, live):
    out = client.chat.completions.create(model="tiny-llama", messages=HISTORY, tools=TOOLS,
                                         max_tokens=4, temperature=0)
    started = next(s for s in live.recorder.started if s["run_id"] == out.id)
    texts = [m["content"] for m in started["messages"]]
    assert any("<tool_response>\n15C\n</tool_response>" in t for t in texts)
    assert any('"arguments": {"city": "Paris", "days": 1}' in t for t in texts)


def test_auto_parses_a_scripted_call_whole_and_streamed():
    said = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    recorder = FakeRecorder()
    with (TestClient(_app(recorder, _saying(said))) as http,
          openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                        max_retries=0) as scripted):
        # Each token reads as the whole call: the stop string ends the output after one.
        ask = {"model": "tiny-llama", "messages": USER, "tools": TOOLS, "max_tokens": 3,
               "stop": ["</tool_call>"]}
        out = scripted.chat.completions.create(**ask)
        call = out.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_time", {"zone": "UTC"})
        assert out.choices[0].finish_reason == "tool_calls"
        chunks = list(scripted.chat.completions.create(**ask, stream=True))
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
        assert calls[0].function.name == "get_time"
        assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"zone": "UTC"}
        # Without tools the same text is only text.
        plain = scripted.chat.completions.create(**(ask | {"tools": openai.NOT_GIVEN}))
        assert plain.choices[0].message.content == said[:-len("</tool_call>")]


class QwenCoderTokenizer(ByteTokenizer):
    """The byte tokenizer with a chat template that teaches the qwen3-coder format."""

    chat_template = "{% for tool in tools %}{{ tool }}{% endfor %}{{ tool_calls }}<function="

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True):
        return super().apply_chat_template(
            [{"role": "system", "content": json.dumps(tools)}, *messages], add_generation_prompt)


def _qwen_coder(*args, **kwargs):
    loaded = tiny_model(max_position_embeddings=4096)
    loaded.tokenizer = QwenCoderTokenizer()
    return loaded


@pytest.mark.parametrize("choice", ["required", NAMED, {
    "type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_in_the_qwen3_coder_format_is_well_formed(choice):
    recorder = FakeRecorder()
    with (TestClient(_app(recorder, _qwen_coder)) as http,
          openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                        max_retries=0) as qwen):
        for seed in range(3):
            out = qwen.chat.completions.create(
                model="tiny-llama", messages=USER, tools=TOOLS, tool_choice=choice,
                parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
            assert out.choices[0].finish_reason == "tool_calls"
            (call,) = out.choices[0].message.tool_calls
            if choice != "required":
                assert call.function.name == choice["function"]["name"]
            _valid(call.function.name, call.function.arguments)
        started = recorder.started[-1]
        assert started["params"]["tool_parser"] == "qwen3-coder"


# ---- bad input ---------------------------------------------------------------------------------
BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": NAMED}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "ignore_eos": True}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "logprobs": True}, "logprobs"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "15C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}]},
     "messages[0].tool_calls[0].function"),
]


@pytest.mark.parametrize(("change", "param"), BAD)
def test_bad_tools_are_400s_naming_the_field_and_nothing_runs(live, change, param):
    import httpx

    started = len(live.recorder.started)
    body = {"model": "tiny-llama", "messages": USER, "max_tokens": 4} | change
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert_error(r, 400, param)
    assert len(live.recorder.started) == started and live.idle()


def test_tool_choice_none_is_plain_text(client, live):
    out = client.chat.completions.create(model="tiny-llama", messages=USER, tools=TOOLS,
                                         tool_choice="none", max_tokens=4, temperature=0)
    started = next(s for s in live.recorder.started if s["run_id"] == out.id)
    assert started["messages"] == USER  # no tools rendered
    assert out.choices[0].message.tool_calls is None


# ---- the Messages API, with the official anthropic client -------------------------------------
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": "a tool",
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def claude(live) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0,
                             timeout=TIMEOUT) as c:
        yield c


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_time"}])
def test_a_message_makes_a_tool_use(claude, live, choice):
    out = claude.messages.create(model="tiny-llama", max_tokens=120, messages=USER,
                                 tools=ANTHROPIC_TOOLS, tool_choice=choice,
                                 extra_body={"temperature": 0})
    assert out.stop_reason == "tool_use"
    assert [b.type for b in out.content] == ["tool_use"]
    use = out.content[0]
    if choice["type"] == "tool":
        assert use.name == "get_time"
    _valid(use.name, json.dumps(use.input))
    started = next(s for s in live.recorder.started if s["run_id"] == out.id)
    assert "# Tools" in started["messages"][0]["content"]


def test_a_streamed_message_sends_tool_use_blocks_and_input_json(claude):
    with claude.messages.stream(model="tiny-llama", max_tokens=120, messages=USER,
                                tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
    assert ("content_block_delta", "input_json_delta") in kinds
    assert ("content_block_delta", "text_delta") not in kinds  # never the raw tags
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    _valid("get_weather", json.dumps(final.content[0].input))


def test_a_tool_result_conversation_renders_and_bad_choices_are_400s(claude, live):
    history = USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time",
                                           "input": {"zone": "UTC"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "12:00"}]}]
    out = claude.messages.create(model="tiny-llama", max_tokens=3, messages=history,
                                 tools=ANTHROPIC_TOOLS)
    started = next(s for s in live.recorder.started if s["run_id"] == out.id)
    texts = [m["content"] for m in started["messages"]]
    assert "<tool_response>\n12:00\n</tool_response>" in texts
    assert any('{"name": "get_time", "arguments": {"zone": "UTC"}}' in t for t in texts)
    for choice in ({"type": "tool", "name": "nope"}, {"type": "tool"}):
        with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
            claude.messages.create(model="tiny-llama", max_tokens=3, messages=USER,
                                   tools=ANTHROPIC_TOOLS, tool_choice=choice)
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        claude.messages.create(model="tiny-llama", max_tokens=3, messages=USER,
                               tool_choice={"type": "any"})


# ---- the embedded model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded() -> Iterator[openai.OpenAI]:
    app = create_app(Settings(engine=EngineConfig(num_kv_blocks=256)),
                     engine_factory=lambda config: Engine(config))
    with serving(app, 120) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x",
                                                 max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_the_embedded_model_calls_a_named_tool(embedded, stream):
    served = embedded.models.list().data[0].id
    ask = {"model": served, "messages": [{"role": "user", "content": "Weather in Paris?"}],
           "tools": TOOLS, "tool_choice": {"type": "function", "function": {
               "name": "get_weather"}}, "temperature": 0, "max_tokens": 100}
    if not stream:
        out = embedded.chat.completions.create(**ask)
        assert out.choices[0].finish_reason == "tool_calls"
        call = out.choices[0].message.tool_calls[0].function
        name, arguments = call.name, call.arguments
    else:
        chunks = list(embedded.chat.completions.create(**ask, stream=True))
        calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
        name = calls[0].function.name
        arguments = "".join(t.function.arguments or "" for t in calls)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert name == "get_weather"
    _valid(name, arguments)
