"""The OpenAI-compatible API's contract: its request and response models (pydantic v2).

The request models are the checks (params.py words their errors as OpenAI's, naming the
parameter), the response models check and serialize every answer (routes.py), and both are the
schemas of GET /openapi.json (openapi.py). Choices:

- Unknown fields are refused (code `unknown_parameter`), as OpenAI does; fields OpenAI defines
  that this server does not implement are accepted only at their neutral value. Null is absent.
- Numbers are finite JSON numbers (strict mode: `true` is not 1, `"5"` is not 5; NaN and
  Infinity, which Python's JSON parser lets through, are refused). An integer takes 5 or 5.0
  (the same number in JSON, and an integer to JSON Schema), never 5.5.
- Limits of this server come in the validation context ({"model", "max_tokens"}); where the
  document shows one, the schema holds a SERVER marker that openapi.py fills in.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from app.web.api.structured import (
    ResponseFormat,
    StructuredOutputs,
    TextFormat,
    response_format_spec,
)
from app.web.api.tools import MESSAGE_RULES, MessageToolCall, ToolCallDelta, ToolFields, tool_field
from engine.sampling import SamplingParams, StructuredOutput

MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MIN_TEMPERATURE = 1e-5  # below this, dividing the logits overflows: treat as greedy
MAX_TEMPERATURE = 2.0
MAX_CHOICES = 16  # n and best_of: choices of one request (they share its KV blocks)
SERVER = "x-server"  # a schema marker: this server's value goes here (openapi.py)


def shown(value: Any, limit: int = 40) -> str:
    """A value as the client wrote it (JSON), cut short for an error message."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def served_model(model: str | None, info: ValidationInfo) -> str | None:
    """A request's `model` check: it must be the model this server serves (the validation
    context's), when both are named."""
    served = (info.context or {}).get("model")
    if model is not None and served is not None and model != served:
        raise PydanticCustomError("model_not_found", "{model} does not exist; this server "
                                  "serves {served}", {"model": shown(model),
                                                      "served": shown(served)})
    return model


# ---- value types -----------------------------------------------------------------------------
def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _float(value: Any) -> Any:
    # An integer too large for a float is out of every range, not of another type.
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        raise PydanticCustomError("invalid_value", "is out of range, got {value}",
                                  {"value": shown(value)})
    return value


def _within_limit(value: int, info: ValidationInfo) -> int:
    limit = (info.context or {}).get("max_tokens")
    if limit is not None and value > limit:
        raise PydanticCustomError("invalid_value", "must be at most {limit} on this server, "
                                  "got {value}", {"limit": limit, "value": value})
    return value


INT, NUM = BeforeValidator(_integral), BeforeValidator(_float)  # after any Field() constraints
Int = Annotated[int, INT]
NonEmpty = Annotated[str, Field(min_length=1)]
NonBlank = Annotated[str, Field(pattern=r"\S")]  # python-re: \s is str.isspace, as in strip()
# The engine checks token ids against the vocabulary (and says its size).
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0, SERVER: "vocab"}), INT]
MaxTokens = Annotated[int, Field(ge=1, json_schema_extra={SERVER: "max_tokens"}), INT,
                      AfterValidator(_within_limit)]
Ignored = Annotated[Any, Field(description="accepted and ignored")]


class Neutral:
    """An OpenAI parameter this server does not implement: accepted only at its neutral values
    (what clients send by default; a number as a number, so `false` is not 0), then dropped."""

    def __init__(self, *values: Any, says: str = "is not supported by this server",
                 code: str = "unsupported_parameter"):
        self.values, self.says, self.code = values, says, code

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.no_info_plain_validator_function(self._check)

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> dict:
        return {"enum": [*self.values, None]}

    def _check(self, value: Any) -> None:
        if value is not None and not any(_same(value, v) for v in self.values):
            raise PydanticCustomError(self.code, self.says, {"value": shown(value)})


def _same(value: Any, neutral: Any) -> bool:
    if isinstance(neutral, int | float) and not isinstance(neutral, bool):
        return isinstance(value, int | float) and not isinstance(value, bool) and value == neutral
    return type(value) is type(neutral) and value == neutral


def _needs(*rules: tuple[str, dict, str]) -> dict:
    """Schema: `name` (when it holds `schema`; null is absent) requires `other` to be true."""
    return {"allOf": [{"if": {"required": [name], "properties": {name: schema}},
                       "then": {"required": [other], "properties": {other: {"const": True}}}}
                      for name, schema, other in rules]}


# ---- requests ----------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)  # other keys: ignored

    include_usage: bool | None = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, part: Any) -> Any:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise PydanticCustomError("unsupported_value", 'must be a text part ({"type": '
                                      '"text", "text": ...}); this server takes text only')
        return part


_TEXT_PARTS = TypeAdapter(list[TextPart])


class ChatMessage(BaseModel):
    """Text, or text parts; an assistant's content may be null or left out (its tool_calls
    then say what it did); a tool message answers the call tool_call_id names."""

    model_config = ConfigDict(strict=True, json_schema_extra=MESSAGE_RULES)  # others: ignored

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    tool_calls: list[MessageToolCall] | None = Field(None, description="an assistant's calls")
    tool_call_id: NonEmpty | None = Field(None, description="a tool message's call",
                                          validate_default=True)

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, content: Any, info: ValidationInfo) -> str | None:
        role = info.data.get("role")  # absent when invalid: that is the error to report
        if isinstance(content, list):
            return "".join(part.text for part in _TEXT_PARTS.validate_python(content))
        if content is None and role is not None and role != "assistant":
            raise PydanticCustomError("missing_required_parameter",
                                      "is required in a {role} message", {"role": role})
        if content is not None and not isinstance(content, str):
            raise PydanticCustomError("invalid_type", "must be a string or a list of text "
                                      "parts, got {value}", {"value": shown(content)})
        return "" if content is None and role == "assistant" else content

    @field_validator("tool_calls", "tool_call_id")
    @classmethod
    def _in_their_role(cls, value: Any, info: ValidationInfo) -> Any:
        return tool_field(info.field_name, value, info.data.get("role"))


class _Generation(BaseModel):
    """What both endpoints take. `| None`: null is accepted, as absent (`_null_is_absent`)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False,
                              regex_engine="python-re")

    model: Annotated[str, Field(json_schema_extra={SERVER: "model"})] | None = Field(
        None, description="the served model's id (GET /v1/models); others: 404")
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    max_tokens: MaxTokens | None = Field(None, description="new tokens at most; the prompt and "
                                                           "these must fit the context window")
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE), NUM] | None = Field(
        1.0, description=f"0 (or below {MIN_TEMPERATURE:g}): greedy")
    top_p: Annotated[float, Field(gt=0, le=1), NUM] | None = 1.0
    top_k: Annotated[int, Field(ge=-1), INT] | None = Field(
        0, description="extension: keep the k likeliest tokens; 0 or -1: all")
    seed: Int | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP)] | None = Field(
        (), description=f"up to {MAX_STOP} strings; generation stops before the first one")
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES), INT] | None = Field(
        1, description=f"choices to generate, up to {MAX_CHOICES}; they share the prompt's KV "
                       "blocks")
    ignore_eos: bool | None = Field(False, description="extension: keep generating past "
                                                       "end-of-sequence")
    speculative: bool | None = Field(True, description="extension: false keeps this request "
                                     "out of speculative decoding (no drafted tokens) when the "
                                     "server speculates (--speculative); ignored when it does not")
    frequency_penalty: Annotated[float, Field(ge=-2, le=2), NUM] | None = Field(
        0.0, description="subtracted from a token's logit once per time it was generated")
    presence_penalty: Annotated[float, Field(ge=-2, le=2), NUM] | None = Field(
        0.0, description="subtracted from a token's logit once if it was generated")
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]+$")],
                     Annotated[float, Field(ge=-100, le=100), NUM]] | None = Field(
        None, description="token id (as a string) -> bias added to its logit, -100 to 100")
    repetition_penalty: Annotated[float, Field(gt=0, le=2), NUM] | None = Field(
        1.0, description="extension: a token of the prompt or output has its logit divided by "
                         "this where positive, multiplied where negative; 1: none")
    min_p: Annotated[float, Field(ge=0, le=1), NUM] | None = Field(
        0.0, description="extension: sample only tokens at least min_p times as likely as the "
                         "likeliest; 0: none")
    return_tokens_as_token_ids: bool | None = Field(
        False, description="extension: logprobs name tokens \"token_id:N\", not by their text "
                           "(vLLM's)")
    response_format: ResponseFormat | None = Field(
        None, description="json_object or json_schema: the output follows it (docs/api.md)")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="extension (vLLM's): the output follows one of json, regex, choice, "
                          "grammar or json_object")
    # OpenAI's parameters that this server does not implement: accepted at their neutral value.
    best_of: Annotated[Any, Neutral(1)] = None
    echo: Annotated[Any, Neutral(False)] = None
    suffix: Annotated[Any, Neutral("")] = None
    tools: Annotated[Any, Neutral([])] = None
    functions: Annotated[Any, Neutral([])] = None
    tool_choice: Annotated[Any, Neutral("none", "auto")] = None
    function_call: Annotated[Any, Neutral("none", "auto")] = None
    modalities: Annotated[Any, Neutral(["text"])] = None
    # Accepted whatever their value: they change nothing about generation.
    user: Ignored = None
    metadata: Ignored = None
    store: Ignored = None
    parallel_tool_calls: Ignored = None
    service_tier: Ignored = None

    prompt_param: ClassVar[str]  # what the engine's "prompt" is called here
    max_tokens_names: ClassVar[tuple[str, ...]] = ("max_tokens",)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, body: Any) -> Any:
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body

    @field_validator("model")
    @classmethod
    def _served(cls, model: str | None, info: ValidationInfo) -> str | None:
        return served_model(model, info)

    @field_validator("stream_options")
    @classmethod
    def _streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> Any:
        if options is not None and not info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "is only allowed when stream is true")
        return options

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stops(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> tuple[str, ...]:
        try:
            stop = handler(value)
        except ValidationError:
            stops = [value] if isinstance(value, str) else value
            strings = isinstance(stops, list) and all(isinstance(s, str) for s in stops)
            raise PydanticCustomError(
                "invalid_value" if strings else "invalid_type",
                f"must be a non-empty string or a list of up to {MAX_STOP} of them, got {{value}}",
                {"value": shown(value)}) from None
        return (stop,) if isinstance(stop, str) else tuple(stop)

    @field_validator("response_format", "structured_outputs")
    @classmethod
    def _one_structure(cls, value: Any, info: ValidationInfo) -> Any:
        constrains = value is not None and not isinstance(value, TextFormat)
        if constrains and info.data.get("ignore_eos"):
            raise PydanticCustomError("invalid_value", "cannot be combined with ignore_eos: the "
                                      "output ends where its grammar does")
        if constrains and response_format_spec(info.data.get("response_format")) is not None:
            raise PydanticCustomError("invalid_value", "cannot be combined with a "
                                      "response_format that constrains the output")
        return value

    @property
    def structured(self) -> StructuredOutput | None:
        """The grammar the output follows (none: free text)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        return response_format_spec(self.response_format)

    @property
    def structured_param(self) -> str:
        """The parameter the structure was given in (what a compile error names)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    @property
    def max_tokens_param(self) -> str | None:
        """The name the limit was given under (the first of max_tokens_names that is set)."""
        return next((n for n in self.max_tokens_names if getattr(self, n) is not None), None)

    @property
    def max_new_tokens(self) -> int | None:
        name = self.max_tokens_param
        return getattr(self, name) if name else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int, logprobs: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, seed=self.seed, stop=self.stop, logprobs=logprobs,
            temperature=0.0 if self.temperature < MIN_TEMPERATURE else self.temperature,
            top_p=self.top_p, top_k=max(self.top_k, 0),  # -1: no cut (vLLM's convention)
            ignore_eos=bool(self.ignore_eos), speculative=self.speculative is not False,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            logit_bias={int(t): b for t, b in (self.logit_bias or {}).items()},
            repetition_penalty=self.repetition_penalty or 1.0, min_p=self.min_p or 0.0,
            structured=self.structured)


# The prompt's logprobs are not computed (only sampled rows' logits are): echo refuses logprobs.
_ECHO_WITHOUT_LOGPROBS = {"if": {"required": ["echo"], "properties": {"echo": {"const": True}}},
                          "then": {"properties": {"logprobs": {"type": "null"}}}}


class CompletionRequest(_Generation):
    """POST /v1/completions."""

    model_config = ConfigDict(json_schema_extra=_needs(("stream_options", {"type": "object"},
                                                        "stream")) | _ECHO_WITHOUT_LOGPROBS)

    prompt: (NonBlank | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[NonBlank], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]],
                         Field(min_length=1, max_length=1)]) = Field(
        description="text with a non-whitespace character, token ids, or a list of one of these")
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS), INT] | None = Field(
        None, description="the sampled token's logprob and this many alternatives'")

    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES), INT] | None = Field(
        None, description="generate this many choices (at least n) and return the n with the "
                          "highest cumulative logprob; with stream only when equal to n")
    echo: bool | None = Field(False, description="each choice's text starts with the prompt's; "
                                                 "not with logprobs")

    prompt_param: ClassVar[str] = "prompt"

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if best_of is not None and best_of < n:
            raise PydanticCustomError("invalid_value", "must be at least n ({n}), got {value}",
                                      {"n": n, "value": best_of})
        if best_of is not None and best_of > n and info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "cannot be streamed when greater than n: "
                                      "the choices returned are known only at the end")
        return best_of

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str | list[int]:
        try:
            prompt = handler(value)
        except ValidationError:
            raise _prompt_error(value) from None
        one = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list)
        return prompt[0] if one else prompt


def _prompt_error(value: Any) -> PydanticCustomError:
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str | list) for p in value):
        return PydanticCustomError("unsupported_value", "holds {n} prompts: this server takes "
                                   "one per request", {"n": len(value)})
    if isinstance(value[0] if isinstance(value, list) and len(value) == 1 else value, str):
        return PydanticCustomError("invalid_value", "must not be empty or only whitespace")
    return PydanticCustomError("invalid_type", "must be text, a non-empty list of token ids, or "
                               "a list of one of these, got {value}", {"value": shown(value)})


class ChatCompletionRequest(ToolFields, _Generation):
    """POST /v1/chat/completions (its tools: ToolFields)."""

    model_config = ConfigDict(json_schema_extra=_needs(
        ("stream_options", {"type": "object"}, "stream"),
        ("top_logprobs", {"type": "number"}, "logprobs")))

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = Field(
        None, description="the newer name of max_tokens; wins when both are set")
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_CHAT_TOP_LOGPROBS), INT] | None = Field(
        None, description="requires logprobs: true")

    prompt_param: ClassVar[str] = "messages"
    max_tokens_names: ClassVar[tuple[str, ...]] = ("max_completion_tokens", "max_tokens")

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "requires logprobs to be true")
        return top

    def chat(self) -> list[dict]:
        """The messages as the tokenizer's chat template takes them: {role, content: str},
        and their tool fields if any."""
        return [m.model_dump(exclude_none=True) | {"content": m.content} for m in self.messages]


# ---- responses (what routes.py sends; keys left out of an answer are not required) ----------
FinishReason = Literal["stop", "length"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0)


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=1)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=1)
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[Annotated[int, Field(ge=0)]]


class CompletionChoice(BaseModel):
    index: Annotated[int, Field(ge=0, lt=MAX_CHOICES)]
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class CompletionChunkChoice(CompletionChoice):
    finish_reason: FinishReason | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: Annotated[list[CompletionChoice], Field(min_length=1, max_length=MAX_CHOICES)]
    usage: Usage


class CompletionChunk(Completion):
    choices: Annotated[list[CompletionChunkChoice], Field(max_length=1)]
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null on "
                                                  "every chunk but the last, without choices")


class TopLogprob(BaseModel):
    token: str
    logprob: float = Field(le=0)
    bytes: list[Annotated[int, Field(ge=0, le=255)]]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is only tool calls")
    refusal: None
    tool_calls: list[MessageToolCall] | None = Field(None, description="its calls, if any")


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: Annotated[int, Field(ge=0, lt=MAX_CHOICES)]
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason


class ChatChunkChoice(BaseModel):
    index: Annotated[int, Field(ge=0, lt=MAX_CHOICES)]
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletion(Completion):
    object: Literal["chat.completion"]
    choices: Annotated[list[ChatChoice], Field(min_length=1, max_length=MAX_CHOICES)]


class ChatCompletionChunk(CompletionChunk):
    object: Literal["chat.completion.chunk"]
    choices: Annotated[list[ChatChunkChoice], Field(max_length=1)]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(ge=1)


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str = Field(min_length=1)
    type: Literal["invalid_request_error", "rate_limit_error", "server_error",
                  "authentication_error"]
    param: str | None = Field(description="the parameter to change")
    code: str | None


class ErrorResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


def error_model(message: str, type: str = "invalid_request_error", param: str | None = None,
                code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code))


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return error_model(message, type, param, code).model_dump()
