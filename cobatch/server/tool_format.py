"""How tools, tool calls and tool results reach the chat template, and the markup the model answers in.

A template that renders `tools` itself (Qwen, Hermes, Llama 3.1 ...) gets them as transformers
documents: `apply_chat_template(messages, tools=...)`, tool calls with their arguments as objects.
Many templates ignore `tools` (the default SmolLM2's does). For those, as vLLM and llama.cpp do for
templates without tool support, cobatch writes the tools into the system message itself, in the
Hermes style: signatures inside <tools></tools>, calls as <tool_call>{"name", "arguments"}</tool_call>,
results as user turns inside <tool_response></tool_response>. This module is the one place that
choice is made; `tool_parsers` reads the same tags back.
"""

from __future__ import annotations

import json
from typing import Any

from cobatch.server.protocol import ChatMessage, ChatTool, ToolCallParam
from cobatch.tokenizer import Tokenizer

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_PROBE_NAME = "cobatch_probe_function_7f3a"

Rendered = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]  # (messages, tools) for the template


def template_supports_tools(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders the tools it is given: one probe render, at start-up."""
    probe = {"type": "function", "function": {"name": _PROBE_NAME, "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe])
    except Exception:  # noqa: BLE001 - a template that chokes on tools does not support them
        return False
    return _PROBE_NAME in tokenizer.decode(ids, skip_special_tokens=False)


def template_inputs(messages: list[ChatMessage], tools: list[ChatTool], native: bool) -> Rendered:
    """The conversation and tools as the template takes them: natively, or written into the text."""
    if native:
        specs = [tool.model_dump(exclude_none=True) for tool in tools]
        return [_native_message(m) for m in messages], specs or None
    rendered = _polyfilled(messages)
    if tools:
        rendered = _with_tools_block(rendered, tools)
    return rendered, None


def format_tool_call(name: str, arguments: object) -> str:
    """One call in the markup the fallback asks the model for (and shows it in earlier turns)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _role(message: ChatMessage) -> str:
    return "system" if message.role == "developer" else message.role


def _arguments(call: ToolCallParam) -> object:
    """A call's arguments as an object (templates expect one); text that is not JSON stays text."""
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def _native_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(message), "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c)}} for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def _polyfilled(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Tool calls written into the assistant's text; tool results as user turns in tags (consecutive
    results share one turn, for templates that want the roles to alternate)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if message.role != "tool":
            out.append(_polyfilled_message(message))
        elif i > 0 and messages[i - 1].role == "tool":
            out[-1]["content"] += "\n" + _tool_response(message.text())
        else:
            out.append({"role": "user", "content": _tool_response(message.text())})
    return out


def _polyfilled_message(message: ChatMessage) -> dict[str, Any]:
    text = message.text()
    calls = [format_tool_call(c.function.name, _arguments(c)) for c in message.tool_calls or []]
    return {"role": _role(message), "content": "\n".join(([text] if text else []) + calls)}


def _tool_response(text: str) -> str:
    return f"{TOOL_RESPONSE_OPEN}\n{text}\n{TOOL_RESPONSE_CLOSE}"


def _with_tools_block(messages: list[dict[str, Any]], tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools' description at the end of the system message (a new one if there is none)."""
    block = _tools_block(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        text = f"{first['content']}\n\n{block}" if first["content"] else block
        return [{**first, "content": text}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def _tools_block(tools: list[ChatTool]) -> str:
    signatures = "\n".join(json.dumps(tool.model_dump(exclude_none=True), ensure_ascii=False)
                           for tool in tools)
    example = (f'{TOOL_CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON '
               f'object>}}\n{TOOL_CALL_CLOSE}')
    return ("# Tools\n\nYou may call functions to answer. Their signatures, one JSON object a line:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            f"To call one, answer with the call in these tags (one pair per call):\n{example}\n"
            f"Each result comes back in a later turn inside {TOOL_RESPONSE_OPEN}"
            f"{TOOL_RESPONSE_CLOSE}.")
