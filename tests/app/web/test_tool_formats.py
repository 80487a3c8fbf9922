"""Tool-call formats on fixed texts: gpt-oss's harmony messages (content, dropped reasoning,
calls), whole and streamed."""

from __future__ import annotations

import json

import pytest

from app.web.api.tool_calls import ToolStream, detect, parse, parser

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
