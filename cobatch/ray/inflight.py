"""The router's own ledger of the requests it routed, against what a replica's last stats record shows.

Stats arrive every ~0.5 s; decisions come in bursts. Without this ledger every decision in a burst
would see the same "idle" snapshot and pick the same replica (herding). An entry counts as load on
its replica until a stats record that lists its arrival (cobatch.ray.arrivals), or its completion,
retires it; a request that finishes after a record showed it is taken off that record until a newer
one arrives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from cobatch.ray.arrivals import ARRIVALS_WINDOW_S


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
    """Routed requests a replica's stats may misstate, per replica, both ways.

    *Unreported*: routed, but not in a stats record yet (they count as extra load). *Finished*: in the
    last record, but done since (their load is taken off the record, so a replica that just emptied
    does not look busy for the rest of a stats period).
    """

    def __init__(self, max_reported: int = 65536) -> None:
        self._by_replica: dict[str, dict[str, InFlightRequest]] = {}  # unreported
        self._replica_of: dict[str, str] = {}  # request id -> replica id, of the unreported
        self._reported: OrderedDict[str, InFlightRequest] = OrderedDict()  # in stats, not done yet
        # replica -> (when it finished, whether a record had shown it then, what)
        self._finished: dict[str, list[tuple[float, bool, InFlightRequest]]] = {}
        self._last_listed: dict[str, frozenset[str]] = {}  # replica -> its last record's arrivals
        self._max_reported = max_reported  # a request routed but never dispatched never completes

    def add(self, request: InFlightRequest) -> None:
        """Record a decision; a re-route of the same request (a retry) replaces the earlier one."""
        self._drop(request.request_id)
        self._by_replica.setdefault(request.replica_id, {})[request.request_id] = request
        self._replica_of[request.request_id] = request.replica_id

    def complete(self, request_id: str, now_s: float) -> None:
        """The request is done: no more load, and off its replica's records measured before now.

        Kept whether or not a record has shown it yet: records reach the router late (through
        Serve's controller), so one measured mid-prefill may arrive after the request finished.
        """
        request = self._reported.get(request_id)
        was_reported = request is not None
        if request is None and request_id in self._replica_of:
            request = self._by_replica[self._replica_of[request_id]][request_id]
        if request is not None:
            finished = self._finished.setdefault(request.replica_id, [])
            finished.append((now_s, was_reported, request))
            del finished[:-self._max_reported]  # a replica that never reports again
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        replica_id = self._replica_of.pop(request_id, None)
        if replica_id is not None:
            self._by_replica.get(replica_id, {}).pop(request_id, None)
        self._reported.pop(request_id, None)

    def retire_reflected(self, replica_id: str, stats_time_s: float, arrivals: Collection[str]) -> None:
        """A record measured at `stats_time_s` counts the requests it lists as arrived, and no longer
        counts the ones that finished before it. One routed a whole arrivals window before it and
        not listed never arrived in time: it is no longer counted either."""
        listed = frozenset(arrivals)
        self._last_listed[replica_id] = listed
        entries = self._by_replica.get(replica_id, {})
        for request_id in [rid for rid in entries if rid in listed]:
            self._reported[request_id] = entries.pop(request_id)
            del self._replica_of[request_id]
        for request_id in [rid for rid, r in entries.items()
                           if r.routed_s + ARRIVALS_WINDOW_S <= stats_time_s]:
            self._drop(request_id)
        while len(self._reported) > self._max_reported:
            self._reported.popitem(last=False)
        finished = self._finished.get(replica_id)
        if finished:
            finished[:] = [entry for entry in finished if entry[0] > stats_time_s]

    @property
    def replica_ids(self) -> set[str]:
        return set(self._by_replica) | {r for r, done in self._finished.items() if done}

    def load(self, replica_id: str) -> InFlightLoad:
        """What the replica's last record does not show yet."""
        return total_load(self._by_replica.get(replica_id, {}).values())

    def finished_load(self, replica_id: str) -> InFlightLoad:
        """What the replica's last record shows but has finished since: the requests it lists, or an
        earlier one did, that finished after it was measured."""
        listed = self._last_listed.get(replica_id, frozenset())
        return total_load(r for _, was_reported, r in self._finished.get(replica_id, ())
                          if was_reported or r.request_id in listed)

    def remove_replica(self, replica_id: str) -> list[InFlightRequest]:
        """Forget a dead replica's entries; returns the unreported ones (the requests heading there)."""
        entries = list(self._by_replica.pop(replica_id, {}).values())
        for request in entries:
            self._replica_of.pop(request.request_id, None)
        for request_id in [rid for rid, r in self._reported.items() if r.replica_id == replica_id]:
            del self._reported[request_id]
        self._finished.pop(replica_id, None)
        self._last_listed.pop(replica_id, None)
        return entries

    def __len__(self) -> int:
        return len(self._replica_of)
