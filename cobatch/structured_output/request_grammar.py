"""One sequence's place in its grammar: a copy of the compiled matcher, advanced by every accepted token."""

from __future__ import annotations

from concurrent.futures import Future

import llguidance


class RequestGrammar:
    """What the scheduler asks of a constrained sequence (is it compiled, has its grammar ended), and
    the matcher the step's mask is filled from. Survives preemption: recompute keeps the output tokens,
    so the matcher, which has consumed exactly those, stays where it is."""

    __slots__ = ("_compiled", "_matcher", "error")

    def __init__(self, compiled: Future[llguidance.LLMatcher]) -> None:
        self._compiled = compiled
        self._matcher: llguidance.LLMatcher | None = None
        self.error: str | None = None  # why the grammar failed (compile error, or a rejected token)

    @property
    def compiled(self) -> Future[llguidance.LLMatcher]:
        return self._compiled

    @property
    def is_ready(self) -> bool:
        """Compiled without error (a failed one is never scheduled: the engine ends it with the error)."""
        return self._compiled.done() and self._compiled.exception() is None

    @property
    def matcher(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            self._matcher = self._compiled.result().deep_copy()  # shares the compiled grammar
        return self._matcher

    def take_compile_error(self) -> str | None:
        """The compile's error once it is done (None while compiling or when it succeeded)."""
        if not self._compiled.done():
            return None
        exc = self._compiled.exception()
        if exc is not None:
            self.error = str(exc)
        return self.error

    def accept_token(self, token_id: int) -> None:
        """Advance past a sampled token (the mask allowed it; a rejection ends the sequence)."""
        matcher = self.matcher
        if not matcher.consume_token(token_id) and self.error is None:
            self.error = matcher.get_error() or f"token {token_id} rejected by the grammar"

    @property
    def is_terminated(self) -> bool:
        """The grammar allows no more tokens (complete), or the matcher is in error."""
        matcher = self.matcher
        return matcher.is_stopped() or matcher.is_error()
