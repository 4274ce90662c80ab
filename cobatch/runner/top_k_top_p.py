"""Top-k / top-p over a large vocabulary without sorting it: each row's candidates first, then the cut.

What a row's top-k / top-p can keep lies in its top C logits: C = its top_k, or for top-p alone the few
tokens of its nucleus (tens to hundreds for a trained model). A partial sort (torch.topk) of those is
~10-30x cheaper than sorting 128k-152k logits (docs/BENCHMARKS.md, Other shapes), so `candidates`
takes the top C of every row (C = the largest top_k, at least PROBE_TOKENS for top-p alone) and
checks that nothing it left out could be kept: no tie with a row's k-th value past C, and each
top-p-alone row's C tokens carrying at least its top_p of the probability. Otherwise it sorts all.

Semantics (vLLM's, and this module's before candidates): top-k keeps the k largest (ties at the k-th
value kept), then top-p keeps the smallest prefix, most likely first, whose mass before each kept token
is under top_p (renormalized after top-k; the most likely token always stays).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from cobatch.sampling_params import SamplingParams

PROBE_TOKENS = 1024  # candidates of a row with top-p alone: a nucleus wider than this sorts the vocabulary


def wants_cut(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p drops anything from this row."""
    return 0 < params.top_k < vocab or params.top_p < 1.0


def _row_k(params: SamplingParams, vocab: int) -> int:
    return min(params.top_k, vocab) if params.top_k > 0 else vocab


class Candidates(NamedTuple):
    """Each row's top-k / top-p survivors and more, most likely first."""

    values: torch.Tensor  # [R, C]
    token_ids: torch.Tensor  # [R, C]
    # [R]: each whole row's logsumexp, the top-p normalizer of rows with top-p and no top-k; None when
    # there is no such row, or when C = V (the candidates are the whole row)
    row_logsumexp: torch.Tensor | None


def candidates(logits: torch.Tensor, params: Sequence[SamplingParams]) -> Candidates:
    """The candidates of each row: C < V where the partial sort covers every row's kept set; else the
    whole row, sorted."""
    vocab = logits.shape[1]
    ks = [_row_k(p, vocab) for p in params]
    width = max(k if k < vocab else PROBE_TOKENS for k in ks)
    if width < vocab:
        values, ids = logits.topk(min(width + 1, vocab), dim=-1)  # one more: a tie past C shows there
        if not _tie_past(values, ks, vocab):
            values, ids = values[:, :width], ids[:, :width]
            nucleus_rows = torch.tensor([k == vocab and p.top_p < 1.0 for k, p in zip(ks, params)])
            if not bool(nucleus_rows.any()):
                return Candidates(values, ids, None)
            row_logsumexp = logits.logsumexp(-1)  # [R]
            if _nucleus_within(values, row_logsumexp, params, nucleus_rows):
                return Candidates(values, ids, row_logsumexp)
    values, ids = logits.sort(dim=-1, descending=True)
    return Candidates(values, ids, None)


def _tie_past(values: torch.Tensor, ks: list[int], vocab: int) -> bool:
    """Whether a top-k row's k-th value is tied with the last of values [R, C + 1], so past the
    candidates (ties at -inf weigh nothing)."""
    width = values.shape[1] - 1
    has_k = torch.tensor([k < vocab for k in ks])
    kth = values.gather(1, torch.tensor([min(k, width) - 1 for k in ks])[:, None]).squeeze(1)  # [R]
    return bool((has_k & (values[:, -1] >= kth) & kth.isfinite()).any())


def _nucleus_within(values: torch.Tensor, row_logsumexp: torch.Tensor, params: Sequence[SamplingParams],
                    nucleus_rows: torch.Tensor) -> bool:
    """Whether each top-p-alone row's candidates [R, C] carry at least its top_p of the probability."""
    top_p = torch.tensor([p.top_p for p in params])
    mass = (values.logsumexp(-1) - row_logsumexp).exp()  # [R]: the candidates' share of the row
    return bool((mass[nucleus_rows] >= top_p[nucleus_rows]).all())


def cut_sorted(found: Candidates, params: Sequence[SamplingParams], vocab: int) -> torch.Tensor:
    """Top-k, then top-p, on the candidates: their values [R, C], the dropped ones -inf."""
    values, width = found.values, found.values.shape[1]
    ks = [_row_k(p, vocab) for p in params]
    kth = values.gather(1, torch.tensor([min(k, width) - 1 for k in ks])[:, None])  # [R, 1]
    values = values.masked_fill(values < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=values.dtype)
    if bool((top_p >= 1.0).all()):
        return values
    norm = values.logsumexp(-1)  # [R]: top-p after top-k renormalizes; without top-k, over the whole row
    if found.row_logsumexp is not None:
        norm = torch.where(torch.tensor([k < vocab for k in ks]), norm, found.row_logsumexp)
    probs = (values - norm[:, None]).exp()  # [R, C]
    mass_before = probs.cumsum(-1) - probs  # [R, C]: the probability of the more likely tokens
    drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop[:, 0] = False  # the most likely token always survives
    return values.masked_fill(drop, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Keep each row's top_k logits (ties at the threshold kept), then its top_p nucleus: [R, V], the
    dropped logits -inf (rows with neither filter untouched)."""
    vocab = logits.shape[1]
    rows = [i for i, p in enumerate(params) if wants_cut(p, vocab)]
    if not rows:
        return logits
    sub, sub_params = logits[rows], [params[i] for i in rows]
    found = candidates(sub, sub_params)
    out = logits.clone()
    out[rows] = torch.full_like(sub, float("-inf")).scatter_(1, found.token_ids, cut_sorted(found, sub_params, vocab))
    return out
