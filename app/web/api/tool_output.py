"""A chat answer with tools, as OpenAI shapes it: the model's text read by the format's parser
(app/web/api/tool_calls.py) into content and tool calls, per choice, whole or streamed.

Streamed, text goes out as content deltas as soon as it cannot begin a call; a call goes out
as OpenAI streams one, its index, id, type and name first, then its arguments, never as the
format's raw text: in the JSON formats as soon as it is opened (its name and the start of its
arguments read), its arguments in fragments as they come; in the others once complete.
A call opened but never complete (cut by max_tokens) is a call whose arguments are the text so
far, whole or streamed. finish_reason is `tool_calls` when the model made calls and stopped by
itself (`length` when max_tokens cut it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

from app.web.api.params import bad
from app.web.api.schemas import AssistantMessage, Delta
from app.web.api.tool_calls import ToolCall, ToolParser, ToolStream, parser
from app.web.api.tools import (
    Tools,
    call_deltas,
    encode,
    message_call,
    rendered,
    schema_problem,
)
from engine.events import FinishEvent
from engine.sampling import SamplingParams, StructuredOutput


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What one request's tools change: the messages the template gets and how they are
    encoded, the grammar of a forced call, and the parser of the answer (none: plain text)."""

    messages: list[dict]
    encode: Callable[[list[dict]], list[int]]
    parser: ToolParser | None = None
    grammar: StructuredOutput | None = None

    def sampling(self, params: SamplingParams) -> SamplingParams:
        return params if self.grammar is None else dataclasses.replace(
            params, structured=self.grammar)

    def output(self, choices: int) -> ToolOutput | None:
        return None if self.parser is None else ToolOutput(self.parser, choices)


def plan(service: Any, parser_name: str, tools: Tools | None, chat: list[dict]) -> ToolPlan:
    """The plan for a conversation and its tools (none: tool_choice none, or no tools);
    a 400 naming `tools` for a schema llguidance cannot compile, `tool_choice` for a forced
    call the format cannot write."""
    history = any(m["role"] == "tool" or m.get("tool_calls") for m in chat)
    if tools is None and not history:
        return ToolPlan(chat, service.encode_chat)
    tokenizer = service.engine.tokenizer
    messages = rendered(tokenizer, chat, tools)
    if tools is None:
        return ToolPlan(messages, partial(encode, service, None))
    problem = schema_problem(tools)
    if problem is not None:
        raise bad(problem, "tools")
    chosen = parser(parser_name, getattr(tokenizer, "chat_template", None))
    try:
        grammar = tools.grammar(chosen)
    except ValueError as e:
        raise bad(str(e), "tool_choice") from None
    return ToolPlan(messages, partial(encode, service, tools), chosen, grammar)


def _reason(finish: FinishEvent, calls: list[ToolCall]) -> str:
    return "tool_calls" if calls and finish.reason == "stop" else finish.reason


class ToolOutput:
    """The tool-aware answer of each choice of one request."""

    def __init__(self, parser: ToolParser, choices: int):
        self.parser = parser
        self.streams = [ToolStream(parser) for _ in range(choices)]
        self.sent: list[dict[int, str]] = [{} for _ in range(choices)]  # arguments sent, by call

    def _deltas(self, index: int, text: str, calls: list[ToolCall]) -> list[Delta]:
        out = [Delta(content=text)] if text else []
        stream, sent = self.streams[index], self.sent[index]
        first = len(stream.calls) - len(calls)  # the calls' indexes
        opened = [ToolCall(name, arguments, ToolCall.new_id())
                  for name, arguments in stream.opened]
        for k, call in [*enumerate(calls, first), *enumerate(opened, len(stream.calls))]:
            out += [Delta(tool_calls=[d]) for d in call_deltas(k, call, sent.get(k))]
            sent[k] = call.arguments
        return out

    def feed(self, index: int, text: str) -> list[Delta]:
        """The deltas one token's text makes (none while it may begin a call)."""
        return self._deltas(index, *self.streams[index].feed(text))

    def finish(self, index: int, finish: FinishEvent) -> tuple[list[Delta], str]:
        """The deltas of the text held back and the last piece, and the finish_reason."""
        stream = self.streams[index]
        deltas = self._deltas(index, *stream.finish(finish.text_delta, cut=True))
        return deltas, _reason(finish, stream.calls)

    def message(self, finish: FinishEvent) -> tuple[AssistantMessage, str]:
        """A whole choice: its message (content null when only calls) and finish_reason."""
        text, calls = ToolStream(self.parser).finish(finish.text, cut=True)
        if not calls:
            return AssistantMessage(role="assistant", content=text, refusal=None), finish.reason
        return (AssistantMessage(role="assistant", content=text if text.strip() else None,
                                 refusal=None,
                                 tool_calls=[message_call(c) for c in calls]),
                _reason(finish, calls))
