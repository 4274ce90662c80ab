"""The routing ticket: what the ingress hands the router with a request, and the decision it gets back.

Ray Serve gives RequestRouter.choose_replicas the caller's own argument objects (the router runs in
the caller's process), so the ingress passes a ticket as the argument of `choose_replica` and reads
the router's decision from it once a replica is chosen. It is the router's only way to refuse a
request (Ray asks again, forever, when choose_replicas returns no replica) and to explain a choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cobatch.ray.scoring import RouteQuery, RoutingDecision


@dataclass(slots=True)
class RouteTicket:
    """One routing question; `decision` is written by the cobatch router (Ray's own routers leave None)."""

    query: RouteQuery
    decision: RoutingDecision | None = None
    # Set by the cobatch router: tells it, from any thread, that the request finished on its replica.
    # The ingress sees the last delta before Serve reports the call complete, and a client that sends
    # its next request at once would otherwise be routed as if this one still ran.
    on_finished: Callable[[], None] | None = None
