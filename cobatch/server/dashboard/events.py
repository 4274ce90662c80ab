"""The dashboard's wire format: step records and finishes as compact JSON events, request timelines.

Pure functions over StepRecord / RequestDelta (no engine imports), so they are unit-tested alone.
One `tick` event per replica per interval carries the steps since the last one:

    {"type": "tick", "replica": "engine", "state": "ready",
     "ids": ["cmpl-1", "cmpl-2"],                      # the tick's id table: rows refer to it by index
     "steps": [{"step": 41, "t": 812.5031, "ms": 21.4, "pred_ms": 20.9,
                "rows": [0, 1], "kinds": "pd", "tokens": [64, 1],   # per row; [] when all are 1
                "running": 2, "waiting": 0, "swapped": 0, "kv": 0.31, "hit": 0.12,
                "gen": 1, "prefill": 64, "decode": 1, "preempted": 0}],
     "finished": [{"id": 1, "reason": "length", "tokens": 32}],
     "why_waiting": {"counts": {"max_num_seqs": 3}, "waiting": "max_num_seqs", "swapped": null}}

`why_waiting` is the newest step's StepStats.waits (sequences without a row by reason, and the reason
each queue's unexamined sequences wait for); null in a tick without steps.

`kinds` uses StepStats.row_kinds' letters: "p" prefill chunk, "d" decode, "x" padding.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence

from cobatch.async_engine import EngineInfo
from cobatch.outputs import RequestDelta, RequestMetrics
from cobatch.step_history import UNSCHEDULED, WAITING, Segment, StepHistory, StepRecord
from cobatch.wait_reasons import PreemptionChoice, StepWaits

SCHEMA_VERSION = 1


def sse(event: str, payload: Mapping[str, object]) -> str:
    """One named server-sent event holding compact JSON."""
    return f"event: {event}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def hello_event(boot_id: str, state: str, interval_ms: int,
                replicas: Mapping[str, EngineInfo | None]) -> dict[str, object]:
    """The first event of a connection: which server (boot id: a restart changes it) and its engines."""
    return {"type": "hello", "schema": SCHEMA_VERSION, "boot": boot_id, "state": state,
            "interval_ms": interval_ms,
            "replicas": [{"replica": name, **_info(info)} for name, info in replicas.items()]}


def _info(info: EngineInfo | None) -> dict[str, object]:
    if info is None:
        return {}
    return {"num_kv_blocks": info.num_kv_blocks, "block_size": info.block_size,
            "max_num_seqs": info.max_num_seqs, "max_num_batched_tokens": info.max_num_batched_tokens,
            "max_model_len": info.max_model_len}


def tick_event(replica: str, state: str, steps: Sequence[StepRecord],
               finished: Sequence[RequestDelta]) -> dict[str, object]:
    """The steps and finishes one replica recorded since the last tick."""
    index: dict[str, int] = {}  # id -> its place in the table, in insertion order

    def refs(request_ids: Iterable[str]) -> list[int]:
        return [index.setdefault(r, len(index)) for r in request_ids]

    step_dicts = [step_dict(stats, refs) for stats in steps]
    finished_ids = refs(d.request_id for d in finished)
    finished_dicts = [{"id": i, "reason": d.finish_reason, "tokens": d.num_output_tokens}
                      for i, d in zip(finished_ids, finished)]
    return {"type": "tick", "replica": replica, "state": state, "ids": list(index),
            "steps": step_dicts, "finished": finished_dicts,
            "why_waiting": _why_waiting(steps[-1].waits) if steps else None}


def _why_waiting(waits: StepWaits) -> dict[str, object]:
    return {"counts": dict(waits.counts), "waiting": waits.waiting_reason,
            "swapped": waits.swapped_reason}


def step_dict(stats: StepRecord, refs: Callable[[Iterable[str]], list[int]]) -> dict[str, object]:
    """One step as the page draws it: its rows, timings and the engine's state after it."""
    return {
        "step": stats.step, "t": round(stats.start_time, 4),
        "ms": round(stats.duration_s * 1e3, 3), "pred_ms": round(stats.predicted_s * 1e3, 3),
        "rows": refs(stats.row_request_ids), "kinds": stats.row_kinds,
        "tokens": _tokens(stats.row_num_new_tokens),
        "running": stats.num_running, "waiting": stats.num_waiting, "swapped": stats.num_swapped,
        "kv": round(stats.kv_usage, 4), "hit": round(stats.prefix_cache_hit_rate, 4),
        "gen": stats.num_generated_tokens, "prefill": stats.num_prefill_tokens,
        "decode": stats.num_decode_tokens, "preempted": stats.num_preempted,
    }


def _tokens(row_num_new_tokens: tuple[int, ...]) -> list[int]:
    """Each row's new tokens; [] when every row has one (all decode, the common step: half the bytes)."""
    if sum(row_num_new_tokens) == len(row_num_new_tokens):
        return []
    return list(row_num_new_tokens)


def request_timeline(request_id: str, replica: str, history: StepHistory) -> dict[str, object] | None:
    """A request's sequences through the kept steps (None if none of it was seen)."""
    seq_ids = history.sequence_ids(request_id)
    if not seq_ids or not (history.steps or history.finished):
        return None
    finished = {d.request_id: d for d in history.finished_of(request_id)}
    first_kept = history.steps[0] if history.steps else None
    sequences = []
    for seq_id in seq_ids:
        delta = finished.get(seq_id)
        segments = history.segments(seq_id, _waited(delta))
        sequences.append(sequence_timeline(seq_id, segments, delta, first_kept))
    return {"request_id": request_id, "replica": replica, "sequences": sequences,
            "window": {"first_step": first_kept.step if first_kept else None,
                       "last_step": history.steps[-1].step if history.steps else None}}


def sequence_timeline(seq_id: str, segments: list[Segment], delta: RequestDelta | None,
                      first_kept: StepRecord | None) -> dict[str, object]:
    """One sequence's segments in ms from its arrival (or its first kept step, before it finishes)."""
    metrics = delta.metrics if delta is not None else None
    origin = metrics.arrival_time if metrics else (segments[0].start_time if segments else 0.0)
    items = [_segment_dict(s, origin) for s in segments]
    return {
        "id": seq_id, "status": "finished" if delta is not None else "live",
        "finish_reason": delta.finish_reason if delta else None,
        "error": delta.error if delta else None,
        "is_truncated": _is_truncated(segments, metrics, first_kept),
        "metrics": _metrics_dict(delta, metrics, origin) if delta and metrics else None,
        "segments": items,
    }


def _ms(t: float, origin: float) -> float:
    return round((t - origin) * 1e3, 3)


def _waited(delta: RequestDelta | None) -> tuple[float, float] | None:
    """(arrival, first scheduled) of a finished sequence that got a row: its wait can be drawn."""
    metrics = delta.metrics if delta is not None else None
    if metrics is None or metrics.first_scheduled_time is None:
        return None
    return metrics.arrival_time, metrics.first_scheduled_time


def _segment_dict(segment: Segment, origin: float) -> dict[str, object]:
    preemption = segment.preemption
    return {"kind": segment.kind, "first_step": segment.first_step, "last_step": segment.last_step,
            "num_tokens": segment.num_tokens, "start_ms": _ms(segment.start_time, origin),
            "end_ms": _ms(segment.end_time, origin), "is_recompute": segment.is_recompute,
            "wait_reason": segment.wait_reason, "wait_steps": dict(segment.wait_steps),
            "preemption": _preemption_dict(preemption) if preemption else None}


def _preemption_dict(choice: PreemptionChoice) -> dict[str, object]:
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1e3, 3)

    return {"mode": choice.mode, "why": choice.why, "num_computed_tokens": choice.num_computed_tokens,
            "recompute_ms": ms(choice.recompute_s), "swap_ms": ms(choice.swap_s)}


def _is_truncated(segments: list[Segment], metrics: RequestMetrics | None,
                  first_kept: StepRecord | None) -> bool:
    """Whether steps of the sequence may have left the kept window already (steps count from 0)."""
    started = metrics.first_scheduled_time if metrics else None
    if first_kept is None:
        return started is not None  # it had rows, and every step has gone
    if first_kept.step == 0:
        return False  # nothing was dropped yet
    if started is not None:
        return started < first_kept.start_time
    rows = [s for s in segments if s.kind not in (WAITING, UNSCHEDULED)]
    return not rows or rows[0].first_step <= first_kept.step


def _metrics_dict(delta: RequestDelta, metrics: RequestMetrics, origin: float) -> dict[str, object]:
    def ms(t: float | None) -> float | None:
        return None if t is None else _ms(t, origin)

    return {"first_scheduled_ms": ms(metrics.first_scheduled_time),
            "first_token_ms": ms(metrics.first_token_time), "finished_ms": ms(metrics.finished_time),
            "num_prompt_tokens": delta.num_prompt_tokens, "num_output_tokens": delta.num_output_tokens,
            "num_cached_tokens": metrics.num_cached_tokens, "num_preemptions": metrics.num_preemptions,
            "num_swaps": metrics.num_swaps, "num_recomputed_tokens": metrics.num_recomputed_tokens,
            "wait_steps": dict(metrics.wait_steps),
            "preemptions": [{"step": p.step, **_preemption_dict(p)} for p in metrics.preemptions]}
