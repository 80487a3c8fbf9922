"""Tool calls in a model's output: the formats chat templates teach, parsed out of the text, and
the grammars that make a forced call well-formed.

Formats (`--tool-call-parser`, or picked from the chat template's text by `detect`):

- hermes (Hermes, Qwen 2.5/3, and this server's fallback rendering, app/web/api/tools.py):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one tag per call;
- llama3: the whole answer is `{"name": ..., "parameters": {...}}` (several joined by `;`,
  an optional `<|python_tag|>` first);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- qwen3-coder: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
  </function>\\n</tool_call>` (a value is JSON where it parses as such, else text);
- harmony (gpt-oss): messages `<|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]
  <|message|>BODY<|end|>` (`<|call|>` ends a call, `<|return|>` the answer), each after
  `<|start|>assistant`: the final channel is the content, the analysis channel (reasoning)
  is dropped, a commentary message to a function is a call whose body is its arguments.

Each parser splits a region of the output (from the first opening marker on) into complete
calls and what is left; `ToolStream` feeds it the output piece by piece, so a streamed answer
and a whole one are the same parse. Text a parser cannot read as a call stays the model's
text (content): nothing is dropped.

In the JSON formats (hermes, llama3, mistral), a call object that starts with its name then
its arguments key (`{"name": "...", "arguments"|"parameters": {`) keeps the model's own text
of the arguments object; it is *opened* as soon as that much is read (`ToolParser.opened`:
its name and its arguments so far, never past the object's closing brace), so a stream can
send the arguments as they come. Other call objects' arguments are re-dumped JSON.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

PARSERS = ("auto", "hermes", "llama3", "mistral", "qwen3-coder", "harmony")
# Forced calls' JSON: one line, spaced as the templates' `tojson` writes it.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = ""

    @staticmethod
    def new_id() -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: Any, arguments: Any) -> ToolCall | None:
    """A call from its decoded parts; None unless a name and an object of arguments."""
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), ToolCall.new_id())


# A call object's start: its name, then its arguments key and the arguments object's brace.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                   r'"(?:arguments|parameters)"\s*:\s*(?=\{)')
_COMMA = re.compile(r"\s*,\s*")


def _head(text: str, at: int) -> tuple[str, int] | None:
    """For a call object at text[at] that starts with its name then its arguments key: the
    name and where the arguments object begins; else None."""
    found = _HEAD.match(text, at)
    if found is None:
        return None
    try:
        name = json.loads(found.group(1))
    except ValueError:
        return None
    return (name, found.end()) if name else None


# A brace, or a string with its escapes (to its end, or the text's while it is open): the
# regex skips strings at C speed, as each token re-reads the call.
_BRACES = re.compile(r'"(?:[^"\\]|\\.)*"?|[{}]', re.S)


def _object_end(text: str, at: int) -> int | None:
    """Where the JSON object opening at text[at] ends (after its closing brace), or None while
    it is open: a brace scanner that skips strings and their escapes."""
    depth = 0
    for found in _BRACES.finditer(text, at):
        if found.group() == "{":
            depth += 1
        elif found.group() == "}":
            depth -= 1
            if depth == 0:
                return found.end()
    return None


def _opened(text: str, at: int, many: bool) -> list[tuple[str, str]]:
    """The calls begun at text[at] (several separated by commas with `many`): each one's name
    and arguments text so far, up to the arguments object's closing brace."""
    out: list[tuple[str, str]] = []
    while (head := _head(text, at)) is not None:
        end = _object_end(text, head[1])
        out.append((head[0], text[head[1]:end]))
        whole = None if end is None or not many else _object_end(text, at)
        comma = None if whole is None else _COMMA.match(text, whole)
        if comma is None:
            break
        at = comma.end()
    return out


def _raw(call: ToolCall, text: str, at: int) -> ToolCall:
    """A complete call read from the object at text[at], with the model's own text of its
    arguments where the object starts with its name then its arguments."""
    opened = _opened(text, at, many=False)
    return call if not opened else ToolCall(*opened[0], call.id)


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """One format. `opens` says where the calls begin; `split` reads complete calls off the
    front of the region (from that point on) and returns them with the rest."""

    name: ClassVar[str]
    marker: ClassVar[str]  # the text that opens the calls

    def opens(self, text: str) -> tuple[int | None, int]:
        """(where the calls begin in `text`, or None; how many trailing characters to hold
        back because they could begin it)."""
        at = text.find(self.marker)
        return (at, 0) if at >= 0 else (None, _held(text, self.marker))

    def split(self, region: str, final: bool) -> tuple[list[ToolCall], str]:
        raise NotImplementedError

    def opened(self, rest: str) -> list[tuple[str, str]]:
        """The calls begun in what `split` left, not complete yet: each one's name and its
        arguments text so far (none in a format whose arguments are not the model's text)."""
        return []

    def take(self, region: str, final: bool) -> tuple[str, list[ToolCall], str]:
        """Text to release from the region (a format whose messages carry the content, as
        harmony's), its complete calls, and the rest."""
        return ("", *self.split(region, final))

    def grammar(self, tools: list[tuple[str, dict]], many: bool) -> str:
        """A Lark grammar (llguidance) for one call of one of `tools` (name, parameters
        schema), or with `many` one or more."""
        raise NotImplementedError

    def _object_schema(self, tools: list[tuple[str, dict]], key: str) -> dict:
        one = [{"type": "object", "properties": {"name": {"const": name}, key: schema},
                "required": ["name", key], "additionalProperties": False}
               for name, schema in tools]
        return {"anyOf": one, "x-guidance": JSON_STYLE}


class HermesParser(ToolParser):
    name, marker = "hermes", "<tool_call>"
    close = "</tool_call>"

    def split(self, region: str, final: bool) -> tuple[list[ToolCall], str]:
        calls: list[ToolCall] = []
        rest = region
        while rest.lstrip().startswith(self.marker):
            body = rest.lstrip()[len(self.marker):]
            read = self._read(body)  # the call, and where it ends in body
            if read is None:
                break  # incomplete (wait), or not a call (text)
            after = body[read[1]:].lstrip()
            if after.startswith(self.close):
                rest = after[len(self.close):]
            elif final and not after:
                rest = ""  # a model may stop at end-of-sequence without the closing tag
            else:
                break
            calls.append(read[0])
        return calls, (rest if rest.strip() else "")

    def opened(self, rest: str) -> list[tuple[str, str]]:
        rest = rest.lstrip()
        if not rest.startswith(self.marker):
            return []
        body = rest[len(self.marker):]
        return _opened(body, len(body) - len(body.lstrip()), many=False)

    def _read(self, body: str) -> tuple[ToolCall, int] | None:
        start = len(body) - len(body.lstrip())
        try:
            data, end = json.JSONDecoder().raw_decode(body, start)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        call = _call(data.get("name"), data.get("arguments", data.get("parameters")))
        return None if call is None else (_raw(call, body, start), end)

    def grammar(self, tools: list[tuple[str, dict]], many: bool) -> str:
        schema = json.dumps(self._object_schema(tools, "arguments"))
        start = 'call ("\\n" call)*' if many else "call"
        return (f"start: {start}\n"
                f'call: "{self.marker}\\n" body "\\n{self.close}"\n'
                f"body: %json {schema}\n")


class Llama3Parser(ToolParser):
    name, marker = "llama3", "<|python_tag|>"

    def opens(self, text: str) -> tuple[int | None, int]:
        # The calls are the whole answer: it begins with "{" or the python tag, or has none.
        stripped = text.lstrip()
        if stripped.startswith(("{", self.marker)):
            return 0, 0
        if not stripped or self.marker.startswith(stripped):
            return None, len(text)
        return None, 0

    def split(self, region: str, final: bool) -> tuple[list[ToolCall], str]:
        rest = region.lstrip()
        rest = rest[len(self.marker):] if rest.startswith(self.marker) else rest
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        while rest.strip():
            rest = rest.lstrip().removeprefix(";").lstrip()
            try:
                data, end = decoder.raw_decode(rest)
            except ValueError:
                break
            call = (_call(data.get("name"), data.get("parameters", data.get("arguments")))
                    if isinstance(data, dict) else None)
            if call is None:
                break
            calls.append(_raw(call, rest, 0))
            rest = rest[end:]
        return calls, (rest if rest.strip() else "")

    def opened(self, rest: str) -> list[tuple[str, str]]:
        rest = rest.lstrip().removeprefix(self.marker).lstrip().removeprefix(";").lstrip()
        return _opened(rest, 0, many=False)

    def grammar(self, tools: list[tuple[str, dict]], many: bool) -> str:
        schema = json.dumps(self._object_schema(tools, "parameters"))
        start = 'body ("; " body)*' if many else "body"
        return f"start: {start}\nbody: %json {schema}\n"


class MistralParser(ToolParser):
    name, marker = "mistral", "[TOOL_CALLS]"

    def split(self, region: str, final: bool) -> tuple[list[ToolCall], str]:
        body = region.lstrip().removeprefix(self.marker).lstrip()
        try:
            data, end = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return [], region
        items = data if isinstance(data, list) else [data]
        calls = [_call(i.get("name"), i.get("arguments", i.get("parameters")))
                 if isinstance(i, dict) else None for i in items]
        if not calls or None in calls:
            return [], region
        # The raw arguments, object by object along the array (well-formed: it decoded).
        kept, at = [], self._first(body)
        for call in calls:
            assert call is not None
            kept.append(_raw(call, body, at))
            comma = _COMMA.match(body, _object_end(body, at) or end)
            at = comma.end() if comma else end
        rest = body[end:]
        return kept, (rest if rest.strip() else "")

    def opened(self, rest: str) -> list[tuple[str, str]]:
        body = rest.lstrip().removeprefix(self.marker).lstrip()
        return _opened(body, self._first(body), many=True)

    @staticmethod
    def _first(body: str) -> int:
        """Where the first call object begins: in the array, or the body (one object)."""
        return len(body) - len(body[1:].lstrip()) if body.startswith("[") else 0

    def grammar(self, tools: list[tuple[str, dict]], many: bool) -> str:
        one = self._object_schema(tools, "arguments")
        array = {"type": "array", "items": {"anyOf": one["anyOf"]}, "minItems": 1,
                 "x-guidance": JSON_STYLE} | ({} if many else {"maxItems": 1})
        return f'start: "{self.marker}" body\nbody: %json {json.dumps(array)}\n'


class Qwen3CoderParser(HermesParser):
    name = "qwen3-coder"
    _function = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>", re.S)
    _parameter = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)

    def opened(self, rest: str) -> list[tuple[str, str]]:
        return []  # the arguments are JSON built from the parameters: sent once complete

    def _read(self, body: str) -> tuple[ToolCall, int] | None:
        found = self._function.match(body)
        if found is None:
            return None
        arguments = {}
        for key, value in self._parameter.findall(found.group(2)):
            try:
                arguments[key] = json.loads(value)
            except ValueError:
                arguments[key] = value  # text, as the format writes strings
        call = _call(found.group(1), arguments)
        return None if call is None else (call, found.end())

    def grammar(self, tools: list[tuple[str, dict]], many: bool) -> str:
        # One rule per function, its parameters in the schema's order (the required always,
        # the others optional); a value is text for plain strings, else JSON.
        functions = " | ".join(f"f{i}" for i in range(len(tools)))
        rules = ["start: " + ('call ("\\n" call)*' if many else "call"),
                 f'call: "<tool_call>\\n" ({functions}) "</tool_call>"']
        tail = json.dumps("\n</parameter>\n")
        for i, (name, schema) in enumerate(tools):
            parts = []
            for j, (key, sub, required) in enumerate(_qwen_params(name, schema)):
                head, text = json.dumps(f"<parameter={key}>\n"), _qwen_text(sub)
                rule = f"f{i}_{j}" if text is None else f"F{i}_{j}"  # upper case: a lexeme
                body = f"%json {json.dumps(sub)}" if text is None else f"({text})"
                rules.append(f"{rule}: {head} {body} {tail}")
                parts.append(rule + ("" if required else "?"))
            opening = json.dumps(f"<function={name}>\n")
            rules.append(f'f{i}: {opening} {" ".join(parts)} "</function>\\n"')
        return "\n".join(rules) + "\n"


# What a qwen3-coder parameter's text may not be: the parser reads a value as JSON where it
# parses as such (Python's json also takes NaN and Infinity), so a string must not.
_QWEN_JSONISH = (r"/[ \t\n\r]*(-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null"
                 r"|NaN|-?Infinity|[\"\[{](?s:.*))[ \t\n\r]*/")
_QWEN_TOP = {"type", "properties", "required", "additionalProperties", "description", "title",
             "$defs", "definitions", "$schema"}


def _qwen_params(name: str, schema: dict) -> list[tuple[str, dict, bool]]:
    """A function's parameters (key, schema with the root's definitions, required); a
    ValueError for a schema a list of parameters cannot express."""
    extra = sorted(set(schema) - _QWEN_TOP)
    properties, required = schema.get("properties", {}), set(schema.get("required", ()))
    if extra or schema.get("type", "object") != "object" or not required <= set(properties):
        raise ValueError(f"the parameters of {name!r} cannot be forced in the qwen3-coder "
                         f"format (only properties, required and additionalProperties can)")
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    return [(key, (sub if isinstance(sub, dict) else {}) | defs | {"x-guidance": JSON_STYLE},
             key in required) for key, sub in properties.items()]


def _qwen_text(schema: dict) -> str | None:
    """The lexeme of a parameter written as text (a plain string, or an enum of strings that
    do not read as JSON), or None: written as JSON."""
    keys = set(schema) - {"description", "title", "x-guidance", "$defs", "definitions"}
    enum = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if enum is not None and keys <= {"enum", "const", "type"}:
        plain = all(isinstance(v, str) and not _is_json(v) and "</parameter>" not in v
                    for v in enum)
        return " | ".join(json.dumps(v) for v in enum) if plain and enum else None
    if schema.get("type") != "string" or not keys <= {"type", "minLength", "maxLength"}:
        return None
    length = f"{{{schema.get('minLength', 0)},{schema.get('maxLength', '')}}}"
    return f"/(?s:.{length})/ & ~/(?s:.*)<\\/parameter>(?s:.*)/ & ~{_QWEN_JSONISH}"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class HarmonyParser(ToolParser):
    name, marker = "harmony", "<|channel|>"
    start = "<|start|>assistant"
    _header = re.compile(r"(?:<\|start\|>assistant)?(.*?)<\|message\|>", re.S)
    _channel = re.compile(r"<\|channel\|>(\w+)")
    _recipient = re.compile(r"to=functions\.([^\s<]+)")
    _ends = ("<|end|>", "<|call|>", "<|return|>")

    def opens(self, text: str) -> tuple[int | None, int]:
        # The messages are the whole answer (the prompt ends with `<|start|>assistant`).
        stripped = text.lstrip()
        if stripped.startswith((self.marker, self.start)):
            return 0, 0
        if any(m.startswith(stripped) for m in (self.marker, self.start)):
            return None, len(text)
        return None, 0

    def split(self, region: str, final: bool) -> tuple[list[ToolCall], str]:
        return self.take(region, final)[1:]

    def take(self, region: str, final: bool) -> tuple[str, list[ToolCall], str]:
        text, calls, rest = "", [], region.lstrip()
        while rest:
            header = self._header.match(rest)
            if header is None:
                break  # incomplete header (wait), or not a message (text)
            channel = self._channel.search(header.group(1))
            recipient = self._recipient.search(header.group(1))
            body = rest[header.end():]
            ends = [(body.find(m), m) for m in self._ends if m in body]
            end, marker = min(ends) if ends else (-1, "")
            if recipient is not None:
                if end < 0 and not final:
                    break  # the call is not complete yet
                call = self._call(recipient.group(1), body if end < 0 else body[:end])
                if call is None:
                    break  # not a call: the model's text
                calls.append(call)
            elif channel is None or channel.group(1) != "analysis":  # analysis: reasoning
                if end < 0:  # release what cannot begin an end marker; keep the header
                    hold = 0 if final else max(_held(body, m) for m in self._ends)
                    text += body[:len(body) - hold]
                    rest = "" if final else rest[:header.end()] + body[len(body) - hold:]
                    break
                text += body[:end]
            elif end < 0:
                break
            rest = body[end + len(marker):] if end >= 0 else ""
        return text, calls, rest

    def _call(self, name: str, body: str) -> ToolCall | None:
        try:
            arguments = json.loads(body)
        except ValueError:
            return None
        call = _call(name, arguments)
        return None if call is None else ToolCall(name, body.strip(), call.id)

    def grammar(self, tools: list[tuple[str, dict]], many: bool) -> str:
        # One call: `<|call|>` ends the turn (several calls are several turns).
        names = " | ".join(f"c{i}" for i in range(len(tools)))
        rules = ["start: call", f'call: "<|channel|>commentary to=functions." ({names})']
        for i, (name, schema) in enumerate(tools):
            body = schema | {"x-guidance": JSON_STYLE}
            rules.append(f"c{i}: {json.dumps(name + ' <|constrain|>json<|message|>')} "
                         f'%json {json.dumps(body)} "<|call|>"')
        return "\n".join(rules) + "\n"


_BY_NAME: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3Parser, MistralParser, Qwen3CoderParser, HarmonyParser)}


def detect(template: str | None) -> str:
    """The format a chat template teaches; hermes when it teaches none (this server's fallback
    rendering, app/web/api/tools.py, uses it) or one this server does not know."""
    if not template:
        return "hermes"
    if "<|channel|>" in template or "to=functions" in template:
        return "harmony"
    if "<function=" in template:
        return "qwen3-coder"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def parser(name: str, template: str | None) -> ToolParser:
    """The parser named by --tool-call-parser ("auto": the template's)."""
    return _BY_NAME[detect(template) if name == "auto" else name]()


class ToolStream:
    """The model's output, piece by piece, as text and complete tool calls: text is released
    as soon as it cannot begin a call; a call once it is complete; at the end, whatever did not
    read as a call is text. `opened` holds the calls begun but not complete (name, arguments
    so far) after each piece, for a stream that sends them as they come."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.calls: list[ToolCall] = []
        self.opened: list[tuple[str, str]] = []
        self._pending = ""  # text not yet released, before any call
        self._region: str | None = None  # from the calls' opening marker on

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Text to release now, and calls completed by this piece."""
        if self._region is None:
            self._pending += text
            at, hold = self.parser.opens(self._pending)
            if at is None:
                cut = len(self._pending) - hold
                out, self._pending = self._pending[:cut], self._pending[cut:]
                return out, []
            out, self._region, self._pending = self._pending[:at], self._pending[at:], ""
            more, calls = self._take(final=False)
            return out + more, calls
        self._region += text
        return self._take(final=False)

    def finish(self, text: str = "", cut: bool = False) -> tuple[str, list[ToolCall]]:
        """The last piece: text left (held back, or not readable as calls) and the last calls.
        With `cut`, the calls opened but never complete (max_tokens cut them, or the model
        stopped) are calls whose arguments are the text so far, and the rest of the calls'
        region (their format's syntax) is not text; without, that region is text."""
        out, calls = self.feed(text)
        if self._region is None:
            return out + self._pending, calls
        more, last = self._take(final=True)
        rest, self._region = self._region, ""
        if cut and self.opened:
            kept = [ToolCall(name, arguments, ToolCall.new_id())
                    for name, arguments in self.opened]
            self.calls, self.opened = self.calls + kept, []
            return out + more, calls + last + kept
        return out + more + rest, calls + last

    def _take(self, final: bool) -> tuple[str, list[ToolCall]]:
        assert self._region is not None
        text, calls, self._region = self.parser.take(self._region, final)
        self.calls += calls
        self.opened = self.parser.opened(self._region)
        return text, calls


def parse(parser: ToolParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output: its text outside the calls, and the calls (as ToolStream reads it)."""
    stream = ToolStream(parser)
    return stream.finish(text)
