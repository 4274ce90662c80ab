"""The step-time model: least squares recovers known coefficients; forgetting; the steps-bench helpers."""

from __future__ import annotations

import random

import pytest

from cobatch.bench.steps import StepSample, batch_ratio, coefficients_ms, fit, max_batch_for_slo
from cobatch.cost_model import StepTimeModel, predict_with, r_squared, solve

TRUE = (0.020, 0.001, 0.0005, 0.00002)  # constant, per row, per token, per context token


def true_time(rows: int, tokens: int, context: int) -> float:
    return TRUE[0] + TRUE[1] * rows + TRUE[2] * tokens + TRUE[3] * context


def mixed_steps(num: int, seed: int = 0) -> list[tuple[int, int, int, float]]:
    """Decode-only and mixed prefill steps, so every coefficient is identifiable."""
    rng = random.Random(seed)
    steps = []
    for _ in range(num):
        rows = rng.randint(1, 32)
        tokens = rows + rng.choice([0, 0, rng.randint(1, 512)])
        context = rows * rng.randint(16, 1024)
        steps.append((rows, tokens, context, true_time(rows, tokens, context)))
    return steps


def test_fit_recovers_known_coefficients() -> None:
    model = StepTimeModel(decay=1.0)
    samples = mixed_steps(200)
    for s in samples:
        model.observe(*s)
    for got, want in zip(model.fit(), TRUE):
        assert got == pytest.approx(want, rel=1e-3)
    assert r_squared(model, samples) == pytest.approx(1.0, abs=1e-9)


def test_fit_tolerates_noise() -> None:
    rng = random.Random(1)
    model = StepTimeModel(decay=1.0)
    samples = [(r, t, c, y * rng.uniform(0.95, 1.05)) for r, t, c, y in mixed_steps(2000)]
    for s in samples:
        model.observe(*s)
    assert model.predict(16, 16, 16 * 300) == pytest.approx(true_time(16, 16, 16 * 300), rel=0.03)
    assert r_squared(model, samples) > 0.95


def test_no_prediction_until_enough_steps() -> None:
    model = StepTimeModel(min_samples=8)
    for s in mixed_steps(7):
        model.observe(*s)
    assert model.predict(4, 4, 400) == 0.0
    model.observe(*mixed_steps(1, seed=9)[0])
    assert model.predict(4, 4, 400) > 0.0


def test_decay_forgets_an_old_regime() -> None:
    """The machine slows down (another job starts): the online model follows within a few hundred steps."""
    model = StepTimeModel(decay=0.99)
    for r, t, c, y in mixed_steps(500):
        model.observe(r, t, c, y)
    for r, t, c, y in mixed_steps(500, seed=2):
        model.observe(r, t, c, 2 * y)
    assert model.predict(8, 8, 8 * 200) == pytest.approx(2 * true_time(8, 8, 8 * 200), rel=0.02)


def test_decode_only_data_still_predicts_decode_steps() -> None:
    """Decode steps have rows == tokens (collinear): the split is arbitrary, predictions are not."""
    model = StepTimeModel(decay=1.0)
    for b in (1, 2, 4, 8, 16, 32):
        for ctx in (128, 512):
            model.observe(b, b, b * ctx, true_time(b, b, b * ctx))
    assert model.predict(12, 12, 12 * 300) == pytest.approx(true_time(12, 12, 12 * 300), rel=1e-3)


def synthetic_profile() -> list[StepSample]:
    return [StepSample(b, ctx, 0.020 + 0.002 * b + 0.00001 * b * (ctx + 1))
            for ctx in (128, 512) for b in (1, 2, 4, 8, 16, 32, 64)]


def test_steps_fit_reports_readable_coefficients() -> None:
    model, r2 = fit(synthetic_profile())
    got = coefficients_ms(model)
    assert got["constant_ms"] == pytest.approx(20.0, rel=1e-3)
    assert got["per_seq_ms"] == pytest.approx(2.0, rel=1e-3)
    assert got["per_1k_context_tokens_ms"] == pytest.approx(10.0, rel=1e-3)
    assert r2 == pytest.approx(1.0, abs=1e-9)


def test_max_batch_for_slo_and_batch_ratio() -> None:
    samples = synthetic_profile()
    model, _ = fit(samples)
    # 20 + 2B + 0.01 * B * 129 <= 50  ->  B <= 30 / 3.29 = 9.1
    assert max_batch_for_slo(model, 50.0, 128, limit=64) == 9
    assert max_batch_for_slo(model, 10.0, 128, limit=64) == 0
    assert max_batch_for_slo(model, 1e6, 128, limit=64) == 64
    t1, t32 = 0.020 + 0.002 + 0.00001 * 129, 0.020 + 0.064 + 0.00001 * 32 * 129
    assert batch_ratio(samples, 128) == pytest.approx(t32 / t1)


def test_steps_of_one_shape_stay_in_the_constant_and_do_not_inflate_a_prefill() -> None:
    """Batch-1 decode steps only (rows and tokens never vary): a prefill is not priced as many steps."""
    model = StepTimeModel()
    for i in range(16):
        model.observe(1, 1, 170 + i, 0.1)
    assert model.predict(1, 1, 175) == pytest.approx(0.1, rel=1e-3)
    assert model.predict(1, 170, 170) == pytest.approx(0.1, rel=0.05)


def test_a_negative_slope_is_refitted_away_not_clamped() -> None:
    """Decode steps whose context grows with their rows: the unconstrained fit pairs a negative
    per-context slope with an inflated per-row one; clamping the first kept the second (0.36 s a row
    was seen on ~0.05 s steps), the non-negative fit re-solves without it."""
    rng = random.Random(1)
    model = StepTimeModel(decay=1.0)
    steps = []
    for _ in range(200):
        rows = rng.randint(1, 8)
        offset = rng.randint(-400, 400) * (1 if rows % 2 else -1)
        context = 800 * rows + offset
        seconds = 0.03 + 0.024 * rows + rng.gauss(0.0, 0.004) - 1e-5 * offset
        model.observe(rows, rows, context, seconds)
        steps.append((rows, context, seconds))
    unconstrained = solve([row[:] for row in model._xtx], list(model._xty))
    assert min(unconstrained) < 0  # the case this guards against

    def squared_error(coefficients: tuple[float, ...]) -> float:
        return sum((predict_with(coefficients, r, r, c) - s) ** 2 for r, c, s in steps)

    clamped = tuple(max(c, 0.0) for c in unconstrained)
    fitted = model.fit()
    assert min(fitted) >= 0.0
    assert squared_error(fitted) < squared_error(clamped) / 20
    assert predict_with(fitted, 4, 4, 3200) == pytest.approx(0.03 + 0.024 * 4, rel=0.1)


def test_fitted_coefficients_refit_every_refit_every_steps_not_on_each_read() -> None:
    model = StepTimeModel(decay=1.0, refit_every=4)
    steps = mixed_steps(40)
    for s in steps[:8]:
        model.observe(*s)
    first = model.fitted_coefficients  # ready: fitted now
    for rows, tokens, context, _ in steps[8:11]:  # the machine slows down threefold
        model.observe(rows, tokens, context, 3 * true_time(rows, tokens, context))
        assert model.fitted_coefficients == first  # 3 steps since the fit: the last fit stands
    model.observe(*steps[11][:3], 3 * true_time(*steps[11][:3]))
    refit = model.fitted_coefficients
    assert refit != first and refit == model.fit()
    assert predict_with(refit, 8, 8, 800) > 1.2 * predict_with(first, 8, 8, 800)
