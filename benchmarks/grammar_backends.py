"""xgrammar vs llguidance on this CPU, with the default model's tokenizer: the measurement behind the choice.

For each backend that imports: the import, the tokenizer info's build (once per engine), each schema's
compile (a fresh compiler, so no cache; llguidance builds lazily, so its figure includes the first mask,
and so does xgrammar's for the same footing), a batch of 32 rows' token masks per decode step (each row
walking a valid output of its schema, rows at staggered offsets; the library's batched fill on 2
threads, and row by row), the batched in-place apply of the [32, ceil(V/32)] int32 bitmask on fp32
logits (the library's helper, its first call apart, and cobatch's GrammarBitmask.apply, which includes a
clone of the logits as the helper's timing does), and which schema features each refuses at compile time.

    PYTHONPATH=/path/to/xgrammar-install .venv/bin/python -m benchmarks.grammar_backends \
        [--steps 40] [--output-json docs/bench/grammar_backends.json]

xgrammar is not a dependency (it pulls triton); install it aside with `pip install --target DIR
xgrammar==0.2.9` and put DIR's xgrammar, triton and tvm_ffi on PYTHONPATH (without DIR's own torch).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cobatch.structured_output.bitmask import GrammarBitmask
from cobatch.tokenizer import Tokenizer

NUM_ROWS = 32

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_object": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string"}},
                    "required": ["city", "zip"]}}, "required": ["name", "age", "address"]},
    "array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string"}}}, "required": ["id", "tags"]}}},
        "required": ["items"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"]},
    "pattern": {"type": "object", "properties": {
        "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$"}}, "required": ["phone", "code"]},
}

INSTANCES: dict[str, Any] = {
    "nested_object": {"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "zip": "W1"}},
    "array_of_objects": {"items": [{"id": i, "tags": ["alpha", "beta", "gamma"]} for i in range(4)]},
    "enum": {"color": "green", "size": "M"},
    "pattern": {"phone": "555-0199", "code": "AB12345"},
}

# Features probed for coverage: each should compile (a real schema) unless marked invalid.
COVERAGE: dict[str, dict[str, Any]] = {
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"required": ["a"]}]},
    "recursive $ref": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
        "$ref": "#/$defs/node"},
    "const": {"const": "fixed"},
    "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minimum/maximum": {"type": "integer", "minimum": 3, "maximum": 7},
    "exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"const": 1}},
    "not": {"not": {"type": "string"}},
    "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
    "dependentRequired": {"type": "object", "properties": {"a": {}, "b": {}},
                          "dependentRequired": {"a": ["b"]}},
    "pattern lookahead": {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]+$"},
    "invalid: type foo": {"type": "foo"},
    "invalid: dangling $ref": {"$ref": "#/$defs/missing"},
    "invalid: bad pattern": {"type": "string", "pattern": "[a-"},
}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn()'s result and its wall time in ms."""
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1e3


class LlguidanceBackend:
    """llguidance: LLTokenizer from the HF tokenizer, LLMatcher per row, LLExecutor for batched fills."""

    name = "llguidance"

    def __init__(self, hf: object, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg, self.llg_torch = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema: dict[str, Any]) -> str:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: str) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    def fill_one(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.llg_torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)],
                                                   bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llg_torch.apply_token_bitmask_inplace(logits, bitmask)


class XgrammarBackend:
    """xgrammar: TokenizerInfo, GrammarCompiler (cache off here), GrammarMatcher, BatchGrammarMatcher."""

    name = "xgrammar"

    def __init__(self, hf: object, vocab_size: int) -> None:
        import xgrammar
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict[str, Any]) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        try:
            return compiler.compile_json_schema(json.dumps(schema))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and others for bad schemas
            raise ValueError(str(e)) from None

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill_one(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


def measure_compile(backend: Any, vocab_size: int) -> dict[str, float]:
    """Each schema's compile + first mask, in ms (a fresh compile: no cache)."""
    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    result = {}
    for name, schema in SCHEMAS.items():
        _, ms = timed(lambda: backend.fill_one(backend.matcher(backend.compile(schema)), bitmask, 0))
        result[name] = round(ms, 2)
    return result


def walk_tokens(tokenizer: Tokenizer, name: str, eos: int) -> list[int]:
    """A valid output of the schema as the model could write it: compact JSON text, then EOS."""
    text = json.dumps(INSTANCES[name], separators=(",", ":"))
    return tokenizer.encode(text, add_special_tokens=False) + [eos]


def measure_masks(backend: Any, tokenizer: Tokenizer, vocab_size: int, steps: int) -> dict[str, Any]:
    """Per decode step of 32 rows (8 per schema, staggered): batched fill, row-by-row fill, apply (ms)."""
    eos = tokenizer.eos_token_ids[0]
    compiled = {name: backend.compile(schema) for name, schema in SCHEMAS.items()}
    walks = [walk_tokens(tokenizer, name, eos) for name in SCHEMAS]
    rows = [(i % len(SCHEMAS), i // len(SCHEMAS)) for i in range(NUM_ROWS)]  # (schema, offset)
    bitmask = torch.full((NUM_ROWS, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(NUM_ROWS, vocab_size)
    batched, one_by_one, applied, ours = [], [], [], []
    logit_rows = list(range(NUM_ROWS))
    first_apply_ms = timed(lambda: backend.apply(logits.clone(), bitmask))[1]  # a compile, for llguidance
    for _ in range(steps):
        matchers, positions = _restart(backend, compiled, rows), [off for _, off in rows]
        for m, (s, off) in zip(matchers, rows):
            for t in walks[s][:off]:
                assert backend.accept(m, t)
        for _ in range(min(len(w) for w in walks) - NUM_ROWS // len(SCHEMAS)):
            batched.append(timed(lambda: backend.fill_batch(matchers, bitmask))[1])
            one_by_one.append(timed(lambda: [backend.fill_one(m, bitmask, i)
                                             for i, m in enumerate(matchers)])[1])
            applied.append(timed(lambda: backend.apply(logits.clone(), bitmask))[1])
            ours.append(timed(lambda: GrammarBitmask(logit_rows, bitmask).apply(logits.clone()))[1])
            for i, (m, (s, _)) in enumerate(zip(matchers, rows)):
                assert backend.accept(m, walks[s][positions[i]]), (backend.name, s, positions[i])
                positions[i] += 1
        if len(batched) >= steps:
            break
    return {"fill_batched_ms": _summary(batched), "fill_row_by_row_ms": _summary(one_by_one),
            "apply_ms": _summary(applied), "first_apply_ms": round(first_apply_ms, 1),
            "apply_cobatch_ms": _summary(ours), "num_steps": len(batched)}


def _restart(backend: Any, compiled: dict[str, Any], rows: list[tuple[int, int]]) -> list[Any]:
    grammars = list(compiled.values())
    return [backend.matcher(grammars[s]) for s, _ in rows]


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "p90": round(sorted(values)[int(0.9 * len(values))], 3)}


def measure_coverage(backend: Any) -> dict[str, str]:
    """'ok' or the refusal's message (first 160 characters) per probed feature."""
    result = {}
    for name, schema in COVERAGE.items():
        try:
            backend.compile(schema)
            result[name] = "ok"
        except ValueError as e:
            result[name] = "refused: " + str(e).strip().splitlines()[0][:160]
    return result


def measure(backend_cls: type, tokenizer: Tokenizer, steps: int) -> dict[str, Any]:
    """Everything for one backend."""
    module = backend_cls.name
    _, import_ms = timed(lambda: importlib.import_module(module))
    vocab_size = tokenizer.vocab_size
    backend, info_ms = timed(lambda: backend_cls(tokenizer.hf, vocab_size))
    return {"version": getattr(importlib.import_module(module), "__version__", "?"),
            "import_ms": round(import_ms, 1), "tokenizer_info_ms": round(info_ms, 1),
            "compile_ms": measure_compile(backend, vocab_size),
            "masks_32_rows": measure_masks(backend, tokenizer, vocab_size, steps),
            "coverage": measure_coverage(backend)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output-json", type=Path, default=Path("docs/bench/grammar_backends.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = Tokenizer.load()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "vocab_size": tokenizer.vocab_size,
                              "num_rows": NUM_ROWS}
    for backend_cls in (LlguidanceBackend, XgrammarBackend):
        try:
            report[backend_cls.name] = measure(backend_cls, tokenizer, args.steps)
        except ImportError as e:
            report[backend_cls.name] = {"error": f"not importable: {e}"}
        print(json.dumps({backend_cls.name: report[backend_cls.name]}, indent=1))
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
