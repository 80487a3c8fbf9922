"""Structured outputs in the API: OpenAI's `response_format` and vLLM's `structured_outputs`,
read into the engine's StructuredOutput (engine/structured.py compiles and applies it).

- response_format {"type": "text"}: no constraint; {"type": "json_object"}: any JSON object;
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}: JSON
  valid against the schema (always held to it, whatever `strict` says; no schema: any JSON).
- structured_outputs (vLLM's extension): exactly one of json (a schema, as an object or as
  JSON text), regex, choice (a list of strings), grammar (Lark or GBNF) or json_object: true.

The request models check the shape; whether the library can compile a schema, regex or
grammar is the engine's to say, when the request is submitted (a 400 naming the parameter).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from engine.sampling import StructuredOutput

ANY_JSON_OBJECT = '{"type": "object"}'
ANY_JSON = "{}"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchema(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema",
                                           description="a JSON Schema; absent: any JSON")
    strict: bool | None = Field(None, description="accepted; the output always follows the "
                                                  "schema")


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                           Field(discriminator="type")]


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json",
                                               description="a JSON Schema (object or text)")
    regex: Annotated[str, Field(min_length=1)] | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="a Lark (or GBNF) grammar")
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        if len(self.model_fields_set - {"json_object"}) + bool(self.json_object) != 1:
            raise PydanticCustomError("invalid_value", "must set exactly one of json, regex, "
                                      "choice, grammar and json_object: true")
        return self

    def spec(self) -> StructuredOutput:
        if self.json_object:
            return StructuredOutput("json", ANY_JSON_OBJECT)
        if self.json_ is not None:
            schema = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return StructuredOutput("json", schema)
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(self.choice))
        assert self.grammar is not None
        return StructuredOutput("grammar", self.grammar)


def response_format_spec(fmt: Any) -> StructuredOutput | None:
    if isinstance(fmt, JsonObjectFormat):
        return StructuredOutput("json", ANY_JSON_OBJECT)
    if isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema_
        return StructuredOutput("json", ANY_JSON if schema is None else json.dumps(schema))
    return None
