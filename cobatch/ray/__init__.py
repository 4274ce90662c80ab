"""Several engine replicas behind one endpoint on Ray Serve, routed by each replica's own telemetry.

The routing core (prefix_index, inflight, scoring, routing_state) is pure Python and imports no Ray,
so it is tested without a cluster and this package imports without the `cobatch[ray]` extra; only
the Serve deployments and the RequestRouter adapter import `ray`, lazily.
"""
