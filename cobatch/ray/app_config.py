"""AppConfig: everything build_app needs, as one pydantic model (a Serve YAML's `args` validate into it).

No Ray here: `cobatch serve --replicas` builds it from its flags before Ray is imported.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cobatch.config import EngineConfig

RouterName = Literal["cobatch", "power_of_two", "round_robin"]


class AppConfig(BaseModel):
    """One engine config for every replica, how many replicas, and the ingress's settings."""

    model_config = ConfigDict(extra="forbid")

    engine: dict[str, Any] = Field(default_factory=dict,
                                   description="EngineConfig fields (vLLM's names), for each replica")
    served_model_name: str | None = None
    num_replicas: int = Field(2, ge=1)
    # Autoscaling (Serve's autoscaling_config) when max_replicas is set; num_replicas is then the start.
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float | None = Field(None, gt=0)
    num_threads_per_replica: int | None = Field(None, ge=1, description="default: cores / replicas")
    router: RouterName = "cobatch"
    request_routing_stats_period_s: float = Field(0.5, gt=0)
    max_queued_requests: int | None = Field(None, ge=0, description="per replica: 429 when all are full")
    max_migrations: int = Field(3, ge=0, description="times one request may move to another replica")
    stream_interval_ms: float = Field(50.0, ge=0, description="a replica's token chunks after the first")
    api_key: str | None = None
    max_body_mb: float = Field(8.0, gt=0)
    watchdog_timeout_s: float = Field(60.0, gt=0)
    shutdown_timeout_s: float = Field(30.0, ge=0)
    enable_fault_injection: bool = False
    disable_dashboard: bool = False  # the live page at /dashboard, fed by every replica's steps

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        self.engine_config()  # ValueError (-> a validation error) for a bad engine option
        if self.max_replicas is not None and self.min_replicas is not None \
                and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self

    def engine_config(self) -> EngineConfig:
        """Each replica's EngineConfig, its thread count filled in."""
        return EngineConfig(**{**self.engine, "num_threads": self.threads_per_replica()})

    @property
    def is_autoscaling(self) -> bool:
        return self.max_replicas is not None

    def threads_per_replica(self) -> int:
        """The engine's threads and the replica's Ray CPUs: cores / replicas (the most it may run)."""
        if self.num_threads_per_replica is not None:
            return self.num_threads_per_replica
        if self.engine.get("num_threads"):
            return int(self.engine["num_threads"])
        num_replicas = self.max_replicas if self.is_autoscaling else self.num_replicas
        return max(1, (os.cpu_count() or 1) // max(num_replicas or 1, 1))

    def replica_count_options(self) -> dict[str, Any]:
        """Serve's num_replicas, or its autoscaling_config."""
        if not self.is_autoscaling:
            return {"num_replicas": self.num_replicas}
        autoscaling: dict[str, Any] = {"max_replicas": self.max_replicas,
                                       "min_replicas": self.min_replicas or 1,
                                       "initial_replicas": min(max(self.num_replicas,
                                                                   self.min_replicas or 1),
                                                               self.max_replicas)}
        if self.target_ongoing_requests is not None:
            autoscaling["target_ongoing_requests"] = self.target_ongoing_requests
        return {"autoscaling_config": autoscaling}
