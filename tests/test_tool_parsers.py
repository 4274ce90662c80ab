"""Tool-call readers without a model: auto's Hermes/JSON parser and the constrained outputs' readers.

Every reader must give the same content and calls whether its text comes whole or in pieces split
anywhere (as tokens split it), and tool-call markup must never reach the content.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from cobatch.server.protocol import ChatTool
from cobatch.server.tool_constrained import (NamedCallReader, RequiredCallsReader, arguments_schema,
                                             required_schema)
from cobatch.server.tool_parsers import (HermesToolParser, ToolCallExtractor, ToolEvents,
                                         assemble_calls)

TOOLS = ("get_weather", "search")


def _run(extractor: ToolCallExtractor, pieces: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Feed the pieces; the content deltas sent, and the calls as (name, arguments) once assembled."""
    events = ToolEvents()
    contents = []
    for piece in pieces:
        step = extractor.feed(piece)
        contents.append(step.content)
        events.extend(step)
    last = extractor.finish()
    contents.append(last.content)
    events.extend(last)
    calls = [(c.function.name, c.function.arguments) for c in assemble_calls(events.calls)]
    assert len({c.id for c in assemble_calls(events.calls)}) == len(calls)  # one id per call
    return [c for c in contents if c], calls


def _splits(text: str, seed: int) -> list[list[str]]:
    """The text whole, char by char, and cut at random places."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [[text], list(text), [text[a:b] for a, b in zip(bounds, bounds[1:])]]


def _auto(parallel: bool = True) -> HermesToolParser:
    return HermesToolParser(TOOLS, parallel_tool_calls=parallel)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
PARIS = ("get_weather", '{"city": "Paris", "unit": "c"}')

AUTO_CASES = [
    # (output, content, calls)
    ("Just text, no calls.\n", "Just text, no calls.\n", []),
    ("a < b and <tool is not a tag", "a < b and <tool is not a tag", []),
    ("ends in a partial tag <tool_", "ends in a partial tag <tool_", []),
    (CALL, None, [PARIS]),
    ("Let me check.\n" + CALL + "\n", "Let me check.", [PARIS]),
    (CALL + "\n" + CALL.replace("Paris", "Rome"), None,
     [PARIS, ("get_weather", '{"city": "Rome", "unit": "c"}')]),
    ('<tool_call>{"name": "search", "parameters": {"q": "x"}}</tool_call>', None,
     [("search", '{"q": "x"}')]),
    ('<tool_call>{"name": "search", "arguments": "{\\"q\\": 1}"}</tool_call>', None,
     [("search", '{"q": 1}')]),
    ('<tool_call>{"name": "search"}</tool_call>', None, [("search", "{}")]),
    # not calls: broken JSON, an undeclared function -- the text stands, whitespace included
    ("See:  <tool_call>{not json}</tool_call> end", "See:  <tool_call>{not json}</tool_call> end", []),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    # a tag left open at the end: a call if what it holds parses
    ('<tool_call>{"name": "search", "arguments": {"q": "y"}}', None, [("search", '{"q": "y"}')]),
    ('<tool_call>{"name": "search", "argu', '<tool_call>{"name": "search", "argu', []),
    # answers that are only JSON
    ('  {"name": "search", "arguments": {"q": "z"}}', None, [("search", '{"q": "z"}')]),
    ('[{"name": "search", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     None, [("search", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('[1, 2, 3]', '[1, 2, 3]', []),
    ("   ", "   ", []),
]


@pytest.mark.parametrize("output,content,calls", AUTO_CASES, ids=range(len(AUTO_CASES)))
def test_auto_parser_same_result_however_the_text_is_split(output: str, content: str | None,
                                                           calls: list[tuple[str, str]]) -> None:
    for seed, pieces in enumerate(_splits(output, seed=len(output))):
        sent, got = _run(_auto(), pieces)
        assert got == calls, pieces
        assert ("".join(sent) or None) == content, (seed, pieces)
        for arguments in (a for _, a in got):
            json.loads(arguments)


def test_auto_markup_never_reaches_the_content() -> None:
    output = "Checking. " + CALL + " Done." + CALL
    for pieces in _splits(output, seed=3):
        sent, calls = _run(_auto(), pieces)
        assert "".join(sent) == "Checking. Done."
        assert not any("<" in delta for delta in sent) and len(calls) == 2


def test_auto_content_streams_before_the_end() -> None:
    parser = _auto()
    assert parser.feed("Hello ").content == "Hello"  # trailing space held: a tag may follow
    assert parser.feed("world <tool").content == " world"  # "<tool" held: it may be a tag
    assert parser.feed("kit").content == " <toolkit"


def test_auto_parallel_tool_calls_false_keeps_the_first_call() -> None:
    _, calls = _run(_auto(parallel=False), [CALL, CALL.replace("Paris", "Rome")])
    assert calls == [PARIS]


# ---- constrained outputs: required (a list of calls) and named (the arguments) ----------------------

REQUIRED_OUTPUT = ('[{"name":"get_weather","arguments":{"city":"São \\"P\\"","nested":{"a":[1,{"b":"}"}]}}},'
                   ' {"arguments": {"q": "x, y: z"}, "name": "se\\u0061rch"}]')


def test_required_reader_streams_the_exact_arguments_text() -> None:
    expected = [("get_weather", '{"city":"São \\"P\\"","nested":{"a":[1,{"b":"}"}]}}'),
                ("search", '{"q": "x, y: z"}')]  # arguments before the name: sent after it
    for pieces in _splits(REQUIRED_OUTPUT, seed=1):
        sent, calls = _run(RequiredCallsReader(), pieces)
        assert calls == expected and not sent
        assert [json.loads(a) for _, a in calls][0]["nested"]["a"][1]["b"] == "}"


def test_required_reader_header_first_then_fragments() -> None:
    reader = RequiredCallsReader()
    first = reader.feed('[{"name":"search","arguments":{"q"')
    assert len(first.calls) == 1 and first.calls[0].id and first.calls[0].type == "function"
    assert first.calls[0].function.name == "search" and first.calls[0].function.arguments == '{"q"'
    later = reader.feed(':"x"}}]')
    assert later.calls[0].id is None and later.calls[0].function.name is None
    assert later.calls[0].function.arguments == ':"x"}'


def test_named_reader_is_the_arguments() -> None:
    text = '{"city": "Paris", "days": [1, 2]}'
    for pieces in _splits(text, seed=2):
        sent, calls = _run(NamedCallReader("get_weather"), pieces)
        assert calls == [("get_weather", text)] and not sent
    reader = NamedCallReader("search")
    header = reader.feed("")  # the header goes out at the first update, arguments ""
    assert header.calls[0].function.name == "search" and header.calls[0].function.arguments == ""


def _tool(name: str, parameters: dict | None) -> ChatTool:
    return ChatTool.model_validate({"type": "function", "function": {"name": name,
                                                                      "parameters": parameters}})


def test_required_schema_accepts_calls_and_refuses_the_rest() -> None:
    tools = [_tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]}),
             _tool("ping", None)]
    schema = required_schema(tools, parallel_tool_calls=True)
    jsonschema.validate([{"name": "ping", "arguments": {}},
                         {"name": "get_weather", "arguments": {"city": "x"}}], schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "nope", "arguments": {}}],
                [{"name": "ping"}], {"name": "ping", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(tools, parallel_tool_calls=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "arguments": {}}] * 2, single)
    assert arguments_schema(tools[1])["type"] == "object"
