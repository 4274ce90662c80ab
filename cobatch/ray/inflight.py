"""The router's own ledger of requests it routed that a replica's last stats record does not show yet.

Stats arrive every ~0.5 s; decisions come in bursts. Without this ledger every decision in a burst
would see the same "idle" snapshot and pick the same replica (herding). An entry counts as load on
its replica until a stats record measured after it arrived there, or its completion, retires it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# A routed request reaches its replica's scheduler a little after the decision (one actor call); a
# record measured within this margin after the decision may not include it yet, so it stays counted.
ARRIVAL_MARGIN_S = 0.05


@dataclass(frozen=True, slots=True)
class InFlightRequest:
    """What one routed request will add to its replica: queue tokens, KV blocks, a decode row."""

    request_id: str
    replica_id: str
    routed_s: float  # router wall clock (time.time()) at the decision
    num_prompt_tokens: int
    num_prefill_tokens: int  # of which not expected in the replica's prefix cache
    num_new_blocks: int  # KV blocks it will take beyond the cached prefix


@dataclass(frozen=True, slots=True)
class InFlightLoad:
    """The sum of a replica's unreflected routed requests."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_prefill_tokens: int = 0
    num_new_blocks: int = 0


def total_load(requests: Iterable[InFlightRequest]) -> InFlightLoad:
    entries = list(requests)
    return InFlightLoad(num_requests=len(entries),
                        num_prompt_tokens=sum(r.num_prompt_tokens for r in entries),
                        num_prefill_tokens=sum(r.num_prefill_tokens for r in entries),
                        num_new_blocks=sum(r.num_new_blocks for r in entries))


class InFlightLedger:
    """Routed-but-not-yet-reported requests, per replica."""

    def __init__(self) -> None:
        self._by_replica: dict[str, dict[str, InFlightRequest]] = {}
        self._replica_of: dict[str, str] = {}  # request id -> replica id

    def add(self, request: InFlightRequest) -> None:
        """Record a decision; a re-route of the same request (a retry) replaces the earlier one."""
        self.complete(request.request_id)
        self._by_replica.setdefault(request.replica_id, {})[request.request_id] = request
        self._replica_of[request.request_id] = request.replica_id

    def complete(self, request_id: str) -> None:
        replica_id = self._replica_of.pop(request_id, None)
        if replica_id is not None:
            self._by_replica.get(replica_id, {}).pop(request_id, None)

    def retire_reflected(self, replica_id: str, stats_time_s: float) -> None:
        """Drop the entries a stats record measured at `stats_time_s` already counts."""
        entries = self._by_replica.get(replica_id, {})
        for request_id in [rid for rid, r in entries.items()
                           if r.routed_s + ARRIVAL_MARGIN_S <= stats_time_s]:
            del entries[request_id]
            del self._replica_of[request_id]

    @property
    def replica_ids(self) -> set[str]:
        return set(self._by_replica)

    def load(self, replica_id: str) -> InFlightLoad:
        return total_load(self._by_replica.get(replica_id, {}).values())

    def remove_replica(self, replica_id: str) -> list[InFlightRequest]:
        """Forget a dead replica's entries; returns them (the requests that were heading there)."""
        entries = list(self._by_replica.pop(replica_id, {}).values())
        for request in entries:
            self._replica_of.pop(request.request_id, None)
        return entries

    def __len__(self) -> int:
        return len(self._replica_of)
