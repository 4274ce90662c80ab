"""Which requests reached a replica lately: listed in its stats records, so a router knows which of
the requests it routed there a record already counts (pure, no Ray).

A router cannot tell from clocks alone: on a busy host the actor call that carries a request can take
longer than a stats period, and a record measured before the request arrived does not count it.
"""

from __future__ import annotations

from collections import deque

# A record lists the arrivals of this many seconds before it: longer than a record takes to reach the
# routers (Serve's controller polls and re-broadcasts it), so no router misses a listing. A request
# routed this long before a record that does not list it never arrived in time: the router stops
# counting it (it completes, or fails, through its own call).
ARRIVALS_WINDOW_S = 5.0
MAX_LISTED_ARRIVALS = 4096  # a bound on a record's size at a very high request rate


class RecentArrivals:
    """The request ids that reached this replica within ARRIVALS_WINDOW_S, oldest first."""

    def __init__(self) -> None:
        self._arrivals: deque[tuple[float, str]] = deque(maxlen=MAX_LISTED_ARRIVALS)

    def add(self, request_id: str, now_s: float) -> None:
        self._arrivals.append((now_s, request_id))

    def listed(self, now_s: float) -> tuple[str, ...]:
        """What a record measured at `now_s` lists (older arrivals are forgotten)."""
        while self._arrivals and self._arrivals[0][0] < now_s - ARRIVALS_WINDOW_S:
            self._arrivals.popleft()
        return tuple(request_id for _, request_id in self._arrivals)
