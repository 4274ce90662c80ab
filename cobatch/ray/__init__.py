"""Several engine replicas behind one endpoint on Ray Serve, routed by each replica's own telemetry.

`cobatch.ray.build_app(config)` returns the Serve application (serve.run, or a YAML import_path
`cobatch.ray:build_app`). The routing core (prefix_index, inflight, scoring, routing_state) is pure
Python and imports no Ray, so it is tested without a cluster; `import cobatch.ray` imports nothing,
and build_app is loaded (with Ray) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cobatch.ray.builder import build_app

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from cobatch.ray.builder import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
