"""create_app: the OpenAI-compatible HTTP API over an engine (an AsyncEngine, or replicas behind a router)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from cobatch.server.dashboard import add_dashboard_routes
from cobatch.server.engine_client import EngineClient
from cobatch.server.errors import APIError, bad_request, install_error_handlers
from cobatch.server.frontdoor import ServingContext
from cobatch.server.middleware import FrontDoorMiddleware
from cobatch.server.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                     CompletionRequest, CompletionResponse, DetokenizeRequest,
                                     DetokenizeResponse, ErrorResponse, ModelCard, ModelList,
                                     TokenizeRequest, TokenizeResponse)
from cobatch.server.request_status import add_request_status_route
from cobatch.server.serving_chat import create_chat_completion, render_messages
from cobatch.server.serving_completion import create_completion
from cobatch.server.settings import ServerSettings
from cobatch.server.streaming import ClientDisconnected
from cobatch.step_history import StepHistory
from cobatch.tokenizer import Tokenizer

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}


class FaultRequest(BaseModel):
    """Test-only: which fault to inject into the engine (kinds: cobatch/testing/faults.py).

    Behind the Ray ingress, `replica` names one replica (as the x-cobatch-replica header does), and
    the kind "kill_replica" ends that replica's process.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    kind: str
    seconds: float = Field(0.0, ge=0.0, le=600.0)
    num_steps: int = Field(1, ge=1, le=1_000_000)
    replica: str | None = Field(None, max_length=256)


FaultHandler = Callable[[FaultRequest], Awaitable[None]]  # raises ValueError for a bad request


def create_app(async_engine: EngineClient, tokenizer: Tokenizer, settings: ServerSettings,
               inject_fault: FaultHandler | None = None,
               dashboard: Mapping[str, StepHistory] | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and stops it at shutdown.

    `inject_fault` (test-only: serve --enable-fault-injection) adds POST /debug/fault; `dashboard`
    (replica name -> its step history) adds the live page at /dashboard.
    """
    ctx = ServingContext(async_engine, tokenizer, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not async_engine.is_started:
            async_engine.start()
        yield
        await async_engine.shutdown()

    app = FastAPI(title="cobatch", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server over a continuous-batching engine.")
    install_error_handlers(app)
    app.add_middleware(FrontDoorMiddleware, settings=settings)  # type: ignore[arg-type]

    @app.exception_handler(ClientDisconnected)
    async def _disconnected(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: the client is gone

    _add_generation_routes(app, ctx)
    _add_info_routes(app, ctx)
    add_request_status_route(app, async_engine)
    if inject_fault is not None:
        _add_fault_route(app, inject_fault)
    if dashboard is not None:
        add_dashboard_routes(app, async_engine, dashboard)
    return app


def _add_generation_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/completions", response_model=None, responses={
        200: {"model": CompletionResponse, "description": "JSON, or text/event-stream chunks"},
        **_ERRORS})
    async def completions(req: CompletionRequest, raw: Request) -> Response | CompletionResponse:
        """OpenAI completions (stream or not)."""
        return _json(await create_completion(ctx, req, raw))

    @app.post("/v1/chat/completions", response_model=None, responses={
        200: {"model": ChatCompletionResponse, "description": "JSON, or text/event-stream chunks"},
        **_ERRORS})
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        """OpenAI chat completions (stream or not)."""
        return _json(await create_chat_completion(ctx, req, raw))


def _json(result: BaseModel | StreamingResponse) -> Response:
    if isinstance(result, StreamingResponse):
        return result
    return Response(result.model_dump_json(), media_type="application/json")


def _add_info_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        """The one model this server serves."""
        info = ctx.async_engine.info
        return ModelList(data=[ModelCard(id=ctx.settings.served_model_name,
                                         root=ctx.settings.model_path,
                                         max_model_len=info.max_model_len if info else None)])

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> JSONResponse:
        """200 while the engine is ready and making progress; 503 otherwise."""
        engine = ctx.async_engine
        if engine.is_ready and not engine.is_stalled:
            return JSONResponse({"status": "ok"})
        reason = "stalled" if engine.is_stalled else engine.state.value
        raise APIError(503, f"the engine is {reason}", code="service_unavailable")

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus exposition."""
        rendered = await ctx.async_engine.render_metrics()
        if rendered is None:
            return Response("", media_type="text/plain")
        body, content_type = rendered
        return Response(body, media_type=content_type)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        """A prompt (or chat messages) -> token ids."""
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            ids = render_messages(ctx, req.messages, req.add_generation_prompt)
        else:
            ids = ctx.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        info = ctx.async_engine.info
        return TokenizeResponse(count=len(ids), tokens=ids,
                                max_model_len=info.max_model_len if info else 0)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        """Token ids -> text."""
        ctx.check_model(req.model)
        ctx.check_token_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens))


def _add_fault_route(app: FastAPI, inject_fault: FaultHandler) -> None:
    @app.post("/debug/fault", include_in_schema=False)
    async def fault(req: FaultRequest) -> JSONResponse:
        """Test-only (--enable-fault-injection): fail or slow the next steps, or kill the engine."""
        try:
            await inject_fault(req)
        except ValueError as exc:
            raise bad_request(str(exc), "kind") from None
        return JSONResponse({"injected": req.kind})
