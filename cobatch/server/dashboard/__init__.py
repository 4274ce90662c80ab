"""The live dashboard of `cobatch serve` (GET /dashboard): the metro view and the engine's state as it runs."""

from cobatch.server.dashboard.routes import add_dashboard_routes

__all__ = ["add_dashboard_routes"]
