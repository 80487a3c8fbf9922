"""Tool-call formats on fixed texts: gpt-oss's harmony messages (content, dropped reasoning,
calls), whole and streamed; the JSON formats' arguments streamed in fragments as OpenAI sends
them, and a call cut by max_tokens."""

from __future__ import annotations

import json

import pytest

from app.web.api.tool_calls import ToolStream, detect, parse, parser
from app.web.api.tool_output import ToolOutput
from engine.events import FinishEvent

HARMONY = [
    # reasoning, then a call (the engine may leave out the `<|call|>` that ends the turn)
    ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>'
     'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
     '<|call|>', "", [("get_weather", '{"city": "Paris"}')]),
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": [1, 2]}',
     "", [("f", '{"x": [1, 2]}')]),
    # the recipient in the role's part of the header
    ('<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>',
     "", [("f", "{}")]),
    # reasoning, then the answer: only the final channel is content
    ("<|channel|>analysis<|message|>Think hard.<|end|><|start|>assistant<|channel|>"
     "final<|message|>It is <b>15C</b>.<|return|>", "It is <b>15C</b>.", []),
    ("<|channel|>final<|message|>Cut short", "Cut short", []),
    # not harmony at all: plain text
    ("Hello <|world", "Hello <|world", []),
    # a call whose body is not JSON stays the model's text
    ("<|channel|>commentary to=functions.f<|message|>x=1<|call|>",
     "<|channel|>commentary to=functions.f<|message|>x=1<|call|>", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HARMONY)
def test_harmony_parses_whole_and_streamed_alike(text, content, calls):
    found = parse(parser("harmony", None), text)
    assert (found[0], [(c.name, c.arguments) for c in found[1]]) == (content, calls)
    stream = ToolStream(parser("harmony", None))
    pieces = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert "".join(p[0] for p in pieces) == content
    assert [(c.name, c.arguments) for p in pieces for c in p[1]] == calls


def test_harmony_streams_the_final_channel_as_it_comes():
    stream = ToolStream(parser("harmony", None))
    assert stream.feed("<|channel|>analysis<|message|>hmm") == ("", [])
    assert stream.feed("<|end|><|start|>assistant<|channel|>final<|message|>Hi") == ("Hi", [])
    assert stream.feed(" there<|re") == (" there", [])  # "<|re" may begin <|return|>: held
    assert stream.feed("turn|>") == ("", [])
    assert stream.finish() == ("", [])


def test_harmony_is_picked_from_the_template_and_its_grammar_compiles():
    from llguidance import LLMatcher, grammar_from

    template = "{{- '<|start|>assistant<|channel|>commentary to=functions.' + name }}"
    assert detect(template) == "harmony"
    tools = [("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}),
             ("get_time", {"type": "object", "properties": {}})]
    spec = parser("harmony", None).grammar(tools, many=True)
    assert LLMatcher.validate_grammar(grammar_from("lark", spec)) == ""
    assert json.dumps("get_weather <|constrain|>json<|message|>") in spec


# ---- the JSON formats' arguments, streamed in fragments ----------------------------------------
STREAMED = [
    # the model's own text of the arguments (spacing kept), braces and escapes inside strings
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"s": "a}\\"{",  "n": [1, '
               '{"k": null}]}}\n</tool_call>\n<tool_call>\n{"name": "g", "parameters": {}}'
               "\n</tool_call>", "Sure.\n",
     [("f", '{"s": "a}\\"{",  "n": [1, {"k": null}]}'), ("g", "{}")]),
    # not the name then the arguments: re-dumped, sent once complete
    ("hermes", '<tool_call>{"arguments": {"x":1}, "name": "f"}</tool_call>', "",
     [("f", '{"x": 1}')]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {"x":  1, "y": "}"}}; '
               '{"name": "g", "parameters": {"z": "w"}}', "",
     [("f", '{"x":  1, "y": "}"}'), ("g", '{"z": "w"}')]),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", '
                '"arguments": {"y": "]}"}}]', "", [("f", '{"x": 1}'), ("g", '{"y": "]}"}')]),
]


def _finish(reason: str, text: str, delta: str = "") -> FinishEvent:
    return FinishEvent("r", reason, text, delta, [], 1, len(text), 0, 0, 0.0, None, None, 0.0)


def _streamed(name: str, text: str, size: int, reason: str = "stop"):
    """The deltas of `text` fed `size` characters at a time, and the finish_reason."""
    output = ToolOutput(parser(name, None), 1)
    deltas = [d for i in range(0, len(text), size) for d in output.feed(0, text[i:i + size])]
    last, why = output.finish(0, _finish(reason, text))
    return deltas + last, why


def _reassembled(deltas) -> tuple[str, list[tuple[str, str]], list[int]]:
    """The content, the calls (name, arguments), and each call's count of fragments; each
    call's header (id, type, name) must come before any of its fragments."""
    calls: dict[int, list] = {}
    for delta in deltas:
        for piece in delta.tool_calls or ():
            if piece.id is not None:  # the header: first, once
                assert piece.index not in calls and piece.type == "function"
                assert piece.function.arguments == ""
                calls[piece.index] = [piece.function.name, "", 0]
            else:
                assert piece.index in calls and piece.function.name is None
                calls[piece.index][1] += piece.function.arguments
                calls[piece.index][2] += 1
    assert list(calls) == list(range(len(calls)))
    content = "".join(d.content or "" for d in deltas)
    return content, [(n, a) for n, a, _ in calls.values()], [c[2] for c in calls.values()]


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize(("name", "text", "content", "calls"), STREAMED)
def test_json_formats_stream_the_models_own_arguments_in_fragments(name, text, content, calls,
                                                                  size):
    message, why = ToolOutput(parser(name, None), 1).message(_finish("stop", text))
    assert (message.content or "", why) == (content, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == calls
    deltas, why = _streamed(name, text, size)
    found, sent, fragments = _reassembled(deltas)
    assert (found, sent, why) == (content, calls, "tool_calls")
    for _, arguments in calls:  # nothing of the format's tags in the arguments
        json.loads(arguments)
    if size == 1:  # the model's own arguments go out as they come, re-dumped ones at once
        assert fragments == [len(a) if a in text else 1 for _, a in calls]


def test_a_call_is_announced_as_soon_as_its_arguments_begin():
    output = ToolOutput(parser("hermes", None), 1)
    said = output.feed(0, 'Hi <tool_call>\n{"name": "get_weather", "argu')
    assert [(d.content, d.tool_calls) for d in said] == [("Hi ", None)]
    head = output.feed(0, 'ments": {"city": "Pa')
    assert [(t.index, t.function.name, t.function.arguments) for d in head
            for t in d.tool_calls] == [(0, "get_weather", ""), (0, None, '{"city": "Pa')]
    more = output.feed(0, 'ris"}}\n</tool_call>')
    assert [t.function.arguments for d in more for t in d.tool_calls] == ['ris"}']
    last, why = output.finish(0, _finish("stop", ""))
    assert (last, why) == ([], "tool_calls")


# A call cut by max_tokens: with the chat API, a call whose arguments are the text so far
# (streamed and whole alike), finish_reason length; parse() (the Messages API, the run page)
# keeps it the model's text.
CUT = [
    ("hermes", 'Hi\n<tool_call>\n{"name": "f", "arguments": {"city": "Pa\\"r', "Hi\n",
     [("f", '{"city": "Pa\\"r')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_', "",
     [("f", '{"x": 1}')]),
    ("llama3", '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": [',
     "", [("f", '{"x": 1}'), ("g", '{"y": [')]),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", '
                '"arguments": {"y"', "", [("f", '{"x": 1}'), ("g", '{"y"')]),
    # cut before its arguments began: never announced, it stays the model's text
    ("hermes", 'Hi <tool_call>\n{"name": "f", "argu', 'Hi <tool_call>\n{"name": "f", "argu',
     []),
]


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize(("name", "text", "content", "calls"), CUT)
def test_a_call_cut_by_max_tokens_is_the_same_call_whole_and_streamed(name, text, content,
                                                                     calls, size):
    message, why = ToolOutput(parser(name, None), 1).message(_finish("length", text))
    assert (message.content or "", why) == (content, "length")
    assert [(c.function.name, c.function.arguments)
            for c in message.tool_calls or ()] == calls
    deltas, why = _streamed(name, text, size, "length")
    assert _reassembled(deltas)[:2] + (why,) == (content, calls, "length")
    said = parse(parser(name, None), text)[0]  # the Messages API's and run page's reading
    assert calls[-1][1] in said if calls else said == text
