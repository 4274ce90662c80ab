"""N-gram speculative decoding (prompt lookup): draft tokens from the sequence's own history, verified by
the model in the next step.

Why: a decode step reads every weight and the whole KV cache of its rows once, whatever the number of
query tokens per row, so a row that feeds its last token plus k drafts gets k + 1 logits for little
more than the price of one when the batch is small (bandwidth-bound) and saves the KV reads and the
per-step costs when it is large. Drafts come from the latest earlier occurrence of the sequence's last
n tokens (n from `max_n` down to `min_n`): the k tokens that followed it. Text that repeats its prompt
or itself (code edits, extraction, summaries, and the loops small models fall into) gets them accepted.

Exact: a greedy row keeps the drafts that equal the model's own argmax at each position, up to the first
mismatch, plus the model's token there (the "bonus" token), which is what k + 1 plain decode steps
would have produced. In bf16 the native kernels give a row's logits the same bits whatever the tokens
beside it (the determinism tests check this); fp32 is checked against HF. Only greedy rows without
penalties (which depend on the tokens before a position) draft; logit bias and logprobs are per
position, so a verified run has the logprobs plain decoding would give.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram of a token sequence last ended, for n in [min_n, max_n] (built incrementally).

    ends[(t_{i-n+1}, ..., t_i)] = i + 1 for every i < len - 1: the last token is left out, so a lookup of
    the sequence's own tail finds an earlier occurrence, never itself.
    """

    min_n: int
    max_n: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0  # tokens [0, num_indexed) have had the n-grams ending at them added
    num_drafted: int = 0  # this sequence's drafts so far, and how many the model agreed with
    num_accepted: int = 0

    @property
    def acceptance(self) -> float:
        """Share of this sequence's drafts that verified, with an optimistic prior (2 of 2): a new
        sequence drafts until its own record says otherwise."""
        return (self.num_accepted + 2) / (self.num_drafted + 2)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verification of this sequence's drafts (its acceptance decides whether it drafts in large
        batches: min_acceptance)."""
        self.num_drafted += num_drafts
        self.num_accepted += num_accepted

    def extend(self, token_ids: list[int]) -> None:
        """Add the n-grams ending at tokens num_indexed .. len - 2."""
        for i in range(self.num_indexed, len(token_ids) - 1):
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                self.ends[tuple(token_ids[i - n + 1:i + 1])] = i + 1
        self.num_indexed = max(self.num_indexed, len(token_ids) - 1)

    def continuation(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the latest earlier occurrence of the longest matching
        tail (longest n first: a longer match predicts better)."""
        self.extend(token_ids)
        for n in range(min(self.max_n, len(token_ids)), self.min_n - 1, -1):
            end = self.ends.get(tuple(token_ids[-n:]))
            if end is not None:
                return token_ids[end:end + max_tokens]
        return []


def min_acceptance(batch_size: int) -> float:
    """The acceptance a sequence needs to keep drafting in a batch of this size.

    A rejected draft is a row computed in vain; an accepted one saves its row a later step and shares
    this step's K/V reads and fixed costs. Small batches stream the weights (bandwidth-bound), so an extra
    row is nearly free and any acceptance pays; from ~32 rows a step is compute-bound and a draft pays only
    when right ~3 times in 4 (docs/BENCHMARKS.md, speculative decoding, has the measurements).
    """
    return min(0.75, max(0.0, (batch_size - 2) / 40))


class NgramProposer:
    """Drafts up to num_speculative_tokens tokens per sequence from its n-gram index."""

    def __init__(self, num_speculative_tokens: int, min_n: int = 2, max_n: int = 4) -> None:
        if num_speculative_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"need num_speculative_tokens >= 1 and 1 <= min_n <= max_n, got "
                             f"{num_speculative_tokens}, {min_n}, {max_n}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, index: NgramIndex, token_ids: list[int], max_tokens: int) -> tuple[int, ...]:
        """Drafts to follow token_ids (at most max_tokens, which the caller bounds by budget and limits)."""
        limit = min(self.num_speculative_tokens, max_tokens)
        return tuple(index.continuation(token_ids, limit)) if limit > 0 else ()


def accepted_tokens(drafts: tuple[int, ...], sampled: list[int]) -> list[int]:
    """The tokens a verified row appends: the drafts the model agreed with, then its own next token.

    sampled[i] is the model's token after the row's last known token and drafts[:i]; len(sampled) ==
    len(drafts) + 1.
    """
    num_accepted = 0
    while num_accepted < len(drafts) and drafts[num_accepted] == sampled[num_accepted]:
        num_accepted += 1
    return sampled[:num_accepted + 1]
