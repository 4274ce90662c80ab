"""Memory pressure with the real runner: a pool of ~1.5 maximal sequences and a dozen long requests.

Everything completes, preemption happens, and every token equals a run with a roomy pool, for
recompute and for swap. What could never fit is refused up front instead of waiting forever.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.sampling_params import SamplingParams
from tests.runner_helpers import runner_for, tiny_hf_model

MAX_MODEL_LEN = 64
BLOCK_SIZE = 4
BLOCKS_PER_SEQ = MAX_MODEL_LEN // BLOCK_SIZE
SMALL_POOL = BLOCKS_PER_SEQ * 3 // 2  # about 1.5 maximal sequences
MAX_STEPS = 20_000  # a livelock or preemption thrash shows up as hitting this


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's ops are microseconds: with two intra-op threads on two busy shared cores,
    OpenMP barriers made these tests 100x slower. One thread, restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf_llama() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=3)


def long_prompts(num: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (8 + 2 * i,), generator=gen).tolist() for i in range(num)]


def make(hf_llama: torch.nn.Module, num_kv_blocks: int, mode: str = "recompute",
         num_swap_blocks: int = 0, max_num_seqs: int = 16) -> Engine:
    runner = runner_for(hf_llama, num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE,
                        num_swap_blocks=num_swap_blocks)
    config = SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE,
                             max_model_len=MAX_MODEL_LEN, preemption_mode=mode,
                             num_swap_blocks=num_swap_blocks, max_num_seqs=max_num_seqs)
    return Engine(runner, config)


def run_to_completion(engine: Engine, prompts: list[list[int]],
                      params: SamplingParams | None = None) -> dict[str, tuple[list[int], str]]:
    """Each request grows to max_model_len (greedy, no EOS); returns (tokens, finish reason)."""
    for i, p in enumerate(prompts):
        fill = params or SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - len(p),
                                        ignore_eos=True)
        engine.add_request(f"r{i}", p, fill)
    out: dict[str, tuple[list[int], str]] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            tokens, _ = out.get(delta.request_id, ([], ""))
            out[delta.request_id] = (tokens + list(delta.new_token_ids), delta.finish_reason or "")
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests(), "the engine never finished: livelock or thrash"
    assert engine.scheduler.block_manager.num_used_blocks == 0, "blocks leaked"
    return out


@pytest.fixture(scope="module")
def roomy(hf_llama) -> dict[str, tuple[list[int], str]]:
    return run_to_completion(make(hf_llama, num_kv_blocks=12 * BLOCKS_PER_SEQ), long_prompts())


@pytest.mark.parametrize("mode,num_swap_blocks", [("recompute", 0), ("swap", 4 * BLOCKS_PER_SEQ)])
def test_a_pool_of_one_and_a_half_sequences_completes_everything_identically(
        hf_llama, roomy, mode: str, num_swap_blocks: int) -> None:
    engine = make(hf_llama, SMALL_POOL, mode, num_swap_blocks)
    out = run_to_completion(engine, long_prompts())
    assert out == roomy  # every request: same tokens, same "length" finish
    assert {reason for _, reason in out.values()} == {"length"}
    assert engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    if mode == "swap":
        assert any(s.num_preempted for s in engine.stats)
        assert sum(1 for s in engine.stats if s.num_swapped) > 0, "swap mode never swapped"


def test_n_maximal_samples_in_a_small_pool_take_turns_and_finish(hf_llama) -> None:
    """n=4 sequences of max_model_len cannot run together here; they must still all finish."""
    engine = make(hf_llama, SMALL_POOL)
    prompt = long_prompts(1)[0]
    params = SamplingParams(temperature=0.9, seed=11, n=4, ignore_eos=True,
                            max_tokens=MAX_MODEL_LEN - len(prompt))
    out = run_to_completion(engine, [prompt], params)
    assert sorted(out) == [f"r0#{i}" for i in range(4)]
    assert all(len(t) == MAX_MODEL_LEN - len(prompt) and r == "length" for t, r in out.values())


def test_what_could_never_fit_is_refused_up_front(hf_llama) -> None:
    engine = make(hf_llama, SMALL_POOL)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with pytest.raises(ValueError, match="maximum context length"):
        engine.validate(list(range(3, 3 + MAX_MODEL_LEN)), greedy)  # no room to generate
    with pytest.raises(ValueError, match="maximum context length"):
        engine.validate([5] * 60, SamplingParams(max_tokens=5))  # 65 tokens > 64
    with pytest.raises(ValueError):
        engine.add_request("x", [5] * 60, SamplingParams(max_tokens=5))
    assert not engine.has_unfinished_requests()  # nothing was queued to be retried forever
    with pytest.raises(ValueError, match="fewer than one sequence"):
        SchedulerConfig(num_kv_blocks=BLOCKS_PER_SEQ - 1, block_size=BLOCK_SIZE,
                        max_model_len=MAX_MODEL_LEN)
