"""`cobatch serve MODEL --replicas N`: a local Ray (or --ray-address), build_app on Serve, SIGTERM drain.

The first SIGTERM/SIGINT stops admission at the ingress (503) and waits up to --shutdown-timeout for
the requests in flight, then shuts Serve and Ray down (exit 0); a second one shuts down at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from types import FrameType

import ray
from ray import serve

from cobatch.config import EngineConfig
from cobatch.ray.app_config import AppConfig
from cobatch.ray.builder import build_app
from cobatch.server.settings import ServerSettings

logger = logging.getLogger("cobatch.server")

APP_NAME = "cobatch"
WORKER_NICENESS = "RAY_worker_niceness"  # read by the raylet a local ray.init starts
_DRAIN_SLACK_S = 10.0  # beyond --shutdown-timeout: the drain call's own round trip


def app_config_from_args(args: argparse.Namespace, engine_config: EngineConfig,
                         settings: ServerSettings) -> AppConfig:
    """The AppConfig `cobatch serve`'s flags describe (ValueError on bad values)."""
    return AppConfig(
        engine=dataclasses.asdict(engine_config), served_model_name=settings.served_model_name,
        num_replicas=args.replicas or args.min_replicas or 1, min_replicas=args.min_replicas,
        max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
        router=args.router, max_queued_requests=args.max_queued_requests, api_key=settings.api_key,
        max_body_mb=args.max_body_mb, watchdog_timeout_s=args.watchdog_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        enable_fault_injection=args.enable_fault_injection, disable_dashboard=args.disable_dashboard)


def run_replicated(args: argparse.Namespace, engine_config: EngineConfig,
                   settings: ServerSettings) -> int:
    """Serve on Ray until SIGTERM/SIGINT; 0 after draining, 1 if the app failed, 2 for bad flags."""
    try:
        app_config = app_config_from_args(args, engine_config, settings)
    except ValueError as exc:
        print(f"cobatch serve: error: {exc}", file=sys.stderr)
        return 2
    _start_ray(args.ray_address, app_config)
    stop = _StopSignals()  # after ray.init, which installs a SIGTERM handler of its own
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        handle = serve.run(build_app(app_config), name=APP_NAME, route_prefix="/")
        logger.info("cobatch ready: %d engine replicas of %s (%d threads each, %s router) -- serving "
                    "at http://%s:%d/v1", app_config.num_replicas, settings.served_model_name,
                    app_config.threads_per_replica(), app_config.router, args.host, args.port)
        stop.wait()
        if not stop.is_urgent:
            logger.info("shutting down: admission stopped; waiting up to %.0f s for requests in flight",
                        args.shutdown_timeout)
            num_aborted = handle.drain.remote(args.shutdown_timeout).result(
                timeout_s=args.shutdown_timeout + _DRAIN_SLACK_S)
            if num_aborted:
                logger.warning("shutdown timeout: aborted %d requests", num_aborted)
        return 0
    except KeyboardInterrupt:  # a second signal during the drain
        logger.info("second signal: shutting down now")
        return 0
    except Exception:  # noqa: BLE001 - deploying failed (a replica could not load the model, ...)
        logger.exception("cobatch serve: the replicated app failed")
        return 1
    finally:
        serve.shutdown()
        ray.shutdown()


def _start_ray(address: str | None, config: AppConfig) -> None:
    if address is not None:
        ray.init(address=address)
        return
    # Enough CPUs for every replica's threads (the ingress and Serve's own actors take none).
    num_replicas = config.max_replicas if config.is_autoscaling else config.num_replicas
    num_cpus = max(os.cpu_count() or 1, (num_replicas or 1) * config.threads_per_replica())
    # Ray runs its workers (our replicas, the ingress, the proxy) at nice 15 unless told: a server
    # would then yield its CPU to any other process on the host.
    os.environ.setdefault(WORKER_NICENESS, "0")
    ray.init(num_cpus=num_cpus, include_dashboard=False)


class _StopSignals:
    """SIGTERM/SIGINT: the first asks for a drain, a second for an immediate stop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.is_urgent = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        self.is_urgent = self._event.is_set()
        self._event.set()
        if self.is_urgent:
            raise KeyboardInterrupt  # out of a drain in progress: the finally shuts down now

    def wait(self) -> None:
        while not self._event.wait(0.5):  # a timed wait: signal handlers run in between
            pass
