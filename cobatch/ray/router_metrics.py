"""The ingress's Prometheus metrics (routing decisions, migrations) and the merge of the replicas' own.

GET /metrics on the ingress answers one exposition: the router's families, then every replica's
engine families with their samples side by side (each replica labels its samples `replica=NAME`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from cobatch.ray.scoring import RoutingDecision

_ROUTING_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_TTFT_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    """What the ingress measures of its own routing, in a registry of its own."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry
        self.decisions = Counter("cobatch:router_decisions", "Routing decisions, by outcome.",
                                 ["model_name", "status"], registry=r)
        self.routed = Counter("cobatch:router_routed_requests", "Engine requests sent, by replica.",
                              ["model_name", "replica"], registry=r)
        self.migrations = Counter("cobatch:router_migrations", "Sequences moved off a lost replica.",
                                  ["model_name"], registry=r).labels(**labels)
        self.migration_failures = Counter(
            "cobatch:router_migration_failures", "Requests failed: no replica could take them over.",
            ["model_name"], registry=r).labels(**labels)
        self.prompt_tokens = Counter("cobatch:router_prompt_tokens", "Prompt tokens routed.",
                                     ["model_name"], registry=r).labels(**labels)
        self.predicted_cached_tokens = Counter(
            "cobatch:router_predicted_cached_tokens",
            "Prompt tokens the router expected in the chosen replica's prefix cache.",
            ["model_name"], registry=r).labels(**labels)
        self.routing_seconds = Histogram("cobatch:router_routing_seconds", "Time to choose a replica.",
                                         ["model_name"], buckets=_ROUTING_BUCKETS_S,
                                         registry=r).labels(**labels)
        self.predicted_ttft = Histogram(
            "cobatch:router_predicted_ttft_seconds", "The chosen replica's predicted time to first token.",
            ["model_name"], buckets=_TTFT_BUCKETS_S, registry=r).labels(**labels)
        self.live_requests = Gauge("cobatch:router_live_requests", "Client requests in flight.",
                                   ["model_name"], registry=r).labels(**labels)
        self._model_name = model_name

    def record_decision(self, decision: RoutingDecision | None, status: str, replica: str | None,
                        duration_s: float, block_size: int) -> None:
        """One choose_replica: its outcome, and what the router predicted for the chosen replica."""
        self.decisions.labels(model_name=self._model_name, status=status).inc()
        self.routing_seconds.observe(duration_s)
        if replica is None:
            return
        self.routed.labels(model_name=self._model_name, replica=replica).inc()
        if decision is None or not decision.candidates:
            return
        chosen = decision.candidates[0]
        self.prompt_tokens.inc(decision.num_prompt_tokens)
        self.predicted_cached_tokens.inc(chosen.num_prefix_blocks * block_size)
        self.predicted_ttft.observe(chosen.ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Families:
    """A collector that hands back parsed metric families (the replicas' expositions)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_expositions(texts: Iterable[bytes]) -> tuple[bytes, str]:
    """One exposition of several: a family's samples from each text, under one HELP/TYPE."""
    families: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            known = families.get(family.name)
            if known is None:
                families[family.name] = family
            else:
                known.samples.extend(family.samples)
    registry = CollectorRegistry()
    registry.register(_Families(families.values()))  # type: ignore[arg-type]
    return generate_latest(registry), CONTENT_TYPE_LATEST
