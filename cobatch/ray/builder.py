"""build_app: the Serve application -- one ingress (cobatch's OpenAI server) over N engine replicas.

    serve.run(cobatch.ray.build_app({"engine": {"model": ...}, "num_replicas": 2}), name="cobatch")

or in a Serve config file: `import_path: cobatch.ray:build_app` with the same dict as `args`.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cobatch.config import EngineConfig
from cobatch.ray.app_config import AppConfig
from cobatch.ray.ingress import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT, CobatchIngress
from cobatch.ray.replica import EngineReplica
from cobatch.server.cli import default_served_name

_ROUTER_CLASSES = {"cobatch": "cobatch.ray.router:CobatchRouter",
                   "round_robin": "cobatch.ray.router:RoundRobinRouter"}  # else Serve's power of two
_STATS_TIMEOUT_S = 2.0
_UNBOUNDED_ONGOING = 100_000  # Serve's per-replica cap, when the router's queue bound is off
_ONGOING_MARGIN = 16  # requests in transit (and migrated sequences) beyond the bound
_INGRESS_MAX_ONGOING = 100_000  # HTTP requests the one ingress replica holds at once
_HEALTH_CHECK_PERIOD_S = 5.0


def build_app(config: AppConfig | dict[str, Any]) -> Application:
    """The application for serve.run, or a YAML import_path (its `args` are this config)."""
    app_config = config if isinstance(config, AppConfig) else AppConfig.model_validate(config)
    engine_config = app_config.engine_config()
    served_name = app_config.served_model_name or default_served_name(engine_config.model)
    engine = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT,
                              **engine_deployment_options(app_config, engine_config))
    ingress = serve.deployment(CobatchIngress, name=INGRESS_DEPLOYMENT, num_replicas=1,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=_INGRESS_MAX_ONGOING)
    return ingress.bind(engine.bind(app_config, served_name), app_config, served_name)


def engine_deployment_options(config: AppConfig, engine_config: EngineConfig) -> dict[str, Any]:
    """The engine deployment's Serve options: replica count, CPUs, router, stats period, drain."""
    bound = config.max_queued_requests
    # Serve's own cap stays above what the router lets through (seats + queue bound): the router's
    # 429 is the gate, never Serve's silent wait for a free slot.
    max_ongoing = (_UNBOUNDED_ONGOING if bound is None
                   else engine_config.max_num_seqs + bound + _ONGOING_MARGIN)
    return {
        **config.replica_count_options(),
        "ray_actor_options": {"num_cpus": config.threads_per_replica()},
        "max_ongoing_requests": max_ongoing,
        "request_router_config": RequestRouterConfig(
            request_router_class=_ROUTER_CLASSES.get(
                config.router, "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"),
            request_router_kwargs={"block_size": engine_config.block_size}
            if config.router == "cobatch" else {},
            request_routing_stats_period_s=config.request_routing_stats_period_s,
            request_routing_stats_timeout_s=_STATS_TIMEOUT_S),
        "health_check_period_s": _HEALTH_CHECK_PERIOD_S,
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": config.shutdown_timeout_s,
    }
