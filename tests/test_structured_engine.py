"""Structured outputs inside the engine (the tiny model's engine, in process): the scheduling around them.

A grammar still compiling holds only its own request (wait reason grammar_compiling) while the others
keep getting a token every step; a compile that fails ends its request with an error, nobody else's; a
constrained request preempted by recompute (and by swap) keeps its grammar state and still validates;
constrained rows never speculate; the batched bitmask masks exactly the disallowed tokens, including
columns of a padded vocabulary.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import torch

from cobatch.async_engine import AsyncEngine, EngineState
from cobatch.config import EngineConfig
from cobatch.engine import Engine
from cobatch.sampling_params import SamplingParams, StructuredOutputsParams
from cobatch.structured_output.bitmask import GrammarBitmask
from cobatch.structured_output.compiler import GrammarCompiler
from cobatch.tokenizer import Tokenizer
from cobatch.wait_reasons import GRAMMAR_COMPILING

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["cat", "dog"]},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 2}},
    "required": ["id", "kind", "tags"], "additionalProperties": False}


def constrained(max_tokens: int = 80, **overrides: object) -> SamplingParams:
    structured = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    options: dict[str, object] = {"temperature": 0.0, **overrides}
    return SamplingParams(max_tokens=max_tokens, structured_outputs=structured, **options)  # type: ignore[arg-type]


def make_engine(model_dir: Path, **options: object) -> Engine:
    config = EngineConfig(model=str(model_dir), dtype="float32", num_threads=1,  # type: ignore[arg-type]
                          **{"max_model_len": 256, "num_kv_blocks": 128, "block_size": 4, **options})
    return Engine.from_config(config, stats_history=None)


def run(engine: Engine, max_steps: int = 2000) -> dict[str, tuple[list[int], str | None]]:
    """Step until done: each sequence's output tokens and finish reason."""
    out: dict[str, tuple[list[int], str | None]] = {}
    for _ in range(max_steps):
        for delta in engine.step():
            tokens, _ = out.get(delta.request_id, ([], None))
            out[delta.request_id] = (tokens + list(delta.new_token_ids), delta.finish_reason)
        if not engine.has_unfinished_requests():
            return out
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    engine = make_engine(tiny_model_dir)
    engine.add_request("warm", [1, 2, 3], constrained(8))  # the backend's tokenizer info, once
    run(engine)
    return engine


def decode(engine: Engine, tokens: list[int]) -> str:
    backend = engine.structured_outputs.compiler.backend.result()  # type: ignore[union-attr]
    return backend.tokenizer.decode_str(tokens)


def test_outputs_validate_and_stop_when_the_grammar_completes(engine: Engine) -> None:
    engine.add_request("a", [5, 6, 7], constrained())
    engine.add_request("b", [8, 9], constrained(temperature=1.0, seed=1))
    out = run(engine)
    for seq_id in ("a", "b"):
        tokens, reason = out[seq_id]
        assert reason == "stop"
        jsonschema.validate(json.loads(decode(engine, tokens)), SCHEMA)


def test_a_compiling_grammar_holds_only_its_own_request(engine: Engine,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    slow = GrammarCompiler._compile

    def compile_slowly(self: GrammarCompiler, params: StructuredOutputsParams):  # type: ignore[no-untyped-def]
        release.wait(30)
        return slow(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", compile_slowly)
    engine.add_request("free", [10, 11, 12], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    engine.add_request("slow", [13, 14], SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,6}")))
    free_tokens: list[int] = []
    for _ in range(12):  # the free request gets its token every step while the other compiles
        before = len(free_tokens)
        for delta in engine.step():
            assert delta.request_id == "free"
            free_tokens += delta.new_token_ids
        assert len(free_tokens) == before + 1
    status = engine.request_status("slow")
    assert status is not None and status[0].reason == GRAMMAR_COMPILING
    assert status[0].wait_steps.get(GRAMMAR_COMPILING, 0) >= 12
    release.set()
    start = time.monotonic()
    out = run(engine)
    assert time.monotonic() - start < 30
    tokens, reason = out["slow"]
    assert reason == "stop" and 3 <= len(decode(engine, tokens)) <= 6 and decode(engine, tokens).isalpha()


def test_a_failed_compile_ends_only_its_request(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: GrammarCompiler, params: StructuredOutputsParams):  # type: ignore[no-untyped-def]
        raise ValueError("backend refused it")

    monkeypatch.setattr(GrammarCompiler, "_compile", fail)
    engine.add_request("ok", [3, 4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add_request("bad", [3, 4], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["only-this-failing-one"])))
    deltas = [d for _ in range(30) for d in engine.step()]
    bad = [d for d in deltas if d.request_id == "bad"]
    assert len(bad) == 1 and bad[0].finish_reason == "error" and "backend refused it" in (bad[0].error or "")
    assert sum(len(d.new_token_ids) for d in deltas if d.request_id == "ok") == 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_requests_still_validate(tiny_model_dir: Path, mode: str) -> None:
    engine = make_engine(tiny_model_dir, num_kv_blocks=24, max_model_len=96, preemption_mode=mode,
                         swap_space=0.01)
    for i in range(4):
        engine.add_request(f"r{i}", [20 + i] * 19, constrained(60))
    out = run(engine)
    assert engine.scheduler_stats.num_preemptions_total > 0
    for tokens, reason in out.values():
        assert reason == "stop"
        jsonschema.validate(json.loads(decode(engine, tokens)), SCHEMA)


def test_constrained_rows_do_not_speculate(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_speculative_tokens=3)
    engine.add_request("c", [7, 7, 7, 7, 7, 7], constrained(60))
    out = run(engine)
    assert engine.scheduler_stats.num_draft_tokens_total == 0
    jsonschema.validate(json.loads(decode(engine, out["c"][0])), SCHEMA)


def test_a_served_engine_is_ready_only_with_its_grammar_backend_built_on_the_given_tokenizer(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Built beside the first steps, the tokenizer info held the GIL for seconds (~100x slower steps,
    # learned by the step-time model); and the server's tokenizer is reused, not loaded again.
    tokenizer = Tokenizer.load(tiny_model_dir)
    monkeypatch.setattr(Tokenizer, "load", classmethod(lambda cls, model=None: pytest.fail("loaded again")))
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_threads=1,  # type: ignore[arg-type]
                          max_model_len=256, num_kv_blocks=32)

    async def start_and_look() -> bool:
        engine = AsyncEngine.from_config(config, tokenizer=tokenizer)
        engine.start()
        try:
            while engine.state == EngineState.STARTING:
                await asyncio.sleep(0.01)
            assert engine.state == EngineState.READY
            backend = engine._engine.structured_outputs.compiler.backend  # type: ignore[union-attr]
            return backend.done() and backend.exception() is None
        finally:
            await engine.shutdown()

    assert asyncio.run(asyncio.wait_for(start_and_look(), timeout=120))


def test_bitmask_masks_exactly_the_disallowed_tokens_in_one_op() -> None:
    vocab, padded = 70, 80  # the logits are wider than the bitmask's 3 words cover (96 > 80 > 70)
    allowed = [[0, 31, 32, 69], [5], [63, 64]]
    words = torch.zeros((3, 3), dtype=torch.int64)
    for row, ids in enumerate(allowed):
        for t in ids:
            words[row, t // 32] |= 1 << (t % 32)
    bitmask = GrammarBitmask([0, 2, 3], _as_int32(words))
    logits = torch.randn(4, padded)
    expected = logits.clone()
    for row, ids in zip([0, 2, 3], allowed):
        keep = torch.full((padded,), float("-inf"))
        keep[ids] = expected[row, ids]
        expected[row] = keep
    bitmask.apply(logits)
    assert torch.equal(logits, expected)
    assert bitmask.blocked(vocab).shape == (3, vocab)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words as the int32 bit patterns the backends write."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
