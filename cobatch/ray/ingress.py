"""The HTTP ingress on Ray Serve: cobatch's own OpenAI server (create_app) over a RoutedEngine.

The same endpoints, errors, /metrics and /health as a single `cobatch serve`. Besides: each answer
names its replica (header x-cobatch-replica), GET /debug/routing lists the recent routing decisions,
/dashboard draws every replica's lanes (cobatch/ray/dashboard_feed.py),
and with fault injection POST /debug/fault also takes {"kind": "kill_replica", "replica": NAME}
(the replica's process ends at once) or names the one replica a fault is for.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from fastapi import FastAPI, Query
from ray import serve
from ray.serve.handle import DeploymentHandle

from cobatch.ray.app_config import AppConfig
from cobatch.ray.client import ROUTE_NOTE, RouteNote, RoutedEngine
from cobatch.ray.dashboard_feed import ReplicaFeeds
from cobatch.server.app import FaultRequest, create_app
from cobatch.server.middleware import ASGIApp, Message, Receive, Scope, Send
from cobatch.server.settings import ServerSettings
from cobatch.tokenizer import Tokenizer

ENGINE_DEPLOYMENT = "CobatchEngine"
INGRESS_DEPLOYMENT = "CobatchIngress"
REPLICA_HEADER = b"x-cobatch-replica"
KILL_REPLICA = "kill_replica"
_REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"  # + app#deployment#replica (Serve's actor names)
_SERVE_NAMESPACE = "serve"


class ReplicaHeaderMiddleware:
    """Adds x-cobatch-replica (the replica the request was routed to) to the response's headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        note = RouteNote()  # RoutedEngine.submit fills it in, in this request's context
        token = ROUTE_NOTE.set(note)

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start" and note.replica is not None:
                headers = [*message.get("headers", []), (REPLICA_HEADER, note.replica.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_named)
        finally:
            ROUTE_NOTE.reset(token)


@serve.ingress()
class CobatchIngress:
    """A Serve deployment class: the OpenAI server whose engine is the engine deployment."""

    def __init__(self, engine: DeploymentHandle, config: AppConfig, served_model_name: str) -> None:
        engine_config = config.engine_config()
        self.config = config
        self.engine = engine
        self.client = RoutedEngine(engine, served_model_name, engine_config.block_size,
                                   config.max_migrations, config.router)
        self.tokenizer = Tokenizer.load(engine_config.model)
        self.settings = ServerSettings(
            served_model_name=served_model_name, model_path=engine_config.model,
            api_key=config.api_key, max_body_bytes=int(config.max_body_mb * 1024 * 1024))

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this after __init__; the app's lifespan starts and stops the client."""
        app = create_app(self.client, self.tokenizer, self.settings,
                         inject_fault=self._inject_fault if self.config.enable_fault_injection else None,
                         dashboard=None if self.config.disable_dashboard else ReplicaFeeds(self.engine))

        @app.get("/debug/routing")
        async def routing(limit: int = Query(50, ge=1, le=256)) -> dict[str, Any]:
            """The latest routing decisions, newest last: candidates, predictions, the reason."""
            return {"router": self.config.router,
                    "decisions": list(self.client.decisions)[-limit:]}

        app.add_middleware(ReplicaHeaderMiddleware)  # type: ignore[arg-type]
        return app

    async def drain(self, timeout_s: float) -> int:
        """Stop admission and wait (bounded) for live requests; returns how many were aborted."""
        return await self.client.drain(timeout_s)

    async def _inject_fault(self, req: FaultRequest) -> None:
        if req.kind == KILL_REPLICA:
            if req.replica is None:
                raise ValueError("kill_replica needs the replica's name (as in x-cobatch-replica)")
            await asyncio.to_thread(self._kill_replica, req.replica)
            return
        results = await self.engine.broadcast(
            "inject_fault", req.kind, req.seconds, req.num_steps, req.replica
        ).results_async(return_exceptions=True)
        # A bad fault is a ValueError on every replica; a replica lost meanwhile is no answer at all.
        errors = [getattr(r, "cause", r) for r in results if isinstance(r, BaseException)]
        bad = [e for e in errors if isinstance(e, ValueError)]
        if bad:
            raise ValueError(str(bad[0]))
        if req.replica is not None and True not in results:
            raise ValueError(f"no engine replica is named {req.replica!r}")

    def _kill_replica(self, name: str) -> None:
        app_name = serve.get_replica_context().app_name
        actor_name = f"{_REPLICA_ACTOR_PREFIX}{app_name}#{ENGINE_DEPLOYMENT}#{name}"
        try:
            actor = ray.get_actor(actor_name, namespace=_SERVE_NAMESPACE)
        except ValueError:
            raise ValueError(f"no engine replica is named {name!r}") from None
        ray.kill(actor, no_restart=True)
