"""Server-side settings (the HTTP front door's knobs; engine options live in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """What create_app needs besides the engine and the tokenizer."""

    served_model_name: str
    model_path: str | None = None
    api_key: str | None = None
    max_queued_requests: int | None = None  # None: unbounded waiting queue
    max_body_bytes: int = 8 * 1024 * 1024
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be non-empty")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")

    def __repr__(self) -> str:
        # The API key must never reach a log line, even through a repr.
        key = "set" if self.api_key else None
        return (f"ServerSettings(served_model_name={self.served_model_name!r}, api_key={key}, "
                f"max_queued_requests={self.max_queued_requests}, "
                f"max_body_bytes={self.max_body_bytes})")
