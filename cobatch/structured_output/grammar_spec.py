"""A request's StructuredOutputsParams as llguidance grammar text, and the check that names what is wrong.

No tokenizer and no torch: the check runs where a request is validated (HTTP side included), before any
stream starts; the engine compiles the same text against its tokenizer later, off its thread.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from cobatch.sampling_params import StructuredOutputsParams

# Keywords whose subschemas describe objects the same output value must satisfy at once: an
# `additionalProperties: false` added inside one of them would forbid the others' properties.
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
# Between JSON tokens: a run of up to 32 spaces or tabs, or one newline and the next line's indent.
# llguidance's own default is any run of whitespace, which a sampled output can fill max_tokens with.
DEFAULT_WHITESPACE_PATTERN = r"[\x20\x09]{1,32}|\x0D?\x0A[\x20\x09]{0,32}"


class StructuredOutputsError(ValueError):
    """An invalid or unsupported constraint (HTTP 400, naming the problem)."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for `params` (not yet checked: see check_grammar)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = json.loads(params.json) if params.json is not None else {"type": "object"}
        if params.disable_additional_properties and params.json is not None:
            schema = closed_objects(schema)
        options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
        if not params.disable_any_whitespace:
            options["whitespace_pattern"] = params.whitespace_pattern or DEFAULT_WHITESPACE_PATTERN
        if params.lenient:
            options["lenient"] = True
        return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options))
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(params.regex))
    if kind == "choice":
        lark = "start: " + " | ".join(json.dumps(c) for c in params.choice or ())
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    return str(llguidance.grammar_from("grammar", params.grammar))  # Lark, or GBNF converted to Lark


def check_grammar(params: StructuredOutputsParams) -> str:
    """The grammar text of `params`; StructuredOutputsError naming the problem if it cannot be built."""
    try:
        grammar = grammar_text(params)
    except ValueError as exc:  # e.g. a GBNF grammar that does not convert
        raise StructuredOutputsError(f"structured_outputs.{params.kind}: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise StructuredOutputsError(f"structured_outputs.{params.kind} is not supported: "
                                     f"{_first_lines(error)}")
    return grammar


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that does not say (strict)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if ("properties" in out or out.get("type") == "object") and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    return out


def _first_lines(message: str, num_lines: int = 3) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines()[:num_lines])
