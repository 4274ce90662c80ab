"""Top-k / top-p on candidates (runner/top_k_top_p.py) keeps what a full sort of the vocabulary keeps:
ties at the k-th value, nuclei wider than the probe, masked (-inf) rows and rows with no filter."""

from __future__ import annotations

import pytest
import torch

from cobatch.runner.sampler import Sampler
from cobatch.runner.top_k_top_p import PROBE_TOKENS, apply_top_k_top_p, candidates
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import ScheduledRow

VOCAB = 151936  # Qwen2.5's


def full_sort_reference(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The definition, on a full ascending sort of every row."""
    vocab = logits.shape[1]
    k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    sorted_logits, sorted_idx = logits.sort(dim=-1)
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cut = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1.0 - top_p).unsqueeze(1)
    cut[:, -1] = False
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits.masked_fill(cut, float("-inf")))


PARAMS = [SamplingParams(top_k=40), SamplingParams(top_p=0.9), SamplingParams(top_k=50, top_p=0.8),
          SamplingParams(), SamplingParams(top_k=1), SamplingParams(top_p=0.3, top_k=2000)]


def _peaked(rows: int, seed: int) -> torch.Tensor:
    """A trained model's kind of row: a few hundred plausible tokens over a long flat tail."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen)
    logits[:, :300] += 15.0 * torch.rand(rows, 300, generator=gen)
    return logits


@pytest.mark.parametrize("seed", range(3))
def test_same_tokens_kept_as_a_full_sort(seed: int) -> None:
    logits = _peaked(len(PARAMS), seed)
    assert candidates(logits[:3], PARAMS[:3]).values.shape[1] == PROBE_TOKENS  # the partial sort served these rows
    out = apply_top_k_top_p(logits, PARAMS)
    ref = full_sort_reference(logits, PARAMS)
    assert torch.equal(out.isinf(), ref.isinf())
    assert torch.equal(out[~out.isinf()], logits[~ref.isinf()])
    assert torch.equal(out[3], logits[3])  # no filter: untouched


def test_ties_at_the_kth_value_past_the_candidates_are_kept() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, :10] = 5.0
    params = [SamplingParams(top_k=20)]  # the 11th..20th largest tie with 140k others
    out = apply_top_k_top_p(logits, params)
    assert torch.equal(out, full_sort_reference(logits, params)) and not out.isinf().any()


def test_a_nucleus_wider_than_the_probe_sorts_the_vocabulary() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)) * 0.1  # nearly flat
    params = [SamplingParams(top_p=0.5), SamplingParams(top_k=10)]
    assert candidates(logits, params).values.shape[1] == VOCAB
    out = apply_top_k_top_p(logits, params)
    assert torch.equal(out.isinf(), full_sort_reference(logits, params).isinf())
    assert int((~out[0].isinf()).sum()) > PROBE_TOKENS


def test_masked_rows_keep_their_few_allowed_tokens() -> None:
    logits = torch.full((2, VOCAB), float("-inf"))
    logits[:, [7, 70, 700]] = torch.tensor([1.0, 3.0, 2.0])  # a grammar allows three tokens
    params = [SamplingParams(top_k=50), SamplingParams(top_k=2, top_p=0.9)]
    assert candidates(logits, params).values.shape[1] < VOCAB  # ties at -inf weigh nothing: no full sort
    out = apply_top_k_top_p(logits, params)
    assert torch.equal(out.isinf(), full_sort_reference(logits, params).isinf())
    assert (~out[0].isinf()).nonzero().flatten().tolist() == [7, 70, 700]


def test_sampler_draws_the_kept_tokens_at_their_renormalized_odds() -> None:
    """Through the Sampler: top-k on candidates, then one inverse-CDF draw per row, seeded or not."""
    rows = 3000
    logits = torch.full((rows, 2048), -30.0)
    logits[:, :4] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    params = [SamplingParams(temperature=1.0, top_k=3, seed=None if i % 2 else i) for i in range(rows)]
    scheduled = [ScheduledRow(str(i), [0], 1, 0, 1, [0], p, True) for i, p in enumerate(params)]
    tokens = torch.tensor(Sampler(5)(logits, scheduled).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / rows
    assert freq.tolist() == pytest.approx([4 / 9, 3 / 9, 2 / 9, 0.0], abs=0.03)
