"""Token-exact migration: a client request's sequences continued on another replica from what it has.

A *leg* is one engine request serving some of a client request's n sequences; the first leg serves
all of them under the client's own request id. When a leg's replica dies, each of its unfinished
sequences continues as a leg of its own (n=1) elsewhere: prompt + the tokens already delivered to the
client, max_tokens and min_tokens less those, the deadline less the time spent -- recompute
preemption across replicas. Only delivered tokens are resubmitted and a leg's deltas are renumbered
to the client's sequence, so nothing is sent twice or skipped, and greedy output is unchanged.
(A seeded sample restarts its random stream at the cut; penalties see the delivered tokens as prompt.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cobatch.outputs import RequestDelta
from cobatch.ray.wire import GenerateCall
from cobatch.sampling_params import SamplingParams

DEADLINE = "deadline"  # the engine's finish_reason for a request past its deadline


@dataclass(frozen=True, slots=True)
class Leg:
    """One engine request of a client request; `indices[i]` is the client sequence of its i-th."""

    call: GenerateCall
    indices: tuple[int, ...]
    is_first: bool = False


def seq_id(request_id: str, index: int, n: int) -> str:
    """A client sequence's id, as one engine names it (`id` for n=1, `id#index` otherwise)."""
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass(slots=True)
class RequestProgress:
    """What the client of one request has been sent, per sequence: the basis of a continuation."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int
    arrival_s: float  # time.monotonic() at submit: deadlines count from here
    delivered: list[list[int]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    num_migrations: int = 0

    def __post_init__(self) -> None:
        self.delivered = [[] for _ in range(self.params.n)]
        self.finished = [False] * self.params.n

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def is_finished(self) -> bool:
        return all(self.finished)

    def first_leg(self, now_s: float) -> Leg:
        call = GenerateCall(self.request_id, self.prompt_token_ids,
                            self._with_deadline(self.params, now_s), self.priority)
        return Leg(call, tuple(range(self.n)), is_first=True)

    def remaining_deadline_ms(self, now_s: float) -> float | None:
        """Milliseconds left of the client's deadline (None: no deadline; <= 0: passed)."""
        if self.params.deadline_ms is None:
            return None
        return self.params.deadline_ms - (now_s - self.arrival_s) * 1e3

    def _with_deadline(self, params: SamplingParams, now_s: float) -> SamplingParams:
        left_ms = self.remaining_deadline_ms(now_s)
        if left_ms is None or left_ms == params.deadline_ms:
            return params
        return dataclasses.replace(params, deadline_ms=max(left_ms, 1e-3))

    # ---- deltas from a leg -> the client's -------------------------------------------------------

    def to_client(self, leg: Leg, delta: RequestDelta) -> RequestDelta | None:
        """The delta as the client's sequence sees it; None for a sequence already finished here."""
        index = leg.indices[delta.index]
        if self.finished[index]:
            return None  # stopped by the server (a stop string) before the engine heard of it
        self.delivered[index].extend(delta.new_token_ids)
        self.finished[index] = delta.finished
        if leg.is_first:
            return delta
        return dataclasses.replace(
            delta, request_id=seq_id(self.request_id, index, self.n), parent_id=self.request_id,
            index=index, num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=len(self.delivered[index]))

    def finish_locally(self, index: int, finish_reason: str,
                       stop_reason: int | str | None = None) -> RequestDelta:
        """A finishing delta made here (a stop string the server found, a deadline passed)."""
        self.finished[index] = True
        return RequestDelta(
            request_id=seq_id(self.request_id, index, self.n), parent_id=self.request_id,
            index=index, new_token_ids=(), new_logprobs=(),
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=len(self.delivered[index]), finish_reason=finish_reason,
            stop_reason=stop_reason)

    # ---- continuing elsewhere --------------------------------------------------------------------

    def unfinished(self, leg: Leg) -> list[int]:
        return [i for i in leg.indices if not self.finished[i]]

    def continuation(self, index: int, now_s: float) -> Leg | RequestDelta:
        """The leg that continues sequence `index` from its delivered tokens, or its finishing delta
        when nothing is left to run (the deadline passed, or max_tokens are all delivered)."""
        left_ms = self.remaining_deadline_ms(now_s)
        if left_ms is not None and left_ms <= 0:
            return self.finish_locally(index, DEADLINE)
        done = self.delivered[index]
        params = self.params.for_sample(index)
        if params.max_tokens is not None and params.max_tokens <= len(done):
            return self.finish_locally(index, "length")
        params = dataclasses.replace(
            params, max_tokens=None if params.max_tokens is None else params.max_tokens - len(done),
            min_tokens=max(params.min_tokens - len(done), 0),
            # came with the first delivered token; until then the continuation's prompt is the prompt
            prompt_logprobs=None if done else params.prompt_logprobs)
        call = GenerateCall(f"{seq_id(self.request_id, index, self.n)}~{self.num_migrations}",
                            self.prompt_token_ids + tuple(done),
                            self._with_deadline(params, now_s), self.priority)
        return Leg(call, (index,))
