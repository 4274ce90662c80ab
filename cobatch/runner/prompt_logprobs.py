"""Prompt logprobs from the prefill's own hidden states (vLLM's prompt_logprobs): no second pass.

The forward keeps, beside the sampled rows, the final hidden state of every position a row lists in
`prompt_logprob_positions`; position p's logits score prompt token p + 1. lm_head and log_softmax run
on a bounded number of positions at a time, so a long prompt never holds [T, V] logits at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cobatch.runner.sampler import logprob_entries, sanitize_logits
from cobatch.scheduler_output import ScheduledRow, TokenLogprobs

_CHUNK_POSITIONS = 256  # [256, V] fp32 logits at a time: 48 MiB at SmolLM2's vocabulary


def num_prompt_logprob_positions(rows: Sequence[ScheduledRow]) -> int:
    """How many positions of this step score prompt tokens."""
    return sum(len(row.prompt_logprob_positions) for row in rows)


def prompt_logprobs(hidden: torch.Tensor, rows: Sequence[ScheduledRow],
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, tuple[TokenLogprobs, ...]]:
    """hidden [Q, H]: the final hidden states of the rows' prompt_logprob_positions, in row order ->
    request id -> one entry per position (the next prompt token, its logprob, rank, top alternatives)."""
    targets: list[int] = []  # [Q]: the prompt token each position scores
    num_top: list[int] = []
    owners: list[str] = []
    for row in rows:
        positions = row.prompt_logprob_positions
        targets.extend(row.token_ids[p + 1] for p in positions)
        num_top.extend([row.sampling_params.prompt_logprobs or 0] * len(positions))
        owners.extend([row.request_id] * len(positions))
    assert len(targets) == hidden.shape[0], "one hidden state per prompt logprob position"
    entries: list[TokenLogprobs] = []
    for start in range(0, len(targets), _CHUNK_POSITIONS):
        end = start + _CHUNK_POSITIONS
        logprobs = sanitize_logits(compute_logits(hidden[start:end])).log_softmax(dim=-1)  # [c, V]
        entries += logprob_entries(logprobs, torch.tensor(targets[start:end], device=logprobs.device),
                                   num_top[start:end])
    by_request: dict[str, list[TokenLogprobs]] = {}
    for owner, entry in zip(owners, entries):
        by_request.setdefault(owner, []).append(entry)
    return {request_id: tuple(found) for request_id, found in by_request.items()}
