"""Ray Serve RequestRouters: cobatch's own (a thin adapter on RoutingState), and round robin (a baseline).

Serve cloudpickles a router class's whole module by value into every process that holds a handle,
so this module stays thin: what it shares with the ingress (the ticket, the routing state) lives in
modules pickled by reference. Ray calls every hook and choose_replicas on one event loop per
router: no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import (PendingRequest, ReplicaID, RequestRouter,
                                      RunningReplica)

from cobatch.ray.routing_state import RoutingState
from cobatch.ray.scoring import ReplicaStats, RouterConfig
from cobatch.ray.ticket import RouteTicket

_MAX_TRACKED_REQUESTS = 65536  # routed requests awaiting on_request_completed (a cap against leaks)


def _ticket_of(pending_request: PendingRequest | None) -> RouteTicket | None:
    if pending_request is None or not pending_request.args:
        return None
    ticket = pending_request.args[0]
    return ticket if isinstance(ticket, RouteTicket) else None


class CobatchRouter(RequestRouter):
    """Per request: the replica of lowest predicted cost (cobatch.ray.scoring), told via the ticket."""

    def initialize_state(self, block_size: int = 16, **router_config: Any) -> None:
        self.state = RoutingState(block_size, RouterConfig(**router_config))
        self._request_of: OrderedDict[str, str] = OrderedDict()  # Ray's internal id -> ours

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """The replica set, re-broadcast on every change of any replica's routing stats."""
        super().update_replicas(replicas)
        for replica in replicas:
            if replica.routing_stats:
                self.state.update_stats(ReplicaStats.from_dict(replica.routing_stats))
        self.state.sync_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.state.remove_replica(replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._complete(internal_request_id)

    def _complete(self, internal_request_id: str) -> None:
        # Once per request: the ingress's early word (the ticket) or Serve's completion, which comes first.
        request_id = self._request_of.pop(internal_request_id, None)
        if request_id is not None:
            self.state.complete(request_id, time.time())

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        ticket = _ticket_of(pending_request)
        if ticket is None or pending_request is None:
            return [candidate_replicas]  # a control call (engine_info): Ray's queue-length rule
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        decision = self.state.decide(ticket.query, list(by_id), time.time())
        ticket.decision = decision
        if decision.chosen is None:
            # A refusal still names a replica (an empty answer makes Ray ask again forever): the
            # ingress reads the ticket and leaves choose_replica without dispatching.
            return [candidate_replicas[:1]]
        internal_request_id = pending_request.metadata.internal_request_id
        self._track(internal_request_id, ticket.query.request_id)
        loop = asyncio.get_running_loop()  # the ingress calls on_finished on its own loop's thread
        ticket.on_finished = lambda: _call_soon(loop, self._complete, internal_request_id)
        # One rank of one replica: a second rank would let Ray's own rule pick without a decision.
        return [[by_id[decision.chosen]]]

    def _track(self, internal_request_id: str, request_id: str) -> None:
        self._request_of[internal_request_id] = request_id
        while len(self._request_of) > _MAX_TRACKED_REQUESTS:
            self._request_of.popitem(last=False)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any, *args: object) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the router's loop is closed: shutting down
        pass


class RoundRobinRouter(RequestRouter):
    """Each request to the next replica in name order: the baseline that ignores load and prefixes."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._num_routed = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self._num_routed += 1
        return [[ordered[self._num_routed % len(ordered)]]]
