"""Sampler on hand-made logits: each processor, seeded reproducibility, NaN isolation, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from cobatch.runner.sampler import Sampler, apply_min_p
from cobatch.runner.top_k_top_p import apply_top_k_top_p
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import ScheduledRow

NEG_INF = float("-inf")
GREEDY = SamplingParams(temperature=0.0)


def row(params: SamplingParams = GREEDY, prompt: tuple[int, ...] = (0,), output: tuple[int, ...] = (),
        request_id: str = "r") -> ScheduledRow:
    tokens = [*prompt, *output]
    return ScheduledRow(request_id, tokens, len(prompt), len(tokens) - 1, 1, [0], params, True)


def sample(logits: list[list[float]] | torch.Tensor, rows: list[ScheduledRow], eos: tuple[int, ...] = (),
           seed: int = 0) -> list[int]:
    return Sampler(seed)(torch.as_tensor(logits, dtype=torch.float32), rows, eos).token_ids


def test_greedy_is_argmax() -> None:
    assert sample([[0.1, 3.0, 2.0], [5.0, -1.0, 4.9]], [row(), row()]) == [1, 0]


def test_top_k_keeps_k_largest() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    out = apply_top_k_top_p(logits, [SamplingParams(top_k=2), SamplingParams()])
    assert torch.equal(torch.isinf(out[0]), torch.tensor([True, False, False, True]))
    assert torch.equal(out[1], logits[1])


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = apply_top_k_top_p(logits, [SamplingParams(top_p=0.75)])
    assert torch.equal(torch.isinf(out[0]), torch.tensor([False, False, True, True]))
    assert torch.allclose(out[0, :2], logits[0, :2])


def test_min_p_drops_unlikely_tokens() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs, [SamplingParams(min_p=0.2)])
    assert out[0].tolist() == pytest.approx([0.5, 0.3, 0.15, 0.0])


def test_filters_restrict_what_random_sampling_can_pick() -> None:
    logits = torch.zeros(400, 8)
    logits[:, 3], logits[:, 5] = 2.0, 1.9
    rows = [row(SamplingParams(top_k=2, temperature=1.5), request_id=str(i)) for i in range(400)]
    picked = set(sample(logits, rows))
    assert picked == {3, 5}


def test_random_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.7, 0.2, 0.1]]).log().repeat(4000, 1)
    tokens = torch.tensor(sample(logits, [row(SamplingParams(temperature=1.0))] * 4000, seed=1))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert freq.tolist() == pytest.approx([0.7, 0.2, 0.1], abs=0.03)


def test_repetition_penalty_over_prompt_and_output() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # Token 0 (seen in the prompt) 3.0 -> 1.5 loses to token 2 (2.0, unseen).
    assert sample([[3.0, 0.0, 2.0]], [row(params, prompt=(0,))]) == [2]
    # Token 1 (seen in the output) -1.0 -> -2.0 loses to token 2 (-1.5, unseen).
    assert sample([[-5.0, -1.0, -1.5]], [row(params, prompt=(0,), output=(1,))]) == [2]


def test_frequency_and_presence_penalties_count_output_only() -> None:
    freq = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    # Token 0 generated 3 times: 5.0 - 3 = 2.0 < 2.5; the prompt's token 1 is not penalized.
    assert sample([[5.0, 2.5, 0.0]], [row(freq, prompt=(1, 1), output=(0, 0, 0))]) == [1]
    pres = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert sample([[5.0, 3.5, 0.0]], [row(pres, output=(0, 0, 0))]) == [1]  # 5 - 2 = 3 < 3.5


def test_logit_bias_and_penalty_rows_leave_other_rows_alone() -> None:
    biased = SamplingParams(temperature=0.0, logit_bias={2: 100.0})
    penalized = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    logits = [[1.0, 5.0, 0.0]] * 3
    rows = [row(biased), row(), row(penalized, output=(1, 1))]
    assert sample(logits, rows) == [2, 1, 0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    logits = [[0.0, 1.0, 9.0, 8.0]]
    assert sample(logits, [row(params, output=(1,))], eos=(2,)) == [1]  # 1 output < 2: 2 and 3 masked
    assert sample(logits, [row(params, output=(1, 1))], eos=(2,)) == [2]  # reached: EOS allowed


def test_seeded_row_same_alone_and_in_any_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    seeded = SamplingParams(seed=1234, temperature=1.0)
    alone = sample(logits[:1], [row(seeded, output=(5, 6))], seed=0)
    others = [row(SamplingParams(temperature=0.8, top_p=0.9)), row(GREEDY), row(SamplingParams(seed=7))]
    batched = sample(logits[[1, 2, 0, 3]], [others[0], others[1], row(seeded, output=(5, 6)), others[2]],
                     seed=99)
    assert batched[2] == alone[0]
    # The step index matters: the next token of the same request uses a different draw.
    draws = {sample(logits[:1], [row(seeded, output=tuple(range(n)))])[0] for n in range(20)}
    assert len(draws) > 1


def test_nan_and_inf_rows_do_not_crash_or_leak() -> None:
    logits = torch.tensor([[math.nan] * 4, [1.0, math.nan, 3.0, 2.0], [0.0, 0.0, 1.0, 0.0],
                           [NEG_INF] * 4, [0.0, math.inf, 1.0, 0.0]])
    rows = [row(SamplingParams(temperature=1.0)), row(), row(), row(SamplingParams(top_p=0.5)),
            row(SamplingParams(temperature=0.7))]
    assert sample(logits, rows) == [0, 2, 2, 0, 1]


def test_rows_emptied_by_masks_fall_back_to_the_raw_argmax() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=(0, 1))
    assert sample([[1.0, 2.0]], [row(params)]) == [1]


def test_logprobs_rank_and_top() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0]])
    rows = [row(SamplingParams(temperature=0.0, logprobs=2, logit_bias={2: 10.0})), row()]
    out = Sampler(0)(logits, rows)
    assert out.token_ids == [2, 1] and out.logprobs[1] is None
    lp = out.logprobs[0]
    expected = logits[0].log_softmax(-1)  # raw model distribution: the bias does not show here
    assert lp.token_id == 2 and lp.rank == 2 and lp.logprob == pytest.approx(expected[2].item())
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([expected[1].item(), expected[2].item()])
    zero = Sampler(0)(logits[:1], [row(SamplingParams(temperature=0.0, logprobs=0))]).logprobs[0]
    assert zero.top == () and zero.rank == 1


def test_greedy_fast_path_matches_the_full_path() -> None:
    """All-greedy batches take a one-pass argmax; it must agree with the full pipeline, -inf and NaN included."""
    from cobatch.runner import sampler as sampler_module

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    logits[1, :45] = float("-inf")
    logits[3, 7] = float("nan")  # a NaN row: the fast path must step aside (NaN -> -inf in the full path)
    logits[4, 9] = float("inf")
    rows = [row(SamplingParams(temperature=0.0)) for _ in range(5)]
    fast = Sampler()(logits, rows).token_ids
    full_rows = [row(SamplingParams(temperature=0.0, logprobs=0)) for _ in range(5)]  # forces the full path
    assert not any(sampler_module._is_plain_greedy(r) for r in full_rows)
    assert fast == Sampler()(logits, full_rows).token_ids
    assert fast[4] == 9 and fast[3] == int(torch.nan_to_num(logits[3], nan=float("-inf")).argmax())


def test_model_dtype_logits_sample_like_their_fp32_values() -> None:
    """The runner hands over bf16 logits from a bf16 model: greedy (fast and full path), logprobs and
    seeded sampling give what the same values in fp32 give (the conversion is exact)."""
    logits = (3 * torch.randn(4, 300, generator=torch.Generator().manual_seed(5))).bfloat16()
    logits[0, 17] = logits[0].max()  # a tie: both dtypes take the first index
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=1)):
        rows = [row(params) for _ in range(4)]
        got, want = Sampler()(logits, rows), Sampler()(logits.float(), rows)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
