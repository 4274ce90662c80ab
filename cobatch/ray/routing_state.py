"""What a cobatch router knows between decisions, and the decision itself: pure, no Ray.

The Ray Serve RequestRouter adapter (phase 2) feeds it replica stats (`update_stats`), the live set
of replicas (`sync_replicas`), completions (`complete`), and asks `decide` per request. Ray calls all
of these from the router's one event loop, so nothing here needs a lock.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence

from cobatch.ray.inflight import InFlightLedger, InFlightLoad, InFlightRequest
from cobatch.ray.prefix_index import PrefixIndex, max_cached_blocks, prompt_block_hashes
from cobatch.ray.scoring import (
    CandidateScore, Coefficients, ReplicaStats, RouteQuery, RouterConfig, RoutingDecision, choose,
    idle_stats, score_candidate,
)


class RoutingState:
    """Per-replica stats, the in-flight ledger, the prefix index and the recent decisions."""

    def __init__(self, block_size: int, config: RouterConfig | None = None,
                 max_decisions: int = 256) -> None:
        self.block_size = block_size
        self.config = config or RouterConfig()
        self.stats: dict[str, ReplicaStats] = {}
        self.ledger = InFlightLedger()
        self.index = PrefixIndex(block_size, self.config.max_index_blocks_per_replica)
        self.decisions: deque[RoutingDecision] = deque(maxlen=max_decisions)
        self.num_missed_eviction_reports = 0

    # ---- what the replicas tell ---------------------------------------------------------------

    def update_stats(self, stats: ReplicaStats) -> None:
        """Take a replica's stats record (a re-broadcast of one already seen is a no-op)."""
        if stats.block_size != self.block_size:
            raise ValueError(f"replica {stats.replica_id} has block_size {stats.block_size}, "
                             f"the router hashes prompts at {self.block_size}")
        previous = self.stats.get(stats.replica_id)
        if previous is not None and stats.time_s <= previous.time_s:
            return
        self.stats[stats.replica_id] = stats
        self.ledger.retire_reflected(stats.replica_id, stats.time_s, stats.recent_arrivals)
        self.index.set_capacity(stats.replica_id, stats.num_kv_blocks)
        if not self.index.apply_eviction_report(stats.replica_id, stats.num_evictions_total,
                                                stats.recent_evicted_hashes):
            self.num_missed_eviction_reports += 1

    def sync_replicas(self, replica_ids: Iterable[str]) -> None:
        """Purge every replica not in the live set (died, drained, scaled down)."""
        live = set(replica_ids)
        known = set(self.stats) | set(self.index.replica_ids) | self.ledger.replica_ids
        for replica_id in known - live:
            self.remove_replica(replica_id)

    def remove_replica(self, replica_id: str) -> None:
        self.stats.pop(replica_id, None)
        self.ledger.remove_replica(replica_id)
        self.index.remove_replica(replica_id)

    def complete(self, request_id: str, now_s: float) -> None:
        """The request finished (or failed) on its replica: no longer load, in stats or not yet."""
        self.ledger.complete(request_id, now_s)

    # ---- deciding -------------------------------------------------------------------------------

    def decide(self, query: RouteQuery, replica_ids: Sequence[str], now_s: float) -> RoutingDecision:
        """Score every candidate, pick the cheapest, book it in the ledger and the index."""
        block_hashes = prompt_block_hashes(query.prompt_token_ids, self.block_size)
        usable = block_hashes[:max_cached_blocks(len(query.prompt_token_ids), self.block_size)]
        pooled = self._pooled_coefficients() if self.config.pool_step_models else None
        # a replica without stats yet is scored as idle now: as fresh as stats get
        freshest_age_s = min((now_s - self.stats[r].time_s if r in self.stats else 0.0 for r in replica_ids),
                             default=0.0)
        candidates = [self._score(query, replica_id, usable, now_s, pooled, freshest_age_s)
                      for replica_id in replica_ids]
        decision = choose(query, candidates, now_s)
        if decision.chosen is not None:
            self._book(query, decision, block_hashes, now_s)
        self.decisions.append(decision)
        return decision

    def _score(self, query: RouteQuery, replica_id: str, usable_hashes: list[int], now_s: float,
               pooled: tuple[Coefficients, Coefficients] | None, freshest_age_s: float) -> CandidateScore:
        stats = self.stats.get(replica_id)
        has_stats = stats is not None
        if stats is None:
            stats = idle_stats(replica_id, now_s, self._template(), self.block_size)
        stats = without_finished(stats, self.ledger.finished_load(replica_id))
        if pooled is not None:
            stats = dataclasses.replace(stats, step_coefficients=pooled[0],
                                        decode_coefficients=pooled[1])
        return score_candidate(query, stats, self.ledger.load(replica_id),
                               self.index.num_matched_blocks(replica_id, usable_hashes), now_s,
                               self.config, self._fallback_coefficients(), has_stats, freshest_age_s)

    def _book(self, query: RouteQuery, decision: RoutingDecision, block_hashes: list[int],
              now_s: float) -> None:
        chosen = decision.candidates[0]
        num_prompt = len(query.prompt_token_ids)
        num_blocks = -(-(num_prompt + 1) // self.block_size) - chosen.num_prefix_blocks
        self.ledger.add(InFlightRequest(
            request_id=query.request_id, replica_id=chosen.replica_id, routed_s=now_s,
            num_prompt_tokens=num_prompt, num_prefill_tokens=chosen.num_prefill_tokens,
            num_new_blocks=num_blocks))
        # The engine caches every full block it computes, the prompt's last one included.
        self.index.record_routed(chosen.replica_id, block_hashes)

    def _template(self) -> ReplicaStats | None:
        # Replicas of one deployment share an engine config: a new one is shaped like the others.
        return next(iter(self.stats.values()), None)

    def _pooled_coefficients(self) -> tuple[Coefficients, Coefficients] | None:
        """The mean of the replicas' fitted step and decode models (None: none fitted yet)."""
        fitted = [s for s in self.stats.values() if any(s.step_coefficients)]
        if not fitted:
            return None
        decode = [s.decode_coefficients for s in fitted if any(s.decode_coefficients)]
        step = _mean([s.step_coefficients for s in fitted])
        return step, _mean(decode) if decode else step

    def _fallback_coefficients(self) -> Coefficients:
        """A fitted model of another replica (same engine, same host type), else the config's prior."""
        for stats in self.stats.values():
            if any(stats.step_coefficients):
                return stats.step_coefficients
        return self.config.prior_coefficients


def without_finished(stats: ReplicaStats, finished: InFlightLoad) -> ReplicaStats:
    """A record less the requests that finished since it was measured: their seats, context, blocks
    and the prefill they still had to do there (a record taken mid-prefill would otherwise show a
    queue the replica no longer has). Whether each was waiting or running then is not known: seats
    come off the running first. A record counts a running request's prefill still to compute, but a
    waiting one's whole prompt (its cached prefix is found only when it is scheduled), so the
    waiting take their prompts off the waiting tokens."""
    num = finished.num_requests
    if not num:
        return stats
    num_running = min(num, stats.num_running)
    num_waiting = min(num - num_running, stats.num_waiting)
    running_prefill = min(finished.num_prefill_tokens, stats.num_running_prefill_tokens) if num_running else 0
    waiting_prompts = min(finished.num_prompt_tokens * num_waiting // num, stats.num_waiting_tokens)
    return dataclasses.replace(
        stats, num_running=stats.num_running - num_running,
        num_waiting=stats.num_waiting - num_waiting,
        num_waiting_requests=max(stats.num_waiting_requests - num_waiting, 0),
        num_running_tokens=max(stats.num_running_tokens - finished.num_prompt_tokens, 0),
        num_running_prefill_tokens=stats.num_running_prefill_tokens - running_prefill,
        num_waiting_tokens=stats.num_waiting_tokens - waiting_prompts,
        num_kv_blocks_free=min(stats.num_kv_blocks_free + finished.num_new_blocks, stats.num_kv_blocks))


def _mean(vectors: Sequence[Coefficients]) -> Coefficients:
    return tuple(sum(column) / len(vectors) for column in zip(*vectors))
