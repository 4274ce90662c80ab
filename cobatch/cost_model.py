"""Step-time model T(rows, tokens, context) fitted by least squares, offline or online.

    T_step ≈ c0                      weight read, independent of the batch
           + c1 · num_rows           per-sequence overhead (sampling, metadata, attention launch)
           + c2 · num_batched_tokens per-token compute in the linear layers
           + c3 · num_context_tokens KV read by attention

Pure Python (no numpy/torch): a 4x4 normal-equation solve is microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

NUM_FEATURES = 4
NO_COEFFICIENTS = (0.0,) * NUM_FEATURES  # a model that has not seen enough steps predicts 0

# Predicts a step's seconds from (rows, batched tokens, context tokens), like StepTimeModel.predict:
# what the TPOT SLO bounds the batch with (slo.py, scheduler.py).
StepTimePredictor = Callable[[int, int, int], float]
# (num_computed_tokens, num_cached_tokens, num_blocks a swap copies: its unshared ones) of a preemption
# victim -> predicted seconds of (recompute, swap out and back in); None where there is no prediction yet
# (preemption_mode auto).
PreemptionCostPredictor = Callable[[int, int, int], tuple[float | None, float | None]]


def features(num_rows: int, num_tokens: int, num_context_tokens: int) -> tuple[float, ...]:
    return (1.0, float(num_rows), float(num_tokens), float(num_context_tokens))


def solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a tiny ridge keeps it defined when rank-deficient."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-30:
            continue
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] if abs(a[i][i]) >= 1e-30 else 0.0 for i in range(n)]


def solve_nonnegative(matrix: list[list[float]], rhs: list[float]) -> tuple[float, ...]:
    """The normal equations' least squares with every coefficient >= 0 (an active set, 4 features).

    Why not clamp: on decode steps rows and context grow together, the unconstrained fit may trade a
    negative per-context slope for a huge per-row one, and clamping the negative one alone kept the
    huge one (seen: 0.36 s a row for ~0.05 s steps). Each negative coefficient is fixed at 0 and the
    rest re-solved, until none is negative.
    """
    free = list(range(len(rhs)))
    while True:
        sub = solve([[matrix[i][j] for j in free] for i in free], [rhs[i] for i in free])
        coefficients = [0.0] * len(rhs)
        for i, c in zip(free, sub):
            coefficients[i] = c
        most_negative = min(free, key=lambda i: coefficients[i])
        if coefficients[most_negative] >= 0.0 or len(free) == 1:
            return tuple(max(c, 0.0) for c in coefficients)
        free.remove(most_negative)


@dataclass(slots=True)
class StepTimeModel:
    """Least-squares fit of step seconds; `decay` < 1 forgets old steps (online use)."""

    decay: float = 0.995
    ridge: float = 1e-9
    min_samples: int = 8
    # Steps observed between refits: a fit is ~45 us of Python, read a few times a step (the scheduler's
    # predictions, the published stats) beside decode steps of a few ms, and with decay 0.995 (a memory of
    # ~200 steps) eight more steps hardly move it.
    refit_every: int = 8
    num_samples: int = 0
    coefficients: tuple[float, ...] = NO_COEFFICIENTS  # the last fit (fitted_coefficients: current)
    _xtx: list[list[float]] | None = None
    _xty: list[float] | None = None
    _fitted_at: int = -1  # num_samples at the last fit

    def observe(self, num_rows: int, num_tokens: int, num_context_tokens: int,
                duration_s: float) -> None:
        """Add one measured step."""
        if self._xtx is None or self._xty is None:
            self._xtx = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
            self._xty = [0.0] * NUM_FEATURES
        x = features(num_rows, num_tokens, num_context_tokens)
        for i in range(NUM_FEATURES):
            self._xty[i] = self.decay * self._xty[i] + x[i] * duration_s
            row = self._xtx[i]
            for j in range(NUM_FEATURES):
                row[j] = self.decay * row[j] + x[i] * x[j]
        self.num_samples += 1

    def fit(self) -> tuple[float, ...]:
        """Solve the normal equations with non-negative coefficients (time never shrinks)."""
        if self._xtx is None or self._xty is None:
            return self.coefficients
        # The ridge is relative to each feature's own scale: context tokens are ~1e3x the row count,
        # so one shared ridge sized by the largest feature would shrink the constant and per-row terms.
        # The constant is not penalised: when the steps seen do not vary a feature (all batch-1
        # decode, say), their time stays in c0 instead of being split into per-row and per-token
        # slopes that a 200-token prefill would then multiply into seconds.
        top = max(self._xtx[i][i] for i in range(NUM_FEATURES)) or 1.0
        matrix = [[v + (self.ridge * (self._xtx[i][i] or top) if i == j and i > 0 else 0.0)
                   for j, v in enumerate(row)] for i, row in enumerate(self._xtx)]
        self.coefficients = solve_nonnegative(matrix, self._xty)
        self._fitted_at = self.num_samples
        return self.coefficients

    @property
    def is_ready(self) -> bool:
        return self.num_samples >= self.min_samples

    @property
    def fitted_coefficients(self) -> tuple[float, ...]:
        """(c0, c1, c2, c3) as predict uses them: all zero until is_ready (what stats publish), then refit
        every refit_every steps."""
        if not self.is_ready:
            return NO_COEFFICIENTS
        if self._fitted_at < self.min_samples or self.num_samples - self._fitted_at >= self.refit_every:
            self.fit()
        return self.coefficients

    def predict(self, num_rows: int, num_tokens: int, num_context_tokens: int) -> float:
        """Predicted seconds of a step (0 until enough steps have been seen)."""
        return predict_with(self.fitted_coefficients, num_rows, num_tokens, num_context_tokens)


def predict_with(coefficients: Sequence[float], num_rows: int, num_tokens: int,
                 num_context_tokens: int) -> float:
    """A step's seconds under fitted coefficients (a StepTimeModel's, or ones read from its stats)."""
    return sum(c * x for c, x in zip(coefficients, features(num_rows, num_tokens, num_context_tokens)))


def predict_prefill_s(coefficients: Sequence[float], num_prefill_tokens: int, num_decode_rows: int,
                      num_context_tokens: int, max_num_batched_tokens: int) -> float:
    """Seconds of the steps that compute `num_prefill_tokens` of prefill beside running decode rows.

    Each step gives the `num_decode_rows` rows (holding `num_context_tokens` of KV) one token first and
    the rest of the budget to one prefill chunk: what a queue of prompts costs before the last one's
    first token. Optimistic: waits for a seat and preemptions are not counted (prefix-cache hits are
    the caller's to subtract from the tokens).
    """
    if num_prefill_tokens <= 0:
        return 0.0
    rows, context = num_decode_rows, num_context_tokens
    chunk = max(max_num_batched_tokens - rows, 1)
    num_full, rest = divmod(num_prefill_tokens, chunk)
    full_s = predict_with(coefficients, rows + 1, rows + chunk, context + chunk) if num_full else 0.0
    rest_s = predict_with(coefficients, rows + 1, rows + rest, context + rest) if rest else 0.0
    return num_full * full_s + rest_s


def predict_recompute_s(coefficients: Sequence[float], num_tokens: int, num_cached_tokens: int,
                        max_chunk_tokens: int) -> float:
    """Seconds that computing a sequence's first `num_tokens` of KV again adds to the steps carrying it.

    Past its cached prefix, in chunks of at most `max_chunk_tokens`: each chunk is one more row (c1),
    its tokens (c2) and the context it attends to, up to the chunk's end (c3). The constant c0 is not
    counted: under memory pressure the steps run for the other rows anyway.
    """
    _, per_row, per_token, per_context = coefficients
    total, start = 0.0, num_cached_tokens
    while start < num_tokens:
        end = min(start + max(max_chunk_tokens, 1), num_tokens)
        total += per_row + per_token * (end - start) + per_context * end
        start = end
    return total


@dataclass(slots=True)
class CopyTimeEstimate:
    """Seconds per KV block copied between the device pool and the swap pool: a moving mean of measurements."""

    weight: float = 0.2  # of the newest measurement
    seconds_per_block: float | None = None  # None until a copy was measured
    num_observations: int = 0

    def observe(self, num_blocks: int, duration_s: float) -> None:
        """One step's copies (swap out and in together): `num_blocks` blocks in `duration_s`."""
        if num_blocks <= 0:
            return
        measured = duration_s / num_blocks
        mean = self.seconds_per_block
        self.seconds_per_block = measured if mean is None else mean + self.weight * (measured - mean)
        self.num_observations += 1

    def predict_s(self, num_blocks: int) -> float | None:
        """Seconds to copy `num_blocks` blocks (None before any measurement)."""
        return None if self.seconds_per_block is None else num_blocks * self.seconds_per_block


def r_squared(model: StepTimeModel, samples: list[tuple[int, int, int, float]]) -> float:
    """Coefficient of determination of `model` on (rows, tokens, context, seconds) samples."""
    if not samples:
        return 0.0
    mean = sum(s[3] for s in samples) / len(samples)
    ss_tot = sum((s[3] - mean) ** 2 for s in samples)
    ss_res = sum((s[3] - model.predict(*s[:3])) ** 2 for s in samples)
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
