"""tool_choice "required" / named: the schema that constrains the output, and its JSON read as calls.

Named: the output is the function's arguments object itself (its schema is the constraint).
Required: the output is `[{"name": <a tool's name>, "arguments": <that tool's arguments>}, ...]`,
at most one element unless parallel_tool_calls. The grammar backend keeps the text to the schema, so
the readers below scan it as it streams: a call's header goes out once its name is read, then its
arguments as the raw fragments that arrive (their concatenation is the arguments' exact JSON text).
"""

from __future__ import annotations

import json
from typing import Any

from cobatch.server.protocol import ChatTool
from cobatch.server.tool_parsers import ToolEvents, arguments_piece, call_header


def arguments_schema(tool: ChatTool) -> dict[str, Any]:
    """A tool's arguments schema, always of an object (a function without parameters takes {})."""
    if tool.function.parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object", **tool.function.parameters}


def required_schema(tools: list[ChatTool], parallel_tool_calls: bool) -> dict[str, Any]:
    """The JSON schema of a list of calls to any of `tools` (one call unless parallel)."""
    options = [{"type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": arguments_schema(t)},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": options[0] if len(options) == 1 else {"anyOf": options}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _string_step(char: str, escaped: bool) -> tuple[bool, bool]:
    """(still inside the string, escaped) after `char`, read inside a JSON string."""
    if escaped:
        return True, False
    if char == "\\":
        return True, True
    return char != '"', False


class _JsonValue:
    """Follows one JSON object or array char by char: which chars belong to it, and when it closes."""

    __slots__ = ("depth", "in_string", "escaped", "started", "done")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False
        self.started = self.done = False

    def push(self, char: str) -> bool:
        """Whether `char` is part of the value (whitespace before it and anything after are not)."""
        if self.done or (not self.started and char.isspace()):
            return False
        self.started = True
        if self.in_string:
            self.in_string, self.escaped = _string_step(char, self.escaped)
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            self.done = self.depth <= 0
        return True


class NamedCallReader:
    """tool_choice named: the whole output is one call's arguments."""

    def __init__(self, name: str) -> None:
        self.name, self.value, self.num_calls = name, _JsonValue(), 0

    def feed(self, text: str) -> ToolEvents:
        """Generated text -> the call's header (first time) and the arguments' new fragment."""
        out = ToolEvents()
        fragment = "".join(c for c in text if self.value.push(c))
        if self.num_calls == 0:
            out.add_call_piece(call_header(0, self.name, fragment))
            self.num_calls = 1
        elif fragment:
            out.add_call_piece(arguments_piece(0, fragment))
        return out

    def finish(self) -> ToolEvents:
        return self.feed("")


class RequiredCallsReader:
    """tool_choice required: a JSON list of {"name", "arguments"} objects, read as it streams.

    Depth 1 is the list, depth 2 a call object; a string at depth 2 is a key or a value, and the
    value after the key "arguments" is followed by a `_JsonValue`. Arguments read before the name
    (a grammar that reorders keys) wait in `pending` for the call's header.
    """

    def __init__(self) -> None:
        self.num_calls = 0
        self.depth, self.in_string, self.escaped = 0, False, False
        self.string: list[str] = []  # the raw chars of the string being read at depth 2
        self.expect_key, self.key = True, ""
        self.name: str | None = None
        self.arguments: _JsonValue | None = None
        self.pending = ""

    def feed(self, text: str) -> ToolEvents:
        """Generated text -> call headers and argument fragments."""
        out = ToolEvents()
        fragment: list[str] = []
        for char in text:
            if self.arguments is not None and not self.arguments.done:
                if self.arguments.push(char):
                    fragment.append(char)
                    continue
            self._emit(out, fragment)
            self._structure(out, char)
        self._emit(out, fragment)
        return out

    def finish(self) -> ToolEvents:
        return ToolEvents()

    def _emit(self, out: ToolEvents, fragment: list[str]) -> None:
        if not fragment:
            return
        text = "".join(fragment)
        fragment.clear()
        if self.name is None:
            self.pending += text
        else:
            out.add_call_piece(arguments_piece(self.num_calls - 1, text))

    def _structure(self, out: ToolEvents, char: str) -> None:
        """One char outside the arguments: strings, brackets, and the ':' and ',' of a call object."""
        if self.in_string:
            self._string_char(out, char)
        elif char == '"' and self.depth == 2:
            self.in_string, self.string = True, []
        elif char in "[{":
            self.depth += 1
            if self.depth == 2:
                self.name, self.arguments, self.pending, self.expect_key = None, None, "", True
        elif char in "]}":
            self.depth -= 1
        elif char == ":" and self.depth == 2:
            self.expect_key = False
            if self.key == "arguments":
                self.arguments = _JsonValue()
        elif char == "," and self.depth == 2:
            self.expect_key = True

    def _string_char(self, out: ToolEvents, char: str) -> None:
        self.in_string, self.escaped = _string_step(char, self.escaped)
        if self.in_string:
            self.string.append(char)
        else:
            self._string_done(out, json.loads('"' + "".join(self.string) + '"'))

    def _string_done(self, out: ToolEvents, value: str) -> None:
        if self.expect_key:
            self.key = value
        elif self.key == "name" and self.name is None:
            self.name = value
            out.add_call_piece(call_header(self.num_calls, value, self.pending))
            self.num_calls += 1
            self.pending = ""
