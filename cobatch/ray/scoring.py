"""One cost per candidate replica: the request's predicted latency there, from the replica's own telemetry.

For each candidate, from the replica's last stats record, what this router sent there since (the
in-flight ledger) and the prompt blocks the replica probably caches (the prefix index):

    ttft_s           time to the first token: the prefill queue ahead of the request and its own
                     uncached prompt tokens, cut into step-sized chunks priced by the replica's fitted
                     step-time model; plus the wait for a seat when all max_num_seqs are taken
    tpot_s           the decode step time once it is seated (its own TPOT and its co-runners')
    step_increase_s  how much longer each of those decode steps is because of it
    prefill_s        what its own uncached prompt adds to the steps it runs in (their decode share
                     runs anyway): every row decoding there waits for it, so a cached prefix spares
                     the co-runners as much as the request itself

    score_s = ttft_s + num_other_rows * prefill_s + K * (tpot_s + num_other_rows * step_increase_s)
              + penalty_s

that is, the latency of the request's first K tokens plus the delay its prefill and its K decode
steps add to the rows already running there (K = RouterConfig.num_scored_steps, at most max_tokens). Prefix affinity, load
and a replica's speed are terms of the same sum, in seconds, so no threshold decides between them.
A replica whose free KV blocks would not hold the request makes it wait for running requests to
finish and give theirs back: that wait is part of its TTFT (`kv_full_penalty_s` only when nothing
running there would free any). Stats older than the freshest candidate's by more than `max_stats_age_s`
pay per second beyond (a controller late with every record, on a busy host, says nothing about any one
replica, and the phases of their periods would decide); a replica that would miss the
deadline, whose queue is at its bound, or that cannot hold the prompt at all, is excluded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cobatch.cost_model import NUM_FEATURES, features
from cobatch.ray.inflight import InFlightLoad

Coefficients = tuple[float, ...]  # c0 + c1*rows + c2*tokens + c3*context (cost_model.StepTimeModel)
NO_COEFFICIENTS: Coefficients = (0.0,) * NUM_FEATURES

# Exclusion reasons (CandidateScore.excluded) and decision outcomes (RoutingDecision.status).
EXCLUDED_BY_CALLER = "excluded_by_caller"  # e.g. the replica a migrating request just lost
QUEUE_FULL = "queue_full"
PROMPT_EXCEEDS_KV = "prompt_exceeds_kv"
MISSES_DEADLINE = "misses_deadline"
ROUTED, FULL, DEADLINE, UNAVAILABLE = "routed", "full", "deadline", "unavailable"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Weights and limits of the cost; the defaults are what the router ships with."""

    max_stats_age_s: float = 1.0  # older stats are marked stale; older than the freshest's + this pay
    stale_penalty_per_s: float = 1.0  # seconds of score per second of staleness beyond that
    num_scored_steps: int = 16  # K: decode steps of TPOT (own and imposed) counted in the score
    kv_full_penalty_s: float = 60.0  # KV short and nothing running to free it: chosen last
    default_mean_output_tokens: float = 128.0  # until a replica reports its own mean
    # Replicas of one deployment run one engine config, usually on one node type: price every one's
    # steps with the mean of their fitted models (their fits differ mostly by noise on a busy host).
    # False prices each with its own model (replicas on different hardware).
    pool_step_models: bool = True
    # Used only until a replica's own model has seen enough steps (its coefficients are all zero):
    # a coarse step price, so that queue lengths still order replicas before any step is measured.
    prior_coefficients: Coefficients = (0.02, 1e-4, 1e-4, 0.0)
    max_index_blocks_per_replica: int = 65536


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica's telemetry at `time_s`: what its record_routing_stats returns, as plain data."""

    replica_id: str
    time_s: float  # wall clock (time.time()) at the replica when measured
    block_size: int
    num_kv_blocks: int
    num_kv_blocks_free: int
    num_running: int
    num_waiting: int
    num_swapped: int = 0
    num_waiting_requests: int = 0  # distinct requests among the waiting (what the queue bound counts)
    num_running_tokens: int = 0  # prompt + output tokens of the running sequences (a decode step's KV)
    num_running_prefill_tokens: int = 0  # prompt tokens running sequences still compute (chunked prefill)
    num_waiting_tokens: int = 0  # tokens the waiting sequences have yet to prefill
    num_swapped_tokens: int = 0  # tokens of swapped sequences (they need device blocks back first)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_num_waiting_requests: int | None = None  # the replica's queue bound; None: unbounded
    step_coefficients: Coefficients = NO_COEFFICIENTS  # fitted on every step
    decode_coefficients: Coefficients = NO_COEFFICIENTS  # fitted on pure decode steps
    mean_output_tokens: float = 0.0  # of recently finished requests; 0: none yet
    num_evictions_total: int = 0  # cached blocks evicted since the replica started
    recent_evicted_hashes: tuple[int, ...] = ()  # the last few evicted block hashes, oldest first
    recent_arrivals: tuple[str, ...] = ()  # ids of the requests that arrived lately (ray.arrivals)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaStats:
        """From a routing-stats dict (tuples may arrive as lists); unknown keys are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
        return cls(**values)


def idle_stats(replica_id: str, now_s: float, template: ReplicaStats | None,
               block_size: int) -> ReplicaStats:
    """Stats for a replica not heard from yet: idle, shaped like another replica (same engine config)."""
    if template is None:
        return ReplicaStats(replica_id=replica_id, time_s=now_s, block_size=block_size,
                            num_kv_blocks=1 << 30, num_kv_blocks_free=1 << 30,
                            num_running=0, num_waiting=0)
    return ReplicaStats(
        replica_id=replica_id, time_s=now_s, block_size=template.block_size,
        num_kv_blocks=template.num_kv_blocks, num_kv_blocks_free=template.num_kv_blocks,
        num_running=0, num_waiting=0, max_num_seqs=template.max_num_seqs,
        max_num_batched_tokens=template.max_num_batched_tokens,
        max_num_waiting_requests=template.max_num_waiting_requests,
        step_coefficients=template.step_coefficients,
        decode_coefficients=template.decode_coefficients)


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What the router needs to know about one request."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int | None = None
    deadline_s: float | None = None  # wall clock by which it must have its first token, if any
    exclude: frozenset[str] = frozenset()  # replicas not to use


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One replica's predicted figures for the request, and why it was or was not eligible."""

    replica_id: str
    score_s: float
    ttft_s: float
    tpot_s: float
    step_increase_s: float
    prefill_s: float  # what its own uncached prompt adds to its steps (its co-runners wait too)
    num_prefix_blocks: int  # leading prompt blocks it probably caches
    num_prefill_tokens: int  # prompt tokens it would compute
    num_queued_tokens: int  # prefill tokens ahead of the request there
    num_inflight: int  # routed there since its last stats record
    kv_fits: bool
    penalty_s: float
    stats_age_s: float | None  # None: no stats from it yet
    is_stale: bool
    excluded: str = ""  # one of the exclusion reasons, "" when eligible


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    """The explainable record of one routing decision."""

    request_id: str
    time_s: float
    status: str  # ROUTED, FULL, DEADLINE or UNAVAILABLE
    chosen: str | None
    reason: str
    num_prompt_tokens: int
    candidates: tuple[CandidateScore, ...]  # eligible by score, then the excluded

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def predict_step_s(coefficients: Coefficients, num_rows: int, num_tokens: int,
                   num_context_tokens: int) -> float:
    """A step's seconds under a fitted linear model (cost_model's features)."""
    return sum(c * x for c, x in zip(coefficients, features(num_rows, num_tokens, num_context_tokens)))


def _or_fallback(coefficients: Coefficients, fallback: Coefficients) -> Coefficients:
    # All zero: the replica's model has not seen enough steps yet (StepTimeModel.is_ready).
    return coefficients if any(coefficients) else fallback


def _prefill_time_s(coefficients: Coefficients, stats: ReplicaStats, num_tokens: int,
                    num_cached_tokens: int, marginal: bool = False) -> float:
    """Seconds of the steps that compute `num_tokens` of prefill beside the running decode rows.

    Each step gives decode rows one token first, the rest of the budget to prefill chunks in queue
    order; the last chunk (the request's own) also reads its cached prefix. `marginal`: only what the
    chunks add to those steps (the decode rows' own share runs anyway) -- what co-runners wait for.
    """
    rows, context = stats.num_running, stats.num_running_tokens
    chunk = max(stats.max_num_batched_tokens - rows, 1)
    num_full, rest = divmod(num_tokens, chunk)
    full_step_s = predict_step_s(coefficients, rows + 1, rows + chunk, context + chunk)
    last_step_s = predict_step_s(coefficients, rows + 1, rows + rest, context + rest + num_cached_tokens)
    total_s = num_full * full_step_s + (last_step_s if rest else 0.0)
    if not marginal or not rows:
        return total_s
    decode_step_s = predict_step_s(coefficients, rows, rows, context)
    return max(total_s - (num_full + (1 if rest else 0)) * decode_step_s, 0.0)


def _seat_wait_s(stats: ReplicaStats, load: InFlightLoad, tpot_now_s: float,
                 default_mean_output_tokens: float) -> float:
    """Expected wait for a free seat when the requests ahead take all of max_num_seqs."""
    num_free = stats.max_num_seqs - stats.num_running - stats.num_swapped
    num_short = stats.num_waiting + load.num_requests + 1 - num_free
    if num_short <= 0:
        return 0.0
    mean_output = stats.mean_output_tokens or default_mean_output_tokens
    # Little's law: running requests that each live ~mean_output steps free a seat every
    # mean_output / num_running steps on average.
    steps_per_seat = mean_output / max(stats.num_running, 1)
    return num_short * steps_per_seat * tpot_now_s


def _kv_blocks(stats: ReplicaStats, load: InFlightLoad, num_prompt_tokens: int,
               num_prefix_blocks: int) -> tuple[int, int]:
    """(new blocks the request needs, blocks the requests ahead of it will take first)."""
    size = stats.block_size
    num_needed = -(-(num_prompt_tokens + 1) // size) - num_prefix_blocks  # +1: the first output token
    queued = stats.num_waiting_tokens + stats.num_swapped_tokens
    return num_needed, -(-queued // size) + load.num_new_blocks


@dataclass(frozen=True, slots=True)
class _Prediction:
    ttft_s: float
    tpot_s: float
    step_increase_s: float
    num_other_rows: int
    num_queued_tokens: int
    tpot_now_s: float  # the decode step there before the request
    seat_wait_s: float  # of ttft_s: the wait for a free seat
    prefill_s: float  # its own uncached prompt's addition to the steps it runs in


def _predict(stats: ReplicaStats, load: InFlightLoad, num_prompt_tokens: int, num_prefix_blocks: int,
             fallback: Coefficients, config: RouterConfig) -> _Prediction:
    step = _or_fallback(stats.step_coefficients, fallback)
    decode = _or_fallback(stats.decode_coefficients, step)
    num_cached = num_prefix_blocks * stats.block_size
    queued = stats.num_waiting_tokens + stats.num_running_prefill_tokens + load.num_prefill_tokens
    rows, context = stats.num_running, stats.num_running_tokens
    tpot_now_s = predict_step_s(decode, rows, rows, context) if rows else 0.0
    seat_wait_s = _seat_wait_s(stats, load, tpot_now_s, config.default_mean_output_tokens)
    all_prefill_s = _prefill_time_s(step, stats, queued + num_prompt_tokens - num_cached, num_cached)
    # What its chunks add to the steps the running rows take anyway: a cached prompt adds little.
    own_prefill_s = (_prefill_time_s(step, stats, queued + num_prompt_tokens - num_cached, num_cached,
                                     marginal=True)
                     - _prefill_time_s(step, stats, queued, 0, marginal=True))
    ttft_s = 0.5 * tpot_now_s + seat_wait_s + all_prefill_s  # (the step in progress: half done)
    # Requests routed but not reported yet will decode there too: count them, or a burst herds.
    other_rows = rows + load.num_requests
    other_context = context + load.num_prompt_tokens
    before_s = predict_step_s(decode, other_rows, other_rows, other_context) if other_rows else 0.0
    tpot_s = predict_step_s(decode, other_rows + 1, other_rows + 1, other_context + num_prompt_tokens)
    return _Prediction(ttft_s, tpot_s, tpot_s - before_s, other_rows, queued, tpot_now_s,
                       seat_wait_s, max(own_prefill_s, 0.0))


def _kv_wait_s(stats: ReplicaStats, num_short_blocks: int, pred: _Prediction,
               config: RouterConfig) -> float | None:
    """The wait for `num_short_blocks` more free blocks (None: nothing running would free them).

    Running requests finish one every mean_output / num_running steps (as for a seat), each giving
    back its share of the blocks in use.
    """
    num_rows = stats.num_running
    if num_short_blocks <= 0:
        return 0.0
    if num_rows == 0 or pred.tpot_now_s <= 0.0:
        return None
    blocks_per_row = max(stats.num_kv_blocks - stats.num_kv_blocks_free, 1) / num_rows
    num_finishes = min(-(-num_short_blocks // max(int(blocks_per_row), 1)), num_rows)
    mean_output = stats.mean_output_tokens or config.default_mean_output_tokens
    return num_finishes * (mean_output / num_rows) * pred.tpot_now_s


def projected_num_waiting(stats: ReplicaStats, load: InFlightLoad) -> int:
    """Requests waiting there once the routed-but-unreported ones arrive: they take free seats first."""
    num_free_seats = stats.max_num_seqs - stats.num_running - stats.num_swapped - stats.num_waiting
    return stats.num_waiting_requests + max(load.num_requests - max(num_free_seats, 0), 0)


def _exclusion(query: RouteQuery, stats: ReplicaStats, load: InFlightLoad, ttft_s: float,
               num_needed_blocks: int, now_s: float) -> str:
    if stats.replica_id in query.exclude:
        return EXCLUDED_BY_CALLER
    if num_needed_blocks > stats.num_kv_blocks:
        return PROMPT_EXCEEDS_KV
    bound = stats.max_num_waiting_requests
    if bound is not None and projected_num_waiting(stats, load) >= bound:
        return QUEUE_FULL
    if query.deadline_s is not None and now_s + ttft_s > query.deadline_s:
        return MISSES_DEADLINE
    return ""


def score_candidate(query: RouteQuery, stats: ReplicaStats, load: InFlightLoad, num_prefix_blocks: int,
                    now_s: float, config: RouterConfig, fallback: Coefficients | None = None,
                    has_stats: bool = True, freshest_age_s: float = 0.0) -> CandidateScore:
    """Predict the request's figures on one replica and price them (module docstring); freshest_age_s:
    the age of the freshest candidate's stats."""
    num_prompt = len(query.prompt_token_ids)
    pred = _predict(stats, load, num_prompt, num_prefix_blocks, fallback or config.prior_coefficients,
                    config)
    num_needed, num_ahead = _kv_blocks(stats, load, num_prompt, num_prefix_blocks)
    num_short = num_needed + num_ahead - stats.num_kv_blocks_free
    kv_wait_s = _kv_wait_s(stats, num_short, pred, config)
    # Blocks and seats both come back as running requests finish: the longer of the two waits.
    ttft_s = pred.ttft_s + max((kv_wait_s or 0.0) - pred.seat_wait_s, 0.0)
    age_s = now_s - stats.time_s if has_stats else None
    is_stale = age_s is not None and age_s > config.max_stats_age_s
    staler_s = age_s - max(freshest_age_s, 0.0) - config.max_stats_age_s if age_s is not None else 0.0
    penalty_s = (config.kv_full_penalty_s if kv_wait_s is None else 0.0) + (
        config.stale_penalty_per_s * staler_s if staler_s > 0 else 0.0)
    num_steps = min(config.num_scored_steps, query.max_tokens or config.num_scored_steps)
    score_s = (ttft_s + pred.num_other_rows * pred.prefill_s
               + num_steps * (pred.tpot_s + pred.num_other_rows * pred.step_increase_s) + penalty_s)
    return CandidateScore(
        replica_id=stats.replica_id, score_s=score_s, ttft_s=ttft_s, tpot_s=pred.tpot_s,
        step_increase_s=pred.step_increase_s, prefill_s=pred.prefill_s,
        num_prefix_blocks=num_prefix_blocks,
        num_prefill_tokens=num_prompt - num_prefix_blocks * stats.block_size,
        num_queued_tokens=pred.num_queued_tokens, num_inflight=load.num_requests,
        kv_fits=num_short <= 0, penalty_s=penalty_s, stats_age_s=age_s, is_stale=is_stale,
        excluded=_exclusion(query, stats, load, ttft_s, num_needed, now_s))


def _order_key(candidate: CandidateScore) -> tuple[float, int, str]:
    # Ties (identical idle replicas) go to the one with less in flight, then a stable name order.
    return (candidate.score_s, candidate.num_inflight, candidate.replica_id)


def _describe(c: CandidateScore) -> str:
    stale = ", stale stats" if c.is_stale else ("" if c.stats_age_s is not None else ", no stats yet")
    kv = "" if c.kv_fits else ", KV full"
    return (f"{c.replica_id} {c.score_s * 1e3:.1f} ms (ttft {c.ttft_s * 1e3:.1f} ms, tpot "
            f"{c.tpot_s * 1e3:.1f} ms, {c.num_prefix_blocks} prefix blocks cached{kv}{stale})")


def _refusal(query: RouteQuery, excluded: Sequence[CandidateScore], now_s: float) -> tuple[str, str]:
    reasons = {c.excluded for c in excluded}
    if MISSES_DEADLINE in reasons:
        best = min(c.ttft_s for c in excluded if c.excluded == MISSES_DEADLINE)
        left_ms = ((query.deadline_s or now_s) - now_s) * 1e3
        return DEADLINE, (f"no replica can meet the deadline: best predicted ttft {best * 1e3:.1f} ms, "
                          f"{left_ms:.1f} ms left")
    if QUEUE_FULL in reasons:
        return FULL, "every replica's queue is full"
    detail = ", ".join(f"{c.replica_id}: {c.excluded}" for c in excluded) or "no replicas"
    return UNAVAILABLE, f"no replica available ({detail})"


def choose(query: RouteQuery, candidates: Sequence[CandidateScore], now_s: float) -> RoutingDecision:
    """The eligible candidate of lowest score, with the record that explains it."""
    eligible = sorted((c for c in candidates if not c.excluded), key=_order_key)
    excluded = [c for c in candidates if c.excluded]
    ordered = tuple(eligible) + tuple(excluded)
    if not eligible:
        status, reason = _refusal(query, excluded, now_s)
        return RoutingDecision(query.request_id, now_s, status, None, reason,
                               len(query.prompt_token_ids), ordered)
    reason = "lowest predicted cost: " + _describe(eligible[0])
    if len(eligible) > 1:
        reason += "; next " + _describe(eligible[1])
    return RoutingDecision(query.request_id, now_s, ROUTED, eligible[0].replica_id, reason,
                           len(query.prompt_token_ids), ordered)
