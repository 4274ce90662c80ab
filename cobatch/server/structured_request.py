"""The request fields that constrain the output -> StructuredOutputsParams, or a 400 naming the field.

OpenAI's `response_format` (json_object; json_schema, strict or not), vLLM's `structured_outputs` and its
legacy `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`: at most one per request.
The grammar is built and checked here, before anything is submitted, so an invalid or unsupported
constraint never starts a stream.
"""

from __future__ import annotations

from typing import Any

from cobatch.sampling_params import StructuredOutputsParams
from cobatch.server.errors import bad_request
from cobatch.server.protocol import _SamplingRequest
from cobatch.structured_output.grammar_spec import StructuredOutputsError, check_grammar

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs_of(req: _SamplingRequest) -> StructuredOutputsParams | None:
    """The request's constraint (None: unconstrained), checked; 400 naming the field otherwise."""
    sources = _sources(req)
    if not sources:
        return None
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        raise bad_request(f"only one output constraint per request: got {names}", sources[1][0])
    field, options = sources[0]
    try:
        params = StructuredOutputsParams(**options)
        check_grammar(params)
    except ValueError as exc:  # StructuredOutputsError too: the grammar's own message, prefixed by the field
        problem = str(exc).removeprefix("structured_outputs.") if isinstance(exc, StructuredOutputsError) else exc
        raise bad_request(f"{field}: {problem}", field) from exc
    return params


def _sources(req: _SamplingRequest) -> list[tuple[str, dict[str, Any]]]:
    """(field, StructuredOutputsParams options) of every constraint field the request sets."""
    sources = []
    response_format = _response_format(req.response_format)
    if response_format is not None:
        sources.append(("response_format", response_format))
    if req.structured_outputs is not None:
        options = req.structured_outputs.model_dump(exclude_none=True)
        if "json_" in options:
            options["json"] = options.pop("json_")
        sources.append(("structured_outputs", options))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            sources.append((name, {kind: value}))
    return sources


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as options (None: plain text).

    json_schema with strict true: the schema exactly, objects closed where they do not say otherwise
    (OpenAI's strict mode), a keyword the backend cannot enforce is a 400. Strict false or absent: the
    keywords it cannot enforce are ignored (lenient), the rest is enforced all the same.
    """
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad_request(f"response_format type {str(kind)[:40]!r} is not supported "
                          "(text, json_object or json_schema)", "response_format")
    spec = (fmt or {}).get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format json_schema needs a json_schema object "
                          '({"name": ..., "schema": {...}, "strict": ...})', "response_format")
    schema = spec.get("schema", {"type": "object"})
    strict = spec.get("strict") is True
    return {"json": schema, "disable_additional_properties": strict, "lenient": not strict}

