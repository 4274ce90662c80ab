"""TPOT-SLO accounting for one scheduling step: which admissions and how many prefill tokens fit.

A decode row gets one token per step, so a request's TPOT is the mean duration of the steps it lives
through, and the predicted step time *is* the predicted TPOT. Two different questions follow:

- May a waiting request take a seat? Only if the batch with it, all *decoding* (one token each), is
  predicted to stay under the SLO: that is the TPOT everybody will see once its prefill is done.
- How many prefill tokens may this step carry? Prefill chunks make the step they ride in longer for
  every decode row in it, so they get only the slack left under the SLO (chunked prefill). A step with
  no decode row hurts nobody's TPOT: its prefill is not limited.

The step-time predictor returns 0.0 until it has seen enough steps; meanwhile admissions "slow start"
(one per step), so the model sees a range of batch sizes instead of one huge first batch.
"""

from __future__ import annotations

from collections.abc import Iterable

from cobatch.cost_model import StepTimePredictor
from cobatch.request import Request

# Fill steps only to this share of the SLO: a request's TPOT averages the steps it lives through, so a
# batch filled exactly to the SLO would miss it about half the time (prediction error, machine noise).
SLO_HEADROOM = 0.95


class SloStepBudget:
    """One step's predicted shape under a TPOT SLO, grown by each prefill chunk and admission."""

    def __init__(self, predictor: StepTimePredictor, tpot_slo_ms: float,
                 running: Iterable[Request]) -> None:
        self.predictor = predictor
        self.target_s = tpot_slo_ms * SLO_HEADROOM / 1000.0
        self.num_admitted = 0
        # (rows, tokens, context) of this step if every running request gets its row ...
        self.step_rows = self.step_tokens = self.step_context = 0
        # ... and of a step where every running request decodes (the steady state admissions face).
        self.decode_context = 0
        self.num_decode_rows = 0
        for request in running:
            self.step_rows += 1
            self.decode_context += request.num_tokens
            if request.is_padding or request.num_tokens - request.num_computed_tokens <= 1:
                self.num_decode_rows += 1
                self.step_tokens += 1
                self.step_context += min(request.num_computed_tokens + 1, request.num_tokens)
            else:
                self.step_context += request.num_computed_tokens

    def _fits(self, rows: int, tokens: int, context: int) -> bool:
        return self.predictor(rows, tokens, context) <= self.target_s

    def _largest_chunk(self, extra_rows: int, base_context: int, want: int) -> int:
        """Largest n <= want with the step (plus `extra_rows`, plus n tokens) under the SLO."""
        if self.num_decode_rows == 0:
            return want  # no decode row in this step: nobody's TPOT to protect
        low, high = 0, want
        while low < high:  # the predictor is non-decreasing in tokens and context
            mid = (low + high + 1) // 2
            if self._fits(self.step_rows + extra_rows, self.step_tokens + mid,
                          self.step_context + base_context + mid):
                low = mid
            else:
                high = mid - 1
        return low

    def running_chunk(self, want: int) -> int:
        """Prefill tokens a running (already seated) request may compute this step."""
        if want <= 1:
            return want  # a decode row: already counted, never held back
        chunk = self._largest_chunk(0, 0, want)
        self.step_tokens += chunk
        self.step_context += chunk
        return chunk

    def admission_chunk(self, request: Request, num_cached: int, want: int,
                        allow_partial: bool) -> int:
        """Tokens to admit `request` with this step; 0 means it must wait (the SLO would break)."""
        if self.step_rows == 0:  # an empty engine always runs its first request, or nothing progresses
            return self._admit(request, num_cached, want)
        predicted = self.predictor(self.step_rows + 1, self.step_rows + 1,
                                   self.decode_context + request.num_tokens)
        if predicted <= 0.0 and self.num_admitted >= 1:
            return 0  # the model is not fitted yet: slow start, one admission per step
        if predicted > self.target_s:
            return 0
        chunk = self._largest_chunk(1, num_cached, want)
        if chunk == 0 or (chunk < want and not allow_partial):
            return 0
        return self._admit(request, num_cached, chunk)

    def _admit(self, request: Request, num_cached: int, chunk: int) -> int:
        self.num_admitted += 1
        self.step_rows += 1
        self.step_tokens += chunk
        self.step_context += num_cached + chunk
        self.decode_context += request.num_tokens
        return chunk
