"""The data contract between scheduler and runner: what to compute this step, and what came back.

Pure dataclasses (no torch), so the scheduling core and the runner both import them and nothing else
of each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cobatch.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledRow:
    """One row of the step's ragged batch: `num_new_tokens` tokens of one request.

    A decode row has one new token; a prefill (or prefill chunk, or recompute) row has many.

        token_ids:  [ computed (KV cached) | new this step | not yet (next chunks) ]
                    0                      ^ num_computed_tokens
                                                           ^ num_computed_tokens + num_new_tokens

    A speculative decode row (spec_decode.py) feeds its last token and then its drafts, which are not
    in token_ids yet; it samples at each of those positions, and the scheduler keeps what verifies:

        token_ids + spec_token_ids:  [ computed | last token, draft 1 .. draft k ]
                                                ^ num_computed_tokens (= len(token_ids) - 1)
                                                  num_new_tokens = 1 + k, num_samples = 1 + k
    """

    request_id: str
    # All tokens of the request so far (prompt + output). Shared with the request, read-only:
    # passing the list by reference keeps building a step O(rows), not O(tokens).
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    num_new_tokens: int
    block_table: list[int]  # physical KV block ids; covers num_computed_tokens + num_new_tokens
    sampling_params: SamplingParams
    # True when this row reaches the end of the known tokens, so the runner samples one token.
    # False for a non-final prefill chunk and for static-batching padding rows.
    needs_sample: bool
    # A finished request whose row is kept only as padding (static batching): computed, output dropped.
    is_padding: bool = False
    spec_token_ids: tuple[int, ...] = ()  # draft tokens fed after the known ones (speculative decoding)
    # Prompt logprobs (sampling_params.prompt_logprobs): the first prompt position whose logits are
    # still wanted (positions before it were scored in earlier steps); None: the row wants none.
    prompt_logprobs_from: int | None = None

    @property
    def num_samples(self) -> int:
        """Tokens the runner samples for this row: one per fed position from the last known token on."""
        return 1 + len(self.spec_token_ids) if self.needs_sample else 0

    @property
    def prompt_logprob_positions(self) -> range:
        """The positions fed this step whose logits score the next prompt token (p scores token p + 1)."""
        if self.prompt_logprobs_from is None:
            return range(0)
        start = max(self.num_computed_tokens, self.prompt_logprobs_from)
        end = min(self.num_computed_tokens + self.num_new_tokens, self.num_prompt_tokens - 1)
        return range(start, max(start, end))

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far: the step index of a seeded sampler."""
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the runner does in one step: block copies first (swaps, then device copies), then one
    forward over `rows`."""

    rows: tuple[ScheduledRow, ...]
    # (device block, host block) pairs, copied before this step's forward (their device blocks may be
    # reused by rows of this very step).
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    # (host block, device block) pairs, copied in before this step's forward.
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    # (device block, device block) pairs, copied after the swaps, before the forward: a prompt found whole in
    # the prefix cache takes its own copy of the cached block that holds its last token, and computes
    # only that token (its logits), where sharing the blocks before it would recompute the whole block.
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(row.num_new_tokens for row in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows and not self.blocks_to_swap_out and not self.blocks_to_swap_in and not self.blocks_to_copy


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probability of a sampled token and the top alternatives at its position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What one step produced: `num_samples` entries per row (rows with needs_sample), in row order."""

    sampled_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...]  # None where the request did not ask for logprobs
    # The step's swap copies (blocks_to_swap_out + blocks_to_swap_in) and the seconds they took:
    # the measured copy time that preemption_mode auto weighs against recomputing.
    num_copied_blocks: int = 0
    copy_s: float = 0.0
    # Rows with prompt_logprob_positions: request id -> one entry per such position, in order (the
    # prompt token that follows it, its logprob, rank and the top alternatives).
    prompt_logprobs: Mapping[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)
