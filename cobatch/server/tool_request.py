"""A chat request's tools checked (400s before anything runs) and what they ask of the server: a ToolPlan.

tool_choice "none": no tools in the prompt, no calls read. "auto" (the default with tools): the
template is told the tools and `tool_parsers` reads calls from the free text. "required" and a named
function: the output is constrained to `tool_constrained`'s schema through the structured-outputs
backend, so the arguments always parse and validate against the tool's schema.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import jsonschema

from cobatch.sampling_params import SamplingParams, StructuredOutputsParams
from cobatch.server.errors import bad_request
from cobatch.server.protocol import ChatCompletionRequest, ChatMessage, ChatTool, NamedToolChoice
from cobatch.server.tool_constrained import (NamedCallReader, RequiredCallsReader, arguments_schema,
                                             required_schema)
from cobatch.server.tool_parsers import HermesToolParser, ToolCallExtractor

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a chat request uses its tools: the mode, the tools the template sees, the output schema."""

    mode: ToolMode
    tools: tuple[ChatTool, ...] = ()  # rendered into the prompt (none under tool_choice "none")
    named: str | None = None
    parallel_tool_calls: bool = True
    schema: dict[str, Any] | None = None  # the constraint of "required" / named

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """The request's SamplingParams with the tool-call constraint (required / named)."""
        if self.schema is None:
            return params
        if params.structured_outputs is not None:
            raise bad_request("response_format (or structured_outputs, guided_*) cannot be "
                              f"combined with tool_choice {self.mode!r}", "response_format")
        # Compact JSON, and no properties the schema does not declare (unless it allows more
        # itself) for every tool, strict or not: a call still valid for its schema, never padded.
        constraint = StructuredOutputsParams(json=self.schema, disable_any_whitespace=True,
                                             disable_additional_properties=True)
        return replace(params, structured_outputs=constraint)

    def extractor(self) -> ToolCallExtractor | None:
        """A fresh reader of one choice's output (None: the output is plain content)."""
        if self.mode == "named":
            assert self.named is not None
            return NamedCallReader(self.named)
        if self.mode == "required":
            return RequiredCallsReader()
        if self.mode == "auto":
            return HermesToolParser((t.function.name for t in self.tools), self.parallel_tool_calls)
        return None


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    """Check the request's tools, tool_choice and tool messages; 400 naming the field otherwise."""
    check_tool_messages(req.messages)
    tools = list(req.tools or [])
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
        return ToolPlan("none")
    _check_tools(tools)
    if choice == "none":
        return ToolPlan("none")
    if choice is None or choice == "auto":
        return ToolPlan("auto", tuple(tools), parallel_tool_calls=req.parallel_tool_calls)
    if isinstance(choice, NamedToolChoice):
        return _named_plan(tools, choice.function.name)
    schema = required_schema(tools, req.parallel_tool_calls)
    return ToolPlan("required", tuple(tools), parallel_tool_calls=req.parallel_tool_calls,
                    schema=schema)


def _named_plan(tools: list[ChatTool], name: str) -> ToolPlan:
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools",
                          "tool_choice")
    return ToolPlan("named", tuple(tools), named=name, parallel_tool_calls=False,
                    schema=arguments_schema(tool))


def _check_tools(tools: list[ChatTool]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise bad_request(f"the function name {name!r} appears twice in tools",
                              f"tools.{i}.function.name")
        seen.add(name)
        _check_parameters(tool.function.parameters, f"tools.{i}.function.parameters")


def _check_parameters(schema: dict[str, Any] | None, param: str) -> None:
    """A function's parameters: a valid JSON schema, of an object."""
    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise bad_request(f"a function's parameters must be a JSON schema of type 'object', got "
                          f"type {str(schema.get('type'))[:40]!r}", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise bad_request(f"not a valid JSON schema: {exc.message[:200]}", param) from None
    except (RecursionError, ValueError, TypeError) as exc:  # pathological input, not a schema
        raise bad_request(f"not a valid JSON schema ({type(exc).__name__})", param) from None


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """tool_calls only on assistant messages, tool_call_id on (and only on) tool messages."""
    for i, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
        if message.role == "tool" and not message.tool_call_id:
            raise bad_request("a tool message needs the tool_call_id it answers",
                              f"messages.{i}.tool_call_id")
        if message.role != "tool" and message.tool_call_id is not None:
            raise bad_request("only tool messages carry a tool_call_id", f"messages.{i}.tool_call_id")
