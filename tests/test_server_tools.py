"""Tool calls on /v1/chat/completions, end to end: a real `cobatch serve` of the default model and the
official openai client (streams accumulated by the SDK's own ChatCompletionStreamState).

"required" and named choices are constrained by the tools' schemas, so their arguments must parse
and validate on every sample, streamed or not; "none" gives no calls; a conversation that carries
tool calls and tool results is accepted; bad tools are 400s naming the field before anything runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from cobatch.model_paths import resolve_model_path
from tests.server_process import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
BOOK = {"type": "function", "function": {
    "name": "book_flight", "description": "Book a flight for some passengers", "strict": True,
    "parameters": {"type": "object", "properties": {
        "route": {"type": "object", "properties": {
            "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["from", "to"], "additionalProperties": False},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "seats": {"type": "array", "items": {"type": "string", "enum": ["aisle", "window"]},
                  "minItems": 1, "maxItems": 2}},
        "required": ["route", "passengers", "seats"], "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping", "description": "Check that the service is up"}}
TOOLS = [WEATHER, BOOK, PING]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris? Then book a flight CDG to JFK."}]
SAMPLE = {"temperature": 1.0, "max_tokens": 96}  # sampled, so each seed takes another path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("tools") / "server.log"
    proc = ServerProcess(resolve_model_path(None), log, "--max-num-seqs", "8", "--max-model-len",
                         "2048", "--served-model-name", "smol")
    try:
        proc.wait_ready(timeout_s=240.0)  # the default model: a GGUF to dequantize, on a shared CPU
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120.0)


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[Any, list[Any]]:
    """A streamed completion accumulated as the SDK accumulates it, and its raw chunks."""
    state = ChatCompletionStreamState()
    chunks = list(client.chat.completions.create(model="smol", stream=True, **kwargs))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.current_completion_snapshot, chunks  # (get_final_completion refuses "length")


def _check_calls(choice: Any, names: set[str], max_calls: int | None = None) -> list[Any]:
    """The choice is only tool calls, each naming one of `names` with arguments valid for it."""
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and choice.message.content in (None, "")
    assert max_calls is None or len(calls) <= max_calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)
    return calls


def _check_stream_shape(chunks: list[Any]) -> None:
    """Role first; each call's first piece carries index, id, type and name, later ones only arguments."""
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces: dict[tuple[int, int], int] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            assert not choice.delta.content, "no content beside constrained calls"
            for piece in choice.delta.tool_calls or []:
                first = (choice.index, piece.index) not in pieces
                pieces[(choice.index, piece.index)] = pieces.get((choice.index, piece.index), 0) + 1
                assert (piece.id is not None) == first and (piece.type == "function") == first
                assert (piece.function.name is not None) == first
    assert pieces and max(pieces.values()) > 2, "arguments stream in fragments, as they are written"


def _answer(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    """The completion, streamed (its chunks checked for OpenAI's shape) or not."""
    if not stream:
        return client.chat.completions.create(model="smol", **kwargs)
    response, chunks = _streamed(client, **kwargs)
    _check_stream_shape(chunks)
    return response


@pytest.mark.parametrize("stream", [False, True])
def test_required_sampled_calls_always_parse_and_validate(client: openai.OpenAI, stream: bool) -> None:
    # parallel_tool_calls false: one call each (sampled freely, a 135M model lists calls for ever)
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=4,
                  seed=11 + stream, **SAMPLE)
    response = _answer(client, stream, **kwargs)
    for choice in response.choices:
        _check_calls(choice, set(SCHEMAS), max_calls=1)


def test_required_parallel_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0)
    whole = client.chat.completions.create(model="smol", **kwargs).choices[0]
    streamed, chunks = _streamed(client, **kwargs)
    _check_stream_shape(chunks)
    for choice in (whole, streamed.choices[0]):
        _check_calls(choice, set(SCHEMAS))
    assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls] \
        == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
def test_named_choice_calls_that_function_with_valid_nested_arguments(client: openai.OpenAI,
                                                                      stream: bool) -> None:
    kwargs = dict(messages=ASK, tools=TOOLS, n=3, seed=21, **SAMPLE,
                  tool_choice={"type": "function", "function": {"name": "book_flight"}})
    response = _answer(client, stream, **kwargs)
    for choice in response.choices:
        (call,) = _check_calls(choice, {"book_flight"})
        assert set(json.loads(call.function.arguments)) == {"route", "passengers", "seats"}


def test_tool_choice_none_gives_no_calls(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS,
                                              tool_choice="none", max_tokens=24, temperature=0)
    choice = response.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and "<tool_call>" not in choice.message.content


def test_auto_stream_equals_non_stream_and_no_markup_leaks(client: openai.OpenAI) -> None:
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=40, temperature=0)
    whole = client.chat.completions.create(model="smol", **kwargs).choices[0]
    streamed, chunks = _streamed(client, **kwargs)
    got = streamed.choices[0]
    assert got.message.content == whole.message.content and got.finish_reason == whole.finish_reason
    assert ([(c.function.name, c.function.arguments) for c in got.message.tool_calls or []]
            == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text and "</tool_call>" not in text
    for call in whole.message.tool_calls or []:
        assert call.function.name in SCHEMAS
        json.loads(call.function.arguments)


FOLLOW_UP = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_w1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_p1", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_w1", "content": '{"temperature": 18, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "call_p1", "content": "pong"}]


def test_tool_results_follow_up_is_accepted(client: openai.OpenAI, server: ServerProcess) -> None:
    response = client.chat.completions.create(model="smol", messages=FOLLOW_UP, tools=TOOLS,
                                              max_tokens=24, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, max_tokens=1)
    # the tool calls and both results are in the prompt (rendered into the template's text)
    assert response.usage.prompt_tokens > plain.usage.prompt_tokens + 30
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": FOLLOW_UP}).json()
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert '"temperature": 18' in text["prompt"] and "pong" in text["prompt"]


MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("unknown_named_function", {"messages": MSG, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "launch_rocket"}}}, "tool_choice"),
    ("tool_choice_without_tools", {"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ("invalid_schema", {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
     "tools.0.function.parameters"),
    ("non_object_parameters", {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools.0.function.parameters"),
    ("duplicate_names", {"messages": MSG, "tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ("bad_function_name", {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "has space"}}]}, "tools.0.function.name"),
    ("not_a_function_tool", {"messages": MSG, "tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ("bad_tool_choice", {"messages": MSG, "tools": [WEATHER], "tool_choice": "always"},
     "tool_choice"),
    ("tool_message_without_id", {"messages": MSG + [{"role": "tool", "content": "x"}]},
     "messages.1.tool_call_id"),
    ("response_format_beside_required", {"messages": MSG, "tools": [WEATHER], "tool_choice": "required",
                                         "response_format": {"type": "json_object"}}, "response_format"),
    ("tool_calls_on_user", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tools_are_400_naming_the_field(server: ServerProcess, body: dict[str, Any], param: str,
                                            stream: bool) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions",
                          json={**body, "stream": stream, "max_tokens": 4}, timeout=30.0)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is not None
    assert error["param"].startswith(param), error
