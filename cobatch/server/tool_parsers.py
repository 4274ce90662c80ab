"""tool_choice "auto": tool calls read back from the model's free text, streamed or whole.

The model calls a tool in tool_format's markup, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
or answers with nothing but such JSON (an object or a list of them; "parameters" is taken for
"arguments", as Llama 3's format writes it). A call counts only if it parses and names a declared
tool; anything else stays in the content, verbatim. Markup never reaches the content: text that may
be the start of a tag is held back until it is known, and a call is sent once whole (its arguments
in one fragment). An answer that starts with "{" or "[" is held to its end, since only then is it
known whether it is a call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from cobatch.server.protocol import (DeltaFunctionCall, DeltaToolCall, FunctionCallOutput,
                                     ToolCall)
from cobatch.server.tool_format import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


@dataclass(slots=True)
class ToolEvents:
    """What some generated text adds to a message: content text and tool-call pieces."""

    content: str = ""
    calls: list[DeltaToolCall] = field(default_factory=list)

    def add_call_piece(self, piece: DeltaToolCall) -> None:
        """Append a piece, merged into the last one when it continues the same call."""
        last = self.calls[-1] if self.calls else None
        if last is None or last.index != piece.index or piece.id is not None:
            self.calls.append(piece)
            return
        assert last.function is not None and piece.function is not None
        last.function.arguments = (last.function.arguments or "") + (piece.function.arguments or "")

    def extend(self, other: ToolEvents) -> None:
        self.content += other.content
        for piece in other.calls:
            self.add_call_piece(piece)


class ToolCallExtractor(Protocol):
    """Turns one choice's generated text into content and tool calls, one piece at a time."""

    num_calls: int

    def feed(self, text: str) -> ToolEvents: ...

    def finish(self) -> ToolEvents: ...


def new_call_id() -> str:
    """A tool call id in OpenAI's shape."""
    return f"call_{uuid.uuid4().hex[:24]}"


def call_header(index: int, name: str, arguments: str = "") -> DeltaToolCall:
    """A call's first piece: index, id, type and name (and what is known of the arguments)."""
    return DeltaToolCall(index=index, id=new_call_id(), type="function",
                         function=DeltaFunctionCall(name=name, arguments=arguments))


def arguments_piece(index: int, fragment: str) -> DeltaToolCall:
    """A later piece of a call: more of its arguments."""
    return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment))


def assemble_calls(pieces: Iterable[DeltaToolCall]) -> list[ToolCall]:
    """Whole calls from their streamed pieces, as an SDK's accumulator builds them."""
    calls: dict[int, ToolCall] = {}
    for piece in pieces:
        function = piece.function or DeltaFunctionCall()
        call = calls.get(piece.index)
        if call is None:
            assert piece.id is not None, "a call's first piece carries its id"
            calls[piece.index] = ToolCall(id=piece.id, function=FunctionCallOutput(
                name=function.name or "", arguments=function.arguments or ""))
        else:
            call.function.arguments += function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser:
    """tool_choice "auto": <tool_call> tags or a bare JSON call, out of streamed text."""

    def __init__(self, tool_names: Iterable[str], parallel_tool_calls: bool = True) -> None:
        self.tool_names = frozenset(tool_names)
        self.parallel_tool_calls = parallel_tool_calls
        self.num_calls = 0
        self.mode = "start"  # start (only whitespace so far) | text | call (inside a tag) | json
        self.buffer = ""  # text not yet sent: a held tail, or the inside of an open tag
        self.before_call = ""  # whitespace before an open tag: dropped if it is a call

    def feed(self, text: str) -> ToolEvents:
        """Add generated text; returns what is now known to be content or a call."""
        self.buffer += text
        out = ToolEvents()
        while self._advance(out):
            pass
        return out

    def finish(self) -> ToolEvents:
        """The end of the output: what is held is settled (a call if it parses, else content)."""
        out = ToolEvents()
        held, self.buffer = self.buffer, ""
        if self.mode == "json":
            calls = self._parse_json_answer(held)
            if calls is None:
                out.content += held
            for name, arguments in calls or ():
                self._add_call(out, name, arguments)
        elif self.mode == "call":  # a tag left open at the end (EOS, max_tokens, a stop string)
            self._close_call(out, held, TOOL_CALL_OPEN + held)
        else:
            out.content += held.rstrip() if self.num_calls else held
        return out

    def _advance(self, out: ToolEvents) -> bool:
        """One step of the state machine; True while it can go on with what it holds."""
        if self.mode == "start":
            stripped = self.buffer.lstrip()
            if stripped:
                self.mode = "json" if stripped[0] in "{[" else "text"
            return bool(stripped) and self.mode == "text"
        if self.mode == "text":
            return self._advance_text(out)
        if self.mode == "call":
            end = self.buffer.find(TOOL_CALL_CLOSE)
            if end < 0:
                return False
            inner, self.buffer = self.buffer[:end], self.buffer[end + len(TOOL_CALL_CLOSE):]
            self._close_call(out, inner, TOOL_CALL_OPEN + inner + TOOL_CALL_CLOSE)
            self.mode = "text"
            return True
        return False  # json: held to the end

    def _advance_text(self, out: ToolEvents) -> bool:
        start = self.buffer.find(TOOL_CALL_OPEN)
        if start >= 0:
            before = self.buffer[:start]
            body = before.rstrip()
            out.content += body
            self.before_call = before[len(body):]
            self.buffer, self.mode = self.buffer[start + len(TOOL_CALL_OPEN):], "call"
            return True
        # Hold a tail that may grow into a tag, and trailing whitespace (dropped before a call).
        safe = self.buffer[:len(self.buffer) - _partial_tag_length(self.buffer, TOOL_CALL_OPEN)]
        body = safe.rstrip()
        out.content += body
        self.buffer = self.buffer[len(body):]
        return False

    def _close_call(self, out: ToolEvents, inner: str, raw: str) -> None:
        call = self._parse_call(inner)
        if call is None:
            out.content += self.before_call + raw  # not a call after all: the text stands
        else:
            self._add_call(out, *call)
        self.before_call = ""

    def _add_call(self, out: ToolEvents, name: str, arguments: str) -> None:
        if self.num_calls and not self.parallel_tool_calls:
            return  # parallel_tool_calls false: the first call only
        out.add_call_piece(call_header(self.num_calls, name, arguments))
        self.num_calls += 1

    def _parse_call(self, text: str) -> tuple[str, str] | None:
        try:
            return self._call_of(json.loads(text))
        except ValueError:
            return None

    def _call_of(self, obj: object) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of one {"name", "arguments"} object naming a declared tool."""
        if not isinstance(obj, dict) or obj.get("name") not in self.tool_names:
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return str(obj["name"]), json.dumps(arguments, ensure_ascii=False)

    def _parse_json_answer(self, text: str) -> list[tuple[str, str]] | None:
        """The calls of an answer that is only JSON (one call or a list of them), or None."""
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [self._call_of(item) for item in items]
        if not calls or any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None]
