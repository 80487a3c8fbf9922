"""Tools in the Messages API (app/web/api/messages.py), in Anthropic's shapes, on the same
rendering, grammars and parsers as chat completions (app/web/api/tools.py, tool_calls.py).

- `tools`: [{"name", "description", "input_schema"}]; `tool_choice`: {"type": "auto"} (the
  default), "any" (one call or more, or one with disable_parallel_tool_use), "tool" with a
  `name` (exactly one call to it), "none" (no tools rendered).
- The answer: text blocks and `tool_use` blocks ({"id", "name", "input"}), stop_reason
  `tool_use` when the model made calls and stopped by itself.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from app.web.api.tool_calls import ToolCall, ToolParser, parse
from app.web.api.tools import FunctionName, Tools, distinct

_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class AnthropicTool(BaseModel):
    model_config = _STRICT

    type: Literal["custom"] | None = None
    name: FunctionName
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON Schema of the input (an object)")
    cache_control: Annotated[Any, Field(description="accepted and ignored")] = None


class AnthropicToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = Field(None, description="with type tool: the tool to call")
    disable_parallel_tool_use: bool | None = Field(None, description="any: one call only")

    @field_validator("name")
    @classmethod
    def _with_tool(cls, name: str | None, info: ValidationInfo) -> str | None:
        if (name is None) == (info.data.get("type") == "tool"):
            raise PydanticCustomError("invalid_value", "is required with type tool, and only "
                                      "with it")
        return name


def check_tools(tools: list[AnthropicTool] | None) -> list[AnthropicTool] | None:
    distinct([t.name for t in tools or ()])
    return tools


def check_choice(choice: AnthropicToolChoice | None, tools: list[AnthropicTool] | None) -> Any:
    """tool_choice against the tools (MessagesRequest's validator)."""
    names = [t.name for t in tools or ()]
    if choice is not None and choice.type in ("any", "tool") and not names:
        raise PydanticCustomError("invalid_value", "requires tools")
    if choice is not None and choice.type == "tool" and choice.name not in names:
        raise PydanticCustomError("invalid_value", "names {name}, which is not one of the "
                                  "tools", {"name": json.dumps(choice.name)})
    return choice


def anthropic_tools(tools: list[AnthropicTool] | None,
                    choice: AnthropicToolChoice | None) -> Tools | None:
    """A message request's tools (none without tools, or with tool_choice none)."""
    if not tools or (choice is not None and choice.type == "none"):
        return None
    functions = tuple((t.name, t.description, t.input_schema) for t in tools)
    kind = "auto" if choice is None else choice.type
    if kind == "tool":
        return Tools(functions, "named", choice.name, False)  # type: ignore[union-attr]
    many = choice is None or not choice.disable_parallel_tool_use
    return Tools(functions, "required" if kind == "any" else "auto", None, many)


# ---- responses ---------------------------------------------------------------------------------
class AnthropicToolUseContent(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"]
    partial_json: str


def tool_use(call: ToolCall, streamed: bool = False) -> AnthropicToolUseContent:
    """A call as a tool_use block (streamed: its input comes in input_json_deltas)."""
    return AnthropicToolUseContent(type="tool_use", id=call.id, name=call.name,
                                   input={} if streamed else json.loads(call.arguments))


def content(parser: ToolParser, text: str) -> tuple[str, list[AnthropicToolUseContent]]:
    """A whole answer: its text, and its calls as tool_use blocks."""
    text, calls = parse(parser, text)
    return text, [tool_use(c) for c in calls]
