"""What crosses between the ingress and an engine replica: plain picklable data, no Ray.

    ingress --GenerateCall--> replica.generate --chunks--> ingress
    a chunk is a list of RequestDeltas (the first alone, at once), or one ReplicaError as the last item

A replica reports failures as data, not as exceptions through Ray: the ingress must tell an engine that
died (the request moves to another replica) from a request that failed (it fails, as on one server).
"""

from __future__ import annotations

from dataclasses import dataclass

from cobatch.outputs import RequestDelta
from cobatch.sampling_params import SamplingParams

ENGINE_DEAD = "engine_dead"  # the replica's engine is gone: its requests continue elsewhere
REQUEST_FAILED = "request_failed"  # a step failed under the request (RequestFailedError)
REQUEST_REJECTED = "request_rejected"  # the engine refused it at admission (RequestRejectedError)


@dataclass(frozen=True, slots=True)
class GenerateCall:
    """One engine request on a replica (a client request, or a migrated part of one)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaError:
    """Why a replica's generate ended without finishing its sequences."""

    kind: str  # ENGINE_DEAD, REQUEST_FAILED or REQUEST_REJECTED
    message: str


Chunk = list[RequestDelta] | ReplicaError
