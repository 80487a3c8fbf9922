"""Tools in a request: what the model is told (the chat template, or a fallback rendering) and
what a forced call must look like (a grammar), for /v1/chat/completions and /v1/messages.

Rendering: a chat template that speaks of `tools` gets them through `apply_chat_template(...,
tools=...)`, with the conversation's assistant `tool_calls` (arguments as objects, as the
templates expect) and role "tool" messages as they are. A template that does not (the
embedded SmolLM2's) gets the fallback: a system-prompt section listing the tools' JSON schemas
and asking for Hermes-style `<tool_call>` tags (the hermes format, app/web/api/tool_calls.py);
earlier calls are written in that format into the assistant's text, and tool results become
user turns in `<tool_response>` tags.

Choices: "auto" renders the tools and parses the output; "required" (one call or more, or one
without parallel_tool_calls) and a named function (exactly one call to it) are held to a
grammar of the format built from the tools' schemas (engine/structured.py compiles it), so
the call is always well-formed; "none" renders no tools and parses nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from app.web.api.tool_calls import ToolCall, ToolParser
from engine.sampling import StructuredOutput
from engine.structured import JSON_OPTIONS

NO_ARGUMENTS = {"type": "object", "properties": {}}
NonEmpty = Annotated[str, Field(min_length=1)]
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
FALLBACK = """# Tools

You may call one or more functions to assist with the user query. The functions, as JSON \
schemas, within <tools></tools> tags:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and arguments within \
<tool_call></tool_call> tags, one per call:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


# ---- OpenAI's request shapes -----------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the "
                                                                 "arguments; absent: none")
    strict: bool | None = Field(None, description="accepted; forced calls always follow the "
                                                  "schema")


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Strict):
    name: NonEmpty
    arguments: str = Field(description="the arguments as a JSON object's text")


class MessageToolCall(_Strict):
    """A call an assistant made earlier in the conversation (and a response's call)."""

    model_config = ConfigDict(strict=True)  # other keys: ignored

    id: NonEmpty
    type: Literal["function"]
    function: FunctionCall


# A message's JSON Schema rules (ChatMessage): content required but from an assistant;
# tool_call_id in tool messages only, and required there; tool_calls in assistant messages only.
MESSAGE_RULES = {"allOf": [
    {"if": {"required": ["role"], "properties": {"role": {"enum": ["system", "user", "tool"]}}},
     "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}},
    {"if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
     "then": {"required": ["tool_call_id"]},
     "else": {"properties": {"tool_call_id": {"type": "null"}}}},
    {"if": {"required": ["role"], "properties": {"role": {"not": {"const": "assistant"}}}},
     "then": {"properties": {"tool_calls": {"type": "null"}}}},
]}


def distinct(names: list[str]) -> None:
    """Tools' names are their calls' names: each may be given once."""
    if len(set(names)) != len(names):
        raise PydanticCustomError("invalid_value", "names a function twice")


def tool_field(name: str, value: Any, role: str | None) -> Any:
    """A message's tool_calls or tool_call_id, checked against its role (MESSAGE_RULES)."""
    if name == "tool_calls":
        if value is not None and role not in (None, "assistant"):
            raise PydanticCustomError("invalid_value", "belong in assistant messages only")
    elif value is None and role == "tool":
        raise PydanticCustomError("missing_required_parameter", "is required in a tool message")
    elif value is not None and role not in (None, "tool"):
        raise PydanticCustomError("invalid_value", "belongs in tool messages only")
    return value


class ToolFields(BaseModel):
    """A chat request's tools, tool_choice and parallel_tool_calls (ChatCompletionRequest
    takes them from here, after its structured-output and ignore_eos fields)."""

    tools: list[ChatTool] | None = Field(None, description="functions the model may call "
                                                           "(docs/api.md, Tool calls)")
    tool_choice: ToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named "
                          "function; required and named calls follow the tools' schemas")
    parallel_tool_calls: bool | None = Field(None, description="false: required makes one "
                                                               "call")

    @field_validator("tools")
    @classmethod
    def _distinct(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        distinct([t.function.name for t in tools or ()])
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choosable(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in tools}:
                raise PydanticCustomError("invalid_value", "names {name}, which is not one of "
                                          "the tools", {"name": json.dumps(choice.function.name)})
        elif choice != "required":
            return choice
        if not tools:
            raise PydanticCustomError("invalid_value", "requires tools")
        if info.data.get("ignore_eos"):
            raise PydanticCustomError("invalid_value", "cannot force a call with ignore_eos: "
                                      "the output ends where the call does")
        if (info.data.get("structured_outputs") is not None
                or getattr(info.data.get("response_format"), "type", "text") != "text"):
            raise PydanticCustomError("invalid_value", "cannot force a call together with a "
                                      "response_format or structured_outputs constraint")
        return choice

    @property
    def tool_request(self) -> Tools | None:
        """The tools the model is given (none without tools, or with tool_choice none)."""
        return openai_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    @property
    def structured_param(self) -> str:
        """A forced call's grammar is the tools' (what a compile error names)."""
        tools = self.tool_request
        forced = tools is not None and tools.forced
        return "tools" if forced else super().structured_param  # type: ignore[misc]


# ---- OpenAI's response shapes ---------------------------------------------------------------
class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed call: first its index, id, type and name, then pieces of its arguments."""

    index: int = Field(ge=0)
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


def call_deltas(index: int, call: ToolCall, sent: str | None = None) -> list[ToolCallDelta]:
    """The deltas OpenAI streams that bring a call from what was sent of it (`sent`: its
    arguments so far; None: nothing) to `call`: its index, id, type and name first, then the
    rest of its arguments. A stream cannot take a fragment back: arguments that do not extend
    what was sent are a RuntimeError."""
    if not call.arguments.startswith(sent or ""):
        raise RuntimeError(f"tool call {index}'s arguments differ from the fragments sent")
    out = [] if sent is not None else [ToolCallDelta(
        index=index, id=call.id, type="function",
        function=FunctionDelta(name=call.name, arguments=""))]
    if len(call.arguments) > len(sent or ""):
        out.append(ToolCallDelta(index=index, function=FunctionDelta(
            arguments=call.arguments[len(sent or ""):])))
    return out


def message_call(call: ToolCall) -> MessageToolCall:
    return MessageToolCall(id=call.id, type="function",
                           function=FunctionCall(name=call.name, arguments=call.arguments))


# ---- one request's tools, whichever API they came through ----------------------------------
@dataclass(frozen=True)
class Tools:
    functions: tuple[tuple[str, str | None, dict], ...]  # name, description, parameters
    choice: str  # "auto", "required" or "named" ("none" is no Tools at all)
    named: str | None = None
    many: bool = True  # required: several calls allowed

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def openai(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's shape)."""
        out = []
        for name, description, parameters in self.functions:
            function: dict[str, Any] = {"name": name}
            if description is not None:
                function["description"] = description
            out.append({"type": "function", "function": function | {"parameters": parameters}})
        return out

    def grammar(self, parser: ToolParser) -> StructuredOutput | None:
        """The grammar a forced call follows (none for "auto"); ValueError when the format
        has none."""
        if not self.forced:
            return None
        chosen = [(n, p) for n, _, p in self.functions if self.named in (None, n)]
        return StructuredOutput("grammar", parser.grammar(chosen, self.many and not self.named))


def openai_tools(tools: list[ChatTool] | None, choice: ToolChoice | None,
                 parallel: bool | None) -> Tools | None:
    """A chat request's tools (none without tools, or with tool_choice "none")."""
    if not tools or choice == "none":
        return None
    functions = tuple((t.function.name, t.function.description,
                       t.function.parameters or NO_ARGUMENTS) for t in tools)
    if isinstance(choice, NamedToolChoice):
        return Tools(functions, "named", choice.function.name, False)
    return Tools(functions, choice or "auto", None, parallel is not False)


def schema_problem(tools: Tools) -> str | None:
    """What llguidance cannot compile in the tools' parameter schemas (None: all compile)."""
    from llguidance import LLMatcher

    for name, _, schema in tools.functions:
        try:
            problem = LLMatcher.validate_grammar(
                LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS))
        except ValueError as e:
            problem = str(e)
        if problem:
            return f"the parameters of {name!r} could not be compiled: {problem.strip()}"
    return None


# ---- rendering -------------------------------------------------------------------------------
def speaks_tools(template: Any) -> bool:
    """Whether a chat template renders OpenAI-style tools and tool calls."""
    return isinstance(template, str) and "tool_calls" in template and "tools" in template


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def template_messages(messages: list[dict]) -> list[dict]:
    """The conversation for a template that speaks tools: arguments as objects."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = m | {"tool_calls": [c | {"function": c["function"] | {
                "arguments": _arguments(c["function"]["arguments"])}} for c in calls]}
        out.append(m)
    return out


def fallback_messages(messages: list[dict], tools: Tools | None) -> list[dict]:
    """The conversation for a template that does not speak tools: the tools in the system
    prompt, calls and results as text turns (the hermes format)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
            continue
        content = m["content"] or ""
        for call in m.get("tool_calls") or ():
            body = json.dumps({"name": call["function"]["name"],
                               "arguments": _arguments(call["function"]["arguments"])},
                              ensure_ascii=False)
            content += f"{chr(10) if content else ''}<tool_call>\n{body}\n</tool_call>"
        out.append({"role": m["role"], "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools is not None:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.openai())
        section = FALLBACK.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def rendered(tokenizer: Any, messages: list[dict], tools: Tools | None) -> list[dict]:
    """The messages the chat template gets (what a run records)."""
    if speaks_tools(getattr(tokenizer, "chat_template", None)):
        return template_messages(messages)
    return fallback_messages(messages, tools)


def encode(service: Any, tools: Tools | None, messages: list[dict]) -> list[int]:
    """`rendered` messages through the served model's chat template (with the tools, when it
    takes them); ValueError when the template fails on them."""
    tokenizer = service.engine.tokenizer
    try:
        if speaks_tools(getattr(tokenizer, "chat_template", None)):
            return list(tokenizer.apply_chat_template(
                messages, tools=None if tools is None else tools.openai(),
                add_generation_prompt=True))
        return service.encode_chat(messages)
    except (TypeError, KeyError, AttributeError) as e:  # templates index what they expect
        raise ValueError(f"the chat template failed on them: {e}") from None
