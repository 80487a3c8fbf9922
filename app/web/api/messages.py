"""The Messages API: POST /v1/messages in Anthropic's shape, for agents that speak it.

The same engine and runs as /v1/chat/completions (routes.py): the body is read and checked as
there (params.py), the conversation becomes the chat template's messages, and the run is
submitted, recorded (endpoint "/v1/messages", the chat template's messages) and collected by
routes.py's pieces. What differs is the shape: Anthropic's request fields, its message object,
its stream of named SSE events (message_start, content_block_start, ping, content_block_delta
..., content_block_stop, message_delta, message_stop; an `error` event if the engine fails the
request) and its errors, `{"type": "error", "error": {"type", "message"}}`.

Tool blocks: an assistant's tool_use and a user's tool_result become OpenAI-style history
(assistant `tool_calls`, role "tool" messages) when the model's chat template speaks of
tool_calls; otherwise they are written into the message's text, each on a line of its own:

    [tool_use id=ID name=NAME] {"json": "input"}
    [tool_result id=ID] the result's text          ([tool_result id=ID error] when is_error)

With `tools` (app/web/api/messages_tools.py) the history is always OpenAI-style, rendered as
chat completions render it (app/web/api/tools.py: the template's tools, or the fallback), and
the answer is read into `tool_use` blocks. `thinking` is refused, and so is a final assistant
message (a prefill to continue): the chat template opens a new assistant turn, so it would
not be continued.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.runs import Run, RunRequest, RunService
from app.web.api.messages_tools import (
    AnthropicTool,
    AnthropicToolChoice,
    AnthropicToolUseContent,
    InputJsonDelta,
    anthropic_tools,
    check_choice,
    check_tools,
    content,
    tool_use,
)
from app.web.api.params import APIError, read_request
from app.web.api.routes import _collect, _encode, _params, _raise_for_failure, _start
from app.web.api.schemas import (
    INT,
    MAX_STOP,
    MIN_TEMPERATURE,
    NUM,
    SERVER,
    Ignored,
    MaxTokens,
    Neutral,
    NonEmpty,
    served_model,
    shown,
)
from app.web.api.tool_calls import ToolParser, ToolStream
from app.web.api.tool_output import plan as tool_plan
from app.web.api.tools import speaks_tools
from engine.events import ErrorEvent, FinishEvent, TokenEvent
from engine.sampling import SamplingParams

ENDPOINT = "/v1/messages"
_STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


# ---- requests ----------------------------------------------------------------------------------
class AnthropicTextBlock(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str
    cache_control: Ignored = None


class AnthropicToolUseBlock(BaseModel):
    """A tool call the assistant made earlier in the conversation."""

    model_config = _STRICT

    type: Literal["tool_use"]
    id: NonEmpty
    name: NonEmpty
    input: dict[str, Any]
    cache_control: Ignored = None


_TEXT_BLOCKS = TypeAdapter(list[AnthropicTextBlock])


def _text(content: Any) -> Any:
    """Text, or text blocks joined (as the chat API joins text parts)."""
    if isinstance(content, list):
        return "".join(block.text for block in _TEXT_BLOCKS.validate_python(content))
    if not isinstance(content, str):
        raise PydanticCustomError("invalid_type", "must be a string or a list of text blocks, "
                                  "got {value}", {"value": shown(content)})
    return content


TextContent = Annotated[str, PlainValidator(
    _text, json_schema_input_type=str | list[AnthropicTextBlock])]


class AnthropicToolResultBlock(BaseModel):
    """A tool's answer to a tool_use, in a user message."""

    model_config = _STRICT

    type: Literal["tool_result"]
    tool_use_id: NonEmpty
    content: TextContent = ""
    is_error: bool = False
    cache_control: Ignored = None


Block = AnthropicTextBlock | AnthropicToolUseBlock | AnthropicToolResultBlock
_BLOCK_TYPES: dict[str, type[Block]] = {"text": AnthropicTextBlock,
                                         "tool_use": AnthropicToolUseBlock,
                                         "tool_result": AnthropicToolResultBlock}


def _block(value: Any) -> Block:
    model = _BLOCK_TYPES.get(value.get("type")) if isinstance(value, dict) else None
    if model is None:  # images, documents, thinking...: this server takes none of them
        raise PydanticCustomError("unsupported_value", "must be a text, tool_use or tool_result "
                                  "block, got {value}", {"value": shown(value)})
    return model.model_validate(value)


_BLOCKS = TypeAdapter(list[Annotated[Block, PlainValidator(_block, json_schema_input_type=Block)]])


def _content(content: Any) -> Any:
    if isinstance(content, list):
        return _BLOCKS.validate_python(content)
    if not isinstance(content, str):
        raise PydanticCustomError("invalid_type", "must be a string or a list of content "
                                  "blocks, got {value}", {"value": shown(content)})
    return content


class AnthropicMessageParam(BaseModel):
    model_config = _STRICT

    role: Literal["user", "assistant"]
    content: Annotated[str | list[Block], PlainValidator(
        _content, json_schema_input_type=str | list[Block])]

    @model_validator(mode="after")
    def _blocks_in_their_role(self) -> AnthropicMessageParam:
        wrong = AnthropicToolResultBlock if self.role == "assistant" else AnthropicToolUseBlock
        if not isinstance(self.content, str) and any(isinstance(b, wrong) for b in self.content):
            kind, home = (("tool_result", "user") if self.role == "assistant"
                          else ("tool_use", "assistant"))
            raise PydanticCustomError("invalid_value", "holds a {kind} block: those belong in "
                                      "{home} messages", {"kind": kind, "home": home})
        return self


class MessagesRequest(BaseModel):
    """POST /v1/messages."""

    model_config = _STRICT

    model: Annotated[str, Field(json_schema_extra={SERVER: "model"})] = Field(
        description="the served model's id (GET /v1/models); others: 404")
    max_tokens: MaxTokens = Field(description="new tokens at most; the prompt and these must "
                                              "fit the context window")
    messages: Annotated[list[AnthropicMessageParam], Field(min_length=1)] = Field(
        description="user and assistant turns, ending with a user turn")
    system: TextContent | None = Field(None, description="the system prompt")
    stop_sequences: Annotated[list[NonEmpty], Field(max_length=MAX_STOP)] = Field(
        [], description=f"up to {MAX_STOP} strings; generation stops before the first one")
    temperature: Annotated[float, Field(ge=0, le=1), NUM] = Field(
        1.0, description=f"0 (or below {MIN_TEMPERATURE:g}): greedy")
    top_p: Annotated[float, Field(gt=0, le=1), NUM] = 1.0
    top_k: Annotated[int, Field(ge=0), INT] = Field(0, description="0: all tokens")
    stream: bool = False
    metadata: Ignored = None
    tools: list[AnthropicTool] | None = Field(None, description="tools the model may call")
    tool_choice: AnthropicToolChoice | None = Field(None, description="auto (default), any, "
                                                    "tool (with name) or none")
    # Anthropic's parameters this server cannot honour: refused with their name.
    thinking: Annotated[Any, Neutral(says="is not supported by this server")] = None

    prompt_param: ClassVar[str] = "messages"  # for routes._start's errors
    max_tokens_param: ClassVar[str] = "max_tokens"

    @field_validator("model")
    @classmethod
    def _served(cls, model: str, info: ValidationInfo) -> str:
        return served_model(model, info)

    @field_validator("tools")
    @classmethod
    def _distinct(cls, tools: list[AnthropicTool] | None) -> list[AnthropicTool] | None:
        return check_tools(tools)

    @field_validator("tool_choice")
    @classmethod
    def _choosable(cls, choice: Any, info: ValidationInfo) -> Any:
        return check_choice(choice, info.data.get("tools"))

    @property
    def structured_param(self) -> str:
        """A forced call's grammar is the tools' (what a compile error names)."""
        return "tools"

    @field_validator("messages")
    @classmethod
    def _ends_with_user(cls, messages: list[AnthropicMessageParam]) -> list:
        if messages[-1].role != "user":
            raise PydanticCustomError("unsupported_value", "must end with a user message: a "
                                      "final assistant message (prefill) is not supported")
        return messages

    def sampling(self, max_tokens: int, logprobs: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, stop=tuple(self.stop_sequences), logprobs=logprobs,
            temperature=0.0 if self.temperature < MIN_TEMPERATURE else self.temperature,
            top_p=self.top_p, top_k=self.top_k)


# ---- the conversation as the chat template's messages -----------------------------------------
def _speaks_tools(service: RunService) -> bool:
    """Whether the model's chat template renders OpenAI-style tool calls."""
    return speaks_tools(getattr(service.engine.tokenizer, "chat_template", None))


def _tool_line(block: AnthropicToolUseBlock | AnthropicToolResultBlock) -> str:
    if isinstance(block, AnthropicToolUseBlock):
        return (f"[tool_use id={block.id} name={block.name}] "
                f"{json.dumps(block.input, ensure_ascii=False)}")
    flag = " error" if block.is_error else ""
    return f"[tool_result id={block.tool_use_id}{flag}] {block.content}"


def _as_text(blocks: list[Block]) -> str:
    """Text blocks joined as they are; each tool block on a line of its own."""
    out, after_tool = "", False
    for block in blocks:
        tool = not isinstance(block, AnthropicTextBlock)
        if out and (tool or after_tool):
            out += "\n"
        out += _tool_line(block) if tool else block.text
        after_tool = tool
    return out


def _as_tool_history(role: str, blocks: list[Block]) -> list[dict]:
    """An assistant's tool_use blocks as its tool_calls (after its text); a user's tool_result
    blocks as role "tool" messages, in order among the user's text."""
    texts = [b.text for b in blocks if isinstance(b, AnthropicTextBlock)]
    if role == "assistant":
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if isinstance(b, AnthropicToolUseBlock)]
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        return [message | {"tool_calls": calls}] if calls else [message]
    out: list[dict] = []
    for block in blocks:
        if isinstance(block, AnthropicToolResultBlock):
            content = ("[error] " if block.is_error else "") + block.content
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += block.text
        else:
            out.append({"role": "user", "content": block.text})
    return out


def chat_messages(req: MessagesRequest, speaks_tools: bool) -> list[dict]:
    """The request's conversation as the tokenizer's chat template takes it."""
    chat = [] if req.system is None else [{"role": "system", "content": req.system}]
    for m in req.messages:
        if isinstance(m.content, str):
            chat.append({"role": m.role, "content": m.content})
        elif speaks_tools:
            chat.extend(_as_tool_history(m.role, m.content))
        else:
            chat.append({"role": m.role, "content": _as_text(m.content)})
    return chat


# ---- responses ---------------------------------------------------------------------------------
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicTextContent(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicUsage(BaseModel):
    input_tokens: int = Field(ge=0, description="the whole prompt, prefix-cache hits included")
    output_tokens: int = Field(ge=0)


class AnthropicMessage(BaseModel):
    id: str = Field(description="the run's id: /runs/{id} shows it")
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicTextContent | AnthropicToolUseContent]
    stop_reason: StopReason | None = Field(description="null only in message_start")
    stop_sequence: str | None
    usage: AnthropicUsage


class _Event(BaseModel):
    type: str  # each event's own literal: its SSE event name too


class MessageStartEvent(_Event):
    type: Literal["message_start"]
    message: AnthropicMessage


class ContentBlockStartEvent(_Event):
    type: Literal["content_block_start"]
    index: int = Field(ge=0)
    content_block: AnthropicTextContent | AnthropicToolUseContent


class PingEvent(_Event):
    type: Literal["ping"]


class TextDelta(BaseModel):
    type: Literal["text_delta"]
    text: str


class ContentBlockDeltaEvent(_Event):
    type: Literal["content_block_delta"]
    index: int = Field(ge=0)
    delta: TextDelta | InputJsonDelta


class ContentBlockStopEvent(_Event):
    type: Literal["content_block_stop"]
    index: int = Field(ge=0)


class MessageDeltaBody(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDeltaUsage(BaseModel):
    output_tokens: int = Field(ge=0)


class MessageDeltaEvent(_Event):
    type: Literal["message_delta"]
    delta: MessageDeltaBody
    usage: MessageDeltaUsage


class MessageStopEvent(_Event):
    type: Literal["message_stop"]


class AnthropicErrorDetail(BaseModel):
    type: Literal["invalid_request_error", "authentication_error", "permission_error",
                  "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                  "overloaded_error"]
    message: str = Field(min_length=1)


class AnthropicError(_Event):
    """An error in Anthropic's shape: the response to a refused request, or a stream's `error`
    event."""

    type: Literal["error"]
    error: AnthropicErrorDetail


STREAM_EVENTS: dict[str, type[_Event]] = {  # by SSE event name (each one's `type`)
    "message_start": MessageStartEvent, "content_block_start": ContentBlockStartEvent,
    "ping": PingEvent, "content_block_delta": ContentBlockDeltaEvent,
    "content_block_stop": ContentBlockStopEvent, "message_delta": MessageDeltaEvent,
    "message_stop": MessageStopEvent, "error": AnthropicError}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error"}


def _error(message: str, status: int) -> AnthropicError:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return AnthropicError(type="error", error=AnthropicErrorDetail(type=kind, message=message))


def _stop(service: RunService, finish: FinishEvent,
          stops: list[str]) -> tuple[StopReason, str | None]:
    """Why the run stopped. The engine says "stop" for end-of-sequence and a stop string alike;
    a stop string is in the output's whole text (the engine cuts it from `text`) and never in
    one that ended otherwise (it would have stopped there). The earliest match stopped it."""
    if finish.reason == "length":
        return "max_tokens", None
    if stops:
        whole = b"".join(service.token_bytes(t) for t in finish.token_ids).decode(
            "utf-8", errors="replace")
        found = [(whole.find(s), len(s), s) for s in stops if s in whole]
        if found:
            return "stop_sequence", min(found)[2]
    return "end_turn", None


def _message(service: RunService, run: Run,
             content: list[AnthropicTextContent | AnthropicToolUseContent],
             stop: tuple[StopReason | None, str | None], usage: AnthropicUsage) -> AnthropicMessage:
    return AnthropicMessage(id=run.id, type="message", role="assistant",
                            model=service.model_name, content=content, stop_reason=stop[0],
                            stop_sequence=stop[1], usage=usage)


def _sse(event: _Event) -> bytes:
    """One named SSE event, as Anthropic sends them: `event: TYPE` then its JSON."""
    data = event.model_dump_json()
    return f"event: {event.type}\ndata: {data}\n\n".encode()


class _Blocks:
    """The content blocks of a streamed answer. Without tools: one text block, opened at once.
    With tools: a text block opened when text comes, and a tool_use block per complete call
    (its input in one input_json_delta), each closing the block before it."""

    def __init__(self, parser: ToolParser | None):
        self.tools = None if parser is None else ToolStream(parser)
        self.index, self.open, self.calls = 0, False, 0

    def opening(self) -> list[_Event]:
        return [] if self.tools is not None else self._text("", force=True)

    def feed(self, text: str, last: bool = False) -> list[_Event]:
        if self.tools is None:
            out = self._text(text)
        else:
            text, calls = self.tools.finish(text) if last else self.tools.feed(text)
            out = self._text(text) + self._calls(calls)
        return out + (self._close() if last else [])

    def _text(self, text: str, force: bool = False) -> list[_Event]:
        out: list[_Event] = []
        if (text or force) and not self.open:
            self.open = True
            out.append(ContentBlockStartEvent(type="content_block_start", index=self.index,
                                              content_block=AnthropicTextContent(type="text",
                                                                                 text="")))
        if text:
            out.append(ContentBlockDeltaEvent(type="content_block_delta", index=self.index,
                                              delta=TextDelta(type="text_delta", text=text)))
        return out

    def _close(self) -> list[_Event]:
        if not self.open:
            return []
        self.open, self.index = False, self.index + 1
        return [ContentBlockStopEvent(type="content_block_stop", index=self.index - 1)]

    def _calls(self, calls: list) -> list[_Event]:
        out: list[_Event] = []
        for call in calls:
            out += self._close()
            out += [ContentBlockStartEvent(type="content_block_start", index=self.index,
                                           content_block=tool_use(call, streamed=True)),
                    ContentBlockDeltaEvent(type="content_block_delta", index=self.index,
                                           delta=InputJsonDelta(type="input_json_delta",
                                                                partial_json=call.arguments)),
                    ContentBlockStopEvent(type="content_block_stop", index=self.index)]
            self.index += 1
        self.calls += len(calls)
        return out


def _stop_reason(stop: tuple[StopReason, str | None], calls: int) -> tuple[StopReason,
                                                                            str | None]:
    """A model that made calls and stopped by itself stops for tool_use."""
    return ("tool_use", None) if calls and stop[0] == "end_turn" else stop


async def _stream(service: RunService, run: Run, n_prompt: int, stops: list[str],
                  parser: ToolParser | None) -> AsyncIterator[bytes]:
    """Anthropic's event sequence for one run. Leaving early (client gone) ends run.events(),
    which cancels the request."""
    yield _sse(MessageStartEvent(type="message_start", message=_message(
        service, run, [], (None, None), AnthropicUsage(input_tokens=n_prompt, output_tokens=0))))
    blocks = _Blocks(parser)
    for block in blocks.opening():
        yield _sse(block)
    yield _sse(PingEvent(type="ping"))
    error: str | None = None
    async for event in run.events():
        if isinstance(event, TokenEvent) and event.text:
            for block in blocks.feed(event.text):
                yield _sse(block)
        elif isinstance(event, ErrorEvent):
            error = event.message
        elif isinstance(event, FinishEvent):
            if event.reason in ("error", "cancelled"):
                message = error or event.error or f"request {event.reason}"
                yield _sse(_error(f"the request ended early: {message}", 500))
                return
            for block in blocks.feed(event.text_delta, last=True):
                yield _sse(block)
            reason, sequence = _stop_reason(_stop(service, event, stops), blocks.calls)
            yield _sse(MessageDeltaEvent(
                type="message_delta",
                delta=MessageDeltaBody(stop_reason=reason, stop_sequence=sequence),
                usage=MessageDeltaUsage(output_tokens=event.completion_tokens)))
            yield _sse(MessageStopEvent(type="message_stop"))


# ---- the route ---------------------------------------------------------------------------------
async def create_message(request: Request) -> Response:
    try:
        return await _create_message(request)
    except APIError as e:  # params.py and routes.py speak OpenAI's shape: answer in Anthropic's
        return JSONResponse(_error(e.message, e.status).model_dump(), status_code=e.status,
                            headers=e.headers)


async def _create_message(request: Request) -> Response:
    service: RunService = request.app.state.runs
    req = await read_request(request, MessagesRequest)
    tools = anthropic_tools(req.tools, req.tool_choice)
    blocks = any(not isinstance(m.content, str) for m in req.messages)
    chat = chat_messages(req, tools is not None or (blocks and _speaks_tools(service)))
    plan = tool_plan(service, request.app.state.settings.tool_call_parser, tools, chat)
    prompt_ids = await _encode(plan.encode, plan.messages, "messages",
                               sum(len(m["content"]) for m in plan.messages))
    params = plan.sampling(_params(req, req.max_tokens, 0))
    run = _start(service, RunRequest(prompt_ids, params, ENDPOINT, "api", None, plan.messages),
                 "msg", req)
    if req.stream:
        return EventSourceResponse(_stream(service, run, len(prompt_ids), req.stop_sequences,
                                           plan.parser), sep="\n")
    result = await _collect(request, run)
    _raise_for_failure(result)
    finish = result.finish
    text, uses = (finish.text, []) if plan.parser is None else content(plan.parser, finish.text)
    kept = [AnthropicTextContent(type="text", text=text)] if text or not uses else []
    stop = _stop_reason(_stop(service, finish, req.stop_sequences), len(uses))
    message = _message(service, run, [*kept, *uses], stop,
                       AnthropicUsage(input_tokens=finish.prompt_tokens,
                                      output_tokens=finish.completion_tokens))
    return Response(message.model_dump_json(), media_type="application/json")


routes = [Route(ENDPOINT, create_message, methods=["POST"])]
