"""Structured outputs through LLM.generate on the default model: JSON schemas, regex, choice, grammar.

Outputs that finish with "stop" must validate (jsonschema / re.fullmatch / membership); a batch that
mixes constrained and unconstrained rows leaves the unconstrained greedy outputs exactly as alone; an
invalid or unsupported constraint is a ValueError naming it before anything runs.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from cobatch import LLM, SamplingParams
from cobatch.sampling_params import StructuredOutputsParams

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1,
             "maxItems": 3}},
    "required": ["name", "age", "role", "email", "address", "tags"]}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


def greedy(max_tokens: int = 96, **constraint: object) -> SamplingParams:
    structured = StructuredOutputsParams(**constraint) if constraint else None  # type: ignore[arg-type]
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512, num_kv_blocks=256, num_threads=1)


def test_nested_schema_with_enum_pattern_and_array_validates(llm: LLM) -> None:
    prompts = ["Describe a user of our web site as JSON.", "A guest account, as JSON:"]
    params = [greedy(120, json=PERSON, disable_additional_properties=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=120, structured_outputs=StructuredOutputsParams(
                  json=PERSON, disable_any_whitespace=True, disable_additional_properties=True))]
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        value = json.loads(completion.text)
        jsonschema.validate(value, PERSON)
    assert " " not in json.dumps(value, separators=(",", ":")).replace(json.dumps(value["name"]), "")


def test_regex_and_choice(llm: LLM) -> None:
    outs = llm.generate(["Call me at", "Is the sky green? Answer:", "Pick a colour:"],
                        [greedy(regex=PHONE), greedy(choice=["yes", "no"]),
                         greedy(choice=("red", "green", "blue"))], use_tqdm=False)
    phone, answer, colour = (o.outputs[0] for o in outs)
    assert re.fullmatch(PHONE, phone.text) and phone.finish_reason == "stop"
    assert answer.text in ("yes", "no") and answer.finish_reason == "stop"
    assert colour.text in ("red", "green", "blue")


def test_lark_and_gbnf_grammars(llm: LLM) -> None:
    lark = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= "x=" [0-9] [0-9]? ";"'
    outs = llm.generate(["What is 6 times 7?", "Set x:"], [greedy(grammar=lark), greedy(grammar=gbnf)],
                        use_tqdm=False)
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", outs[0].outputs[0].text)
    assert re.fullmatch(r"x=[0-9]{1,2};", outs[1].outputs[0].text)


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(llm: LLM) -> None:
    free = ["The capital of France is", "Once upon a time"]
    alone = llm.generate(free, greedy(24), use_tqdm=False)
    mixed = llm.generate(free + ["A user as JSON:", "Call me at"],
                         [greedy(24), greedy(24), greedy(120, json=PERSON, disable_additional_properties=True),
                          greedy(regex=PHONE)],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), PERSON)


def test_n_samples_each_follow_the_schema(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=schema))
    (out,) = llm.generate(["Status as JSON:"], params, use_tqdm=False)
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_gives_an_object(llm: LLM) -> None:
    (out,) = llm.generate(["Give me any JSON object:"], greedy(96, json_object=True), use_tqdm=False)
    if out.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(out.outputs[0].text), dict)
    else:  # truncated by max_tokens: still the start of an object
        assert out.outputs[0].text.lstrip().startswith("{")


@pytest.mark.parametrize("constraint, named", [
    ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"json": {"type": "foo"}}, "foo"),
    ({"json": {"$ref": "#/$defs/missing"}}, "missing"),
    ({"regex": "[a-"}, "regex"),
    ({"grammar": 'start: "a" | ('}, "grammar"),
])
def test_invalid_or_unsupported_constraint_is_a_value_error(llm: LLM, constraint: dict[str, object],
                                                             named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        llm.generate(["x"], greedy(**constraint), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_lenient_ignores_what_strict_refuses(llm: LLM) -> None:
    schema = {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 2}
    (out,) = llm.generate(["Two numbers:"], greedy(40, json=schema, lenient=True), use_tqdm=False)
    value = json.loads(out.outputs[0].text)
    assert isinstance(value, list) and len(value) <= 2 and set(value) <= {1, 2, 3}


def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{")
    same = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert same == StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert hash(same) == hash(SamplingParams(structured_outputs=same).structured_outputs)
    assert list(json.loads(same.json)["properties"]) == ["b", "a"]  # declared order kept: the output's
