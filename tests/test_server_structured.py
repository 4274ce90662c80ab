"""Structured outputs over HTTP: a real `cobatch serve` of the default model and the official openai client.

response_format (json_object, json_schema strict and not) on both endpoints, vLLM's structured_outputs
and guided_* extensions, streamed and not, beside unconstrained requests in the same batch; an invalid
or unsupported constraint is an OpenAI-shaped 400 naming the field, before any stream starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from cobatch.model_paths import resolve_model_path
from tests.server_process import ServerProcess, serving

ITEM = {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
    "size": {"enum": ["S", "M", "L"]},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    "ship": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
             "required": ["city"]}},
    "required": ["sku", "qty", "size", "notes", "ship"]}
STRICT_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}
ASK = [{"role": "user", "content": "Order one item from the shop, as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("structured") / "server.log"
    with serving(resolve_model_path(None), log, "--max-num-seqs", "8", "--max-model-len", "1024",
                 "--served-model-name", "smol") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300.0)


def chat(client: openai.OpenAI, stream: bool, **options: Any) -> tuple[str, str | None]:
    """The reply's text and finish reason, streamed or not."""
    args: dict[str, Any] = {"model": "smol", "messages": ASK, "max_tokens": 110, **options}
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content or "", choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason


def complete(client: openai.OpenAI, stream: bool, prompt: str, **options: Any) -> tuple[str, str | None]:
    args: dict[str, Any] = {"model": "smol", "prompt": prompt, "max_tokens": 40, **options}
    if "response_format" in args:  # the SDK's completions take it only as an extra (a vLLM extension there)
        args["extra_body"] = {**args.get("extra_body", {}), "response_format": args.pop("response_format")}
    if not stream:
        choice = client.completions.create(**args).choices[0]
        return choice.text, choice.finish_reason
    text, reason = "", None
    for chunk in client.completions.create(stream=True, **args):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True])
def test_strict_json_schema_in_a_busy_batch(client: openai.OpenAI, stream: bool) -> None:
    with ThreadPoolExecutor(6) as pool:
        free = [pool.submit(chat, client, stream, temperature=1.0, seed=i) for i in range(2)]
        constrained = [pool.submit(chat, client, stream, response_format=STRICT_FORMAT, temperature=t, seed=i)
                       for i, t in enumerate((0.0, 1.0, 1.0))]
        for future in constrained:
            text, reason = future.result()
            assert reason == "stop", text
            value = json.loads(text)
            jsonschema.validate(value, ITEM)
            assert set(value) == set(ITEM["properties"]) and set(value["ship"]) == {"city"}  # strict: closed
        assert all(f.result()[1] in ("stop", "length") for f in free)


def test_json_object_and_lenient_schema(client: openai.OpenAI) -> None:
    text, reason = chat(client, False, response_format={"type": "json_object"}, temperature=0.0, max_tokens=60)
    assert isinstance(json.loads(text), dict) if reason == "stop" else text.lstrip().startswith("{")
    lenient = {"type": "json_schema", "json_schema": {"name": "ids", "schema": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3,
        "uniqueItems": True}}}  # not strict: the keyword llguidance cannot enforce is ignored
    text, reason = chat(client, True, response_format=lenient, temperature=0.0, max_tokens=30)
    value = json.loads(text)
    assert isinstance(value, list) and len(value) <= 3 and all(0 <= v <= 9 for v in value)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_extensions(client: openai.OpenAI, stream: bool) -> None:
    text, _ = complete(client, stream, "My phone number is", extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", text)
    text, reason = complete(client, stream, "The best pet is a",
                            extra_body={"structured_outputs": {"choice": ["cat", "dog"]}})
    assert text in ("cat", "dog") and reason == "stop"
    text, _ = complete(client, stream, "Count:", extra_body={"guided_grammar": 'root ::= [1-3] ("," [1-3])?'})
    assert re.fullmatch(r"[1-3](,[1-3])?", text)
    text, reason = complete(client, stream, "An item as JSON:", max_tokens=110, temperature=0.0,
                            extra_body={"structured_outputs": {"json": ITEM, "disable_additional_properties": True}})
    assert reason == "stop"
    jsonschema.validate(json.loads(text), ITEM)
    closed = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
              "additionalProperties": False}
    text, reason = complete(client, stream, "A pet:", extra_body={"guided_json": closed}, temperature=0.0)
    assert reason == "stop" and json.loads(text)["pet"] in ("cat", "dog")
    text, _ = complete(client, stream, "A pet:", response_format={"type": "json_object"}, max_tokens=30,
                       temperature=0.0)
    assert text.lstrip().startswith("{")


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "foo"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex", "regex"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs", "exactly one"),
    ({"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "guided_choice", "only one"),
    ({"extra_body": {"guided_grammar": 'start: "a" | ('}}, "guided_grammar", "grammar"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("options, param, named", BAD)
def test_invalid_constraints_are_400s_naming_the_field(client: openai.OpenAI, stream: bool,
                                                       options: dict[str, Any], param: str, named: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, stream, **options)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and error["type"] == "invalid_request_error"
    assert named in error["message"] and param in error["message"]
    with pytest.raises(openai.BadRequestError):
        complete(client, stream, "x", **options)
