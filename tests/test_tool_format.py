"""Tools, tool calls and tool results through the chat template: the default model's (which ignores
tools, so they are written into the text) and a template that renders tools itself."""

from __future__ import annotations

import json

import pytest

from cobatch.server.protocol import ChatCompletionRequest
from cobatch.server.tool_format import template_inputs, template_supports_tools
from cobatch.tokenizer import Tokenizer

NATIVE_TEMPLATE = ("{% if tools %}TOOLS={{ tools | tojson }}{% endif %}{% for m in messages %}"
                   "|[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}CALLS={{ m.tool_calls | tojson }}"
                   "{% endif %}{% if m.tool_call_id %}ID={{ m.tool_call_id }}{% endif %}{% endfor %}")

REQUEST = ChatCompletionRequest.model_validate({
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "21C"}],
    "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load()


def _render(tokenizer: Tokenizer, native: bool) -> str:
    messages, tools = template_inputs(REQUEST.messages, REQUEST.tools or [], native)
    return tokenizer.decode(tokenizer.apply_chat_template(messages, tools=tools),
                            skip_special_tokens=False)


def test_default_template_gets_the_tools_written_in_the_text(tokenizer: Tokenizer) -> None:
    assert not template_supports_tools(tokenizer)
    text = _render(tokenizer, native=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in system and "<tools>" in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>') in text
    # both results in one user turn, then the assistant's turn
    assert ("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert "<|im_start|>tool" not in text


def test_without_tools_the_system_message_is_left_alone(tokenizer: Tokenizer) -> None:
    messages, tools = template_inputs(REQUEST.messages[:2], [], native=False)
    assert tools is None and messages[0] == {"role": "system", "content": "Be brief."}


def test_a_template_with_tools_gets_them_as_transformers_documents() -> None:
    tokenizer = Tokenizer.load()
    tokenizer.hf.chat_template = NATIVE_TEMPLATE
    assert template_supports_tools(tokenizer)
    text = _render(tokenizer, native=True)
    tools_line, *turns = text.split("|")
    assert json.loads(tools_line.removeprefix("TOOLS="))[0]["function"]["name"] == "get_weather"
    calls = json.loads(turns[2].removeprefix("[assistant]CALLS="))
    assert calls[1] == {"id": "c2", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    assert turns[3:] == ["[tool]18CID=c1", "[tool]21CID=c2"]
