"""Batched sampling with per-row parameters: penalties, logit bias, min_tokens, temperature, top-k/p, min-p.

Order per row (vLLM's): sanitize -> penalties -> logit_bias -> min_tokens mask -> greedy argmax, or
temperature -> top-k -> top-p (on each row's candidates: runner/top_k_top_p.py) -> min-p -> one draw
by inverse CDF (the first token whose cumulative probability passes u, u ~ U[0, 1)). Seeded rows draw u
from their own generator seeded by (seed, num_output_tokens), so a seeded request gets the same tokens
whatever else is in the batch. Logprobs are the *raw* model
distribution (log_softmax of the logits before penalties, bias and temperature), documented in TokenLogprobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from cobatch.kernels.fused_ops import fused_ops
from cobatch.runner.top_k_top_p import candidates, cut_sorted, wants_cut
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import ScheduledRow, TokenLogprobs

_POS_INF_CLAMP = 1e30  # +inf logits become huge but finite, so softmax and temperature stay defined
_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over the 63-bit seed space


@dataclass(slots=True)
class SamplerOutput:
    """Sampled token per row, plus logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples one token per row from fp32 logits [R, V]; one engine-level generator for unseeded rows."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[ScheduledRow],
                 eos_token_ids: Sequence[int] = ()) -> SamplerOutput:
        """logits [R, V] (fp32, or the model dtype: converted to fp32 below) for `rows` (in order) -> one
        token id per row."""
        if all(_is_plain_greedy(row) for row in rows):
            # Fast path (one pass over the logits, in their own dtype: converting is exact, so the argmax
            # is the same): when every row's max is finite there is no NaN or +inf to sanitize and nothing
            # else to apply, so the argmax is what the full path returns.
            best, token_ids = fused_ops().argmax(logits)  # torch.max(dim=-1), native on CPU
            if all(map(math.isfinite, best.tolist())):  # in Python: a cold torch op costs more
                return SamplerOutput(token_ids.tolist(), [None] * len(rows))
        params = [row.sampling_params for row in rows]
        raw = sanitize_logits(logits)  # [R, V]
        processed = apply_penalties(raw, rows)
        processed = apply_logit_bias(processed, params)
        processed = apply_min_tokens(processed, rows, eos_token_ids)
        best, token_ids = processed.max(dim=-1)  # [R]; the argmax is the answer for greedy rows
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            token_ids[random_rows] = self._sample_random(processed[random_rows],
                                                         [rows[i] for i in random_rows])
        token_ids = _fallback_dead_rows(token_ids, best, raw)
        return SamplerOutput(token_ids.tolist(), compute_logprobs(raw, token_ids, params))

    def _sample_random(self, logits: torch.Tensor, rows: Sequence[ScheduledRow]) -> torch.Tensor:
        """Temperature, top-k/p, min-p, then one draw from each row's distribution: [R', V] -> [R']."""
        params = [row.sampling_params for row in rows]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temps.unsqueeze(1)
        vocab = logits.shape[1]
        cut = [i for i, p in enumerate(params) if wants_cut(p, vocab)]
        whole = [i for i, p in enumerate(params) if not wants_cut(p, vocab)]
        token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        if cut:  # on each row's candidates only: [R', C], C << V
            sub, sub_params = logits[cut], [params[i] for i in cut]
            found = candidates(sub, sub_params)
            values = cut_sorted(found, sub_params, vocab)
            picks = self._draw(apply_min_p(values.softmax(dim=-1), sub_params), [rows[i] for i in cut])
            token_ids[cut] = found.token_ids.gather(1, picks.unsqueeze(1)).squeeze(1)
        if whole:
            sub_params = [params[i] for i in whole]
            token_ids[whole] = self._draw(apply_min_p(logits[whole].softmax(dim=-1), sub_params),
                                          [rows[i] for i in whole])
        return token_ids

    def _draw(self, probs: torch.Tensor, rows: Sequence[ScheduledRow]) -> torch.Tensor:
        """One index per row of probs [R', N] by inverse CDF: the first whose cumulative probability
        passes u * total, u ~ U[0, 1). One uniform per row (an exponential race needs N, ~25x the
        time over a 152k vocabulary); a seeded row's u comes from its own generator, so it gets the
        same token whatever else is in the batch. A zero-probability index is never picked (its
        cumulative sum equals its predecessor's)."""
        uniform = torch.empty(len(rows), dtype=torch.float32)
        unseeded = [i for i, row in enumerate(rows) if row.sampling_params.seed is None]
        if unseeded:
            uniform[unseeded] = torch.rand(len(unseeded), generator=self.generator, device=self.device).cpu()
        for i, row in enumerate(rows):  # unavoidable: one generator per seeded row
            if row.sampling_params.seed is not None:
                gen = _row_generator(row.sampling_params.seed, row.num_output_tokens, self.device)
                uniform[i] = float(torch.rand(1, generator=gen, device=self.device))
        cumulative = probs.float().cumsum(dim=-1)  # [R', N]
        target = uniform.to(probs.device).unsqueeze(1) * cumulative[:, -1:]  # [R', 1], below the total
        index = torch.searchsorted(cumulative, target, right=True).squeeze(1)
        return index.clamp_(max=probs.shape[1] - 1)


def _is_plain_greedy(row: ScheduledRow) -> bool:
    """Greedy with nothing that changes the logits (penalties, bias, min_tokens) and no logprobs."""
    p = row.sampling_params
    return (p.is_greedy and not p.has_penalties and not p.logit_bias and p.logprobs is None
            and row.num_output_tokens >= p.min_tokens)


def _row_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """A generator that depends only on the request's seed and how many tokens it has generated."""
    mixed = (seed * _SEED_MIX + step) & ((1 << 63) - 1)
    return torch.Generator(device).manual_seed(mixed)


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf, +inf -> huge finite; a row with nothing finite becomes "token 0" so it cannot crash."""
    out = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=_POS_INF_CLAMP, neginf=float("-inf"))
    dead = ~torch.isfinite(out.max(dim=-1).values)  # [R]
    if dead.any():
        out[dead] = float("-inf")
        out[dead, 0] = 0.0
    return out


def apply_penalties(logits: torch.Tensor, rows: Sequence[ScheduledRow]) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output tokens, frequency/presence over output tokens."""
    idx = [i for i, row in enumerate(rows) if row.sampling_params.has_penalties]
    if not idx:
        return logits
    vocab = logits.shape[1]
    sub = logits[idx]  # [P, V]
    prompt_seen = _token_counts([rows[i].token_ids[:rows[i].num_prompt_tokens] for i in idx], vocab) > 0
    output_counts = _token_counts([rows[i].token_ids[rows[i].num_prompt_tokens:] for i in idx], vocab)
    params = [rows[i].sampling_params for i in idx]
    rep = torch.tensor([p.repetition_penalty for p in params], device=logits.device).unsqueeze(1)
    freq = torch.tensor([p.frequency_penalty for p in params], device=logits.device).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=logits.device).unsqueeze(1)
    output_seen = output_counts > 0
    seen = prompt_seen | output_seen
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * output_counts - pres * output_seen
    out = logits.clone()
    out[idx] = sub
    return out


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """Occurrences of each token id per row: [P, V] fp32 (padding goes to an extra dropped column)."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
    for r, tokens in enumerate(token_lists):
        padded[r, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.int64)
    counts = torch.zeros(len(token_lists), vocab + 1)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Add each row's logit_bias (OpenAI semantics: additive, token ids out of range are ignored)."""
    vocab = logits.shape[1]
    entries = [(r, tok, bias) for r, p in enumerate(params) for tok, bias in p.logit_bias if 0 <= tok < vocab]
    if not entries:
        return logits
    rows, toks, biases = zip(*entries)
    out = logits.clone()
    out.index_put_((torch.tensor(rows), torch.tensor(toks)), torch.tensor(biases, dtype=out.dtype),
                   accumulate=True)
    return out


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[ScheduledRow],
                     eos_token_ids: Sequence[int]) -> torch.Tensor:
    """While a row has fewer than min_tokens outputs, its EOS ids and stop_token_ids cannot be sampled."""
    vocab = logits.shape[1]
    entries = [(r, tok) for r, row in enumerate(rows)
               if row.num_output_tokens < row.sampling_params.min_tokens
               for tok in (*eos_token_ids, *row.sampling_params.stop_token_ids) if 0 <= tok < vocab]
    if not entries:
        return logits
    rows_idx, toks = zip(*entries)
    out = logits.clone()
    out[torch.tensor(rows_idx), torch.tensor(toks)] = float("-inf")
    return out


def apply_min_p(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Zero tokens whose probability is below min_p times the row's top probability: [R, V]."""
    if all(p.min_p <= 0.0 for p in params):
        return probs
    min_p = torch.tensor([p.min_p for p in params], device=probs.device).unsqueeze(1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p  # [R, 1]
    return probs.masked_fill(probs < threshold, 0.0)


def _fallback_dead_rows(token_ids: torch.Tensor, best: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Rows the masks emptied (best logit -inf, e.g. min_tokens masked every token) take the raw argmax."""
    dead = ~torch.isfinite(best)  # [R]
    if dead.any():
        token_ids = torch.where(dead, raw.argmax(dim=-1), token_ids)
    return token_ids


def compute_logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                     params: Sequence[SamplingParams]) -> list[TokenLogprobs | None]:
    """Raw-model logprob, rank and top alternatives of each sampled token, for rows that asked."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    idx = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not idx:
        return out
    entries = logprob_entries(raw[idx].log_softmax(dim=-1), token_ids[idx],
                              [params[i].logprobs or 0 for i in idx])
    for i, entry in zip(idx, entries):
        out[i] = entry
    return out


def logprob_entries(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_top: Sequence[int]) -> list[TokenLogprobs]:
    """logprobs [L, V] (log_softmax'd), token_ids [L]: each token's logprob, rank and its row's top
    num_top alternatives (the sampler's, and the prompt's: runner/prompt_logprobs.py)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [L, 1]
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    max_k = max(num_top, default=0)
    top_vals: list[list[float]] = [[] for _ in num_top]
    top_ids: list[list[int]] = [[] for _ in num_top]
    if max_k:
        values, indices = logprobs.topk(max_k, dim=-1)  # [L, max_k], most likely first
        top_vals, top_ids = values.tolist(), indices.tolist()
    chosen_list, chosen_ids = chosen.squeeze(1).tolist(), token_ids.tolist()
    return [TokenLogprobs(chosen_ids[j], chosen_list[j], ranks[j], tuple(zip(top_ids[j][:k], top_vals[j][:k])))
            for j, k in enumerate(num_top)]
