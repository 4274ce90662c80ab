"""cobatch: an LLM serving engine built on continuous batching over a paged KV cache.

The offline API has vLLM's shape at the package root::

    from cobatch import LLM, SamplingParams
    outputs = LLM().generate(["The capital of France is"], SamplingParams(max_tokens=16))

Names are imported on first use (PEP 562), so `import cobatch` and `cobatch --help` do not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cobatch.config import EngineConfig
    from cobatch.llm import LLM
    from cobatch.outputs import CompletionOutput, RequestOutput
    from cobatch.sampling_params import SamplingParams, StructuredOutputsParams

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "LLM": "cobatch.llm",
    "SamplingParams": "cobatch.sampling_params",
    "StructuredOutputsParams": "cobatch.sampling_params",
    "EngineConfig": "cobatch.config",
    "RequestOutput": "cobatch.outputs",
    "CompletionOutput": "cobatch.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cobatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
