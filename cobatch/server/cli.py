"""`cobatch serve`: flags in vllm-serve's shape, the start-up banner, SIGTERM drain, exit codes.

Exit codes: 0 after a graceful shutdown, 1 when the engine died (so a supervisor restarts it),
2 for bad arguments. Heavy imports (uvicorn, fastapi, the tokenizer) wait until run_serve, so
`cobatch --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from cobatch import config_cli
from cobatch.config import EngineConfig

if TYPE_CHECKING:
    from cobatch.async_engine import EngineInfo
    from cobatch.server.app import FaultHandler, FaultRequest
    from cobatch.server.draining_server import DrainingServer
    from cobatch.server.settings import ServerSettings
    from cobatch.testing.faults import FaultInjector
    from cobatch.tracing import RequestTracer

logger = logging.getLogger("cobatch.server")

_DEATH_EXIT_DELAY_S = 2.0  # after the engine dies: time to answer 503s and fail streams cleanly


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `serve`'s flags (vLLM's names) to `parser`."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF folder or .gguf file (default: the bundled SmolLM2-135M-Instruct); "
                             "the same as --model")
    _add_http_arguments(parser)
    _add_replica_arguments(parser)
    config_cli.add_engine_args(parser)


def _add_http_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--served-model-name", default=None, help="the model name clients use (default: from MODEL)")
    add("--api-key", default=os.environ.get("COBATCH_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $COBATCH_API_KEY)")
    add("--max-queued-requests", type=int, default=None,
        help="answer 429 + Retry-After while this many requests wait (default: unbounded)")
    add("--shutdown-timeout", type=float, default=30.0,
        help="seconds SIGTERM waits for in-flight requests before aborting them")
    add("--watchdog-timeout", type=float, default=60.0,
        help="/health turns 503 when a step, or live work without progress, lasts this long (s)")
    add("--max-body-mb", type=float, default=8.0, help="request-body limit (413 above it)")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add("--enable-fault-injection", action="store_true",
        help="test-only: POST /debug/fault makes the engine fail, stall or die")
    add("--disable-dashboard", action="store_true",
        help="do not serve the live page at /dashboard (request ids and timings, no text; no API key)")
    add("--otlp-traces-endpoint", default=None, metavar="URL",
        help="export one OpenTelemetry span tree per request to this OTLP/HTTP collector, e.g. "
             "http://localhost:4318 (needs cobatch[otel]; default: no tracing)")


def _add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "replicas", "several engines behind this endpoint on Ray Serve (the cobatch[ray] extra); "
        "every engine flag applies to each replica, --max-queued-requests to each replica's queue")
    add = group.add_argument
    add("--replicas", type=int, default=None,
        help="engine replicas (default: one engine in this process, no Ray); with --max-replicas, "
             "the number to start with")
    add("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    add("--min-replicas", type=int, default=None, help="autoscaling: the fewest replicas")
    add("--max-replicas", type=int, default=None,
        help="autoscale up to this many replicas (Serve's autoscaling_config)")
    add("--target-ongoing-requests", type=float, default=None,
        help="autoscaling: the ongoing requests per replica Serve aims at")
    add("--router", default="cobatch", choices=["cobatch", "power_of_two", "round_robin"],
        help="how the ingress picks a replica: cobatch's cost model, Ray's power of two "
             "choices, or round robin")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the parsed flags (ValueError on bad values); the positional MODEL wins."""
    return config_cli.engine_config_from_args(args, model=args.model_tag or args.model)


def default_served_name(model: str | None) -> str:
    from cobatch.model_paths import resolve_model_path

    path = resolve_model_path(model)
    # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct": the quantization is not the name.
    return path.name.split(".")[0] if path.is_file() else Path(path).name


@dataclass(slots=True)
class _ExitState:
    """How the process ends: set by the death callback, read after uvicorn returns."""

    code: int = 0


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (exit 0 after draining) or engine death (exit 1)."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        served_name = args.served_model_name or default_served_name(config.model)
        settings = _settings(args, config, served_name)
    except (ValueError, FileNotFoundError) as exc:
        print(f"cobatch serve: error: {exc}", file=sys.stderr)
        return 2
    if args.replicas is not None or args.max_replicas is not None:
        from cobatch.ray.launch import run_replicated  # imports Ray: only for --replicas

        return run_replicated(args, config, settings)
    return _serve(args, config, settings)


def _settings(args: argparse.Namespace, config: EngineConfig, served_name: str) -> ServerSettings:
    from cobatch.server.settings import ServerSettings

    return ServerSettings(
        served_model_name=served_name, model_path=config.model, api_key=args.api_key,
        max_queued_requests=args.max_queued_requests,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024))


def _fault_injector(enabled: bool) -> FaultInjector | None:
    """Test-only `--enable-fault-injection`: the one place production code imports cobatch.testing."""
    if not enabled:
        return None
    from cobatch.testing.faults import FaultInjector

    return FaultInjector()


def _fault_handler(faults: FaultInjector) -> FaultHandler:
    """POST /debug/fault on one engine: into the injector's queue (there is no replica to name)."""
    async def inject(req: FaultRequest) -> None:
        if req.replica is not None:
            raise ValueError("this server runs one engine: there is no replica to name")
        faults.inject(req.kind, req.seconds, req.num_steps)  # thread-safe: a queue to the runner

    return inject


def _tracer(endpoint: str | None, model_name: str) -> RequestTracer | None | Literal[False]:
    """`--otlp-traces-endpoint`: a tracer, None when off, False (reported) without cobatch[otel]."""
    if endpoint is None:
        return None
    try:
        from cobatch.tracing import build_tracer

        return build_tracer(endpoint, model_name)
    except ImportError as exc:
        print(f"cobatch serve: error: --otlp-traces-endpoint needs OpenTelemetry "
              f"(pip install 'cobatch[otel]'): {exc}", file=sys.stderr)
        return False


def _serve(args: argparse.Namespace, config: EngineConfig, settings: ServerSettings) -> int:
    import uvicorn

    from cobatch.async_engine import AsyncEngine
    from cobatch.metrics import EngineMetrics
    from cobatch.server.app import create_app
    from cobatch.server.draining_server import DrainingServer
    from cobatch.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.load(config.model)
    except (OSError, ValueError) as exc:
        print(f"cobatch serve: error: cannot load the tokenizer: {exc}", file=sys.stderr)
        return 2
    exit_state = _ExitState()
    holder: dict[str, DrainingServer] = {}  # the server exists only after the engine callbacks are built
    name = settings.served_model_name
    url = f"http://{args.host}:{args.port}/v1"
    faults = _fault_injector(args.enable_fault_injection)  # wraps the runner; POST /debug/fault feeds it
    tracer = _tracer(args.otlp_traces_endpoint, name)
    if tracer is False:
        return 2
    async_engine = AsyncEngine.from_config(
        config, wrap_runner=faults.wrap if faults else None, tokenizer=tokenizer,
        metrics=EngineMetrics(name), watchdog_timeout_s=args.watchdog_timeout,
        on_ready=lambda info: _banner(name, info, url, settings),
        on_dead=lambda reason: _on_dead(reason, exit_state, holder["server"]),
        on_finished=tracer.on_finished if tracer else None)
    app = create_app(async_engine, tokenizer, settings,
                     inject_fault=_fault_handler(faults) if faults else None,
                     dashboard=None if args.disable_dashboard else {"engine": async_engine.history})
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_config=None,
                                    access_log=False, lifespan="on",
                                    timeout_graceful_shutdown=5),
                     async_engine, args.shutdown_timeout)
    holder["server"] = server
    logger.info("cobatch: loading %s ...", name)
    server.run()
    if tracer:
        tracer.shutdown()  # the last spans leave before the process does
    if not server.started and exit_state.code == 0:
        return 1  # could not bind the port, or the lifespan failed
    return exit_state.code


def _banner(name: str, info: EngineInfo, url: str, settings: ServerSettings) -> None:
    key = "required" if settings.api_key else "off"
    logger.info(
        "cobatch ready: model %s, dtype %s, KV cache %d blocks x %d tokens (%d tokens), max "
        "concurrency %.2f sequences of %d tokens, max_num_seqs %d, API key %s -- serving at %s",
        name, info.dtype, info.num_kv_blocks, info.block_size, info.num_kv_blocks * info.block_size,
        info.max_concurrency, info.max_model_len, info.max_num_seqs, key, url)


def _on_dead(reason: str, exit_state: _ExitState, server: DrainingServer) -> None:
    logger.error("engine dead (%s): exiting in %.0f s with status 1", reason, _DEATH_EXIT_DELAY_S)
    exit_state.code = 1
    asyncio.get_running_loop().call_later(_DEATH_EXIT_DELAY_S, server.exit_now)


def main(argv: list[str] | None = None) -> int:
    """`python -m cobatch.server.cli [MODEL] [flags]`: the same as `cobatch serve`."""
    parser = argparse.ArgumentParser(prog="cobatch serve", description=__doc__)
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
