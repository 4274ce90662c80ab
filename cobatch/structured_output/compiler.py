"""Grammars compiled off the engine thread, once per distinct constraint: futures in a bounded cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance

from cobatch.sampling_params import StructuredOutputsParams
from cobatch.structured_output.backend import GrammarBackend
from cobatch.structured_output.grammar_spec import check_grammar

_DEFAULT_CACHE_SIZE = 512  # distinct constraints kept compiled (each a few hundred KB at most)


class GrammarCompiler:
    """Builds the backend, then compiles on its own thread; the engine thread only looks at futures."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], max_workers: int = 1,
                 cache_size: int = _DEFAULT_CACHE_SIZE) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="cobatch-grammar")
        self._backend: Future[GrammarBackend] = self._pool.submit(make_backend)
        self._cache: OrderedDict[tuple[Any, ...], Future[llguidance.LLMatcher]] = OrderedDict()
        self._cache_size = cache_size
        self.num_compiles = 0  # cache misses: compiles started

    @property
    def backend(self) -> Future[GrammarBackend]:
        return self._backend

    def get(self, params: StructuredOutputsParams) -> Future[llguidance.LLMatcher]:
        """The compiled grammar of `params` (a future: done at once on a cache hit)."""
        key = params.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, params)
        self.num_compiles += 1
        self._cache[key] = future
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        matcher = self._backend.result().compile(check_grammar(params))
        matcher.compute_bitmask()  # llguidance builds lexer states lazily: the first mask's here, not on the engine thread
        return matcher

    def shutdown(self) -> None:
        """Stop the pool (compiles in flight finish; nothing new starts)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
