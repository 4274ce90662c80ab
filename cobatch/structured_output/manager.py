"""What the engine calls: a grammar per constrained sequence, the compile failures, each step's masks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

from cobatch.sampling_params import StructuredOutputsParams
from cobatch.scheduler_output import ScheduledRow
from cobatch.structured_output.backend import GrammarBackend
from cobatch.structured_output.compiler import GrammarCompiler
from cobatch.structured_output.request_grammar import RequestGrammar

if TYPE_CHECKING:
    from cobatch.structured_output.bitmask import GrammarBitmask
    from cobatch.tokenizer import Tokenizer


def load_backend(model: str | None, eos_token_ids: tuple[int, ...],
                 tokenizer: Tokenizer | None = None) -> Callable[[], GrammarBackend]:
    """A loader of the backend for `model`'s tokenizer (run on the compiler's thread): `tokenizer` when
    the caller has loaded it already (a server has: loading a GGUF's again takes seconds)."""
    def make() -> GrammarBackend:
        from cobatch.tokenizer import Tokenizer  # transformers: only once someone asks for a grammar

        return GrammarBackend((tokenizer or Tokenizer.load(model)).hf, eos_token_ids)
    return make


class StructuredOutputManager:
    """Owned by the engine (its thread only). The compiler, its backend, and the sequences still compiling."""

    def __init__(self, make_backend: Callable[[], GrammarBackend]) -> None:
        self._make_backend = make_backend
        self._compiler: GrammarCompiler | None = None  # started on first use (or warm_up)
        self._pending: dict[str, RequestGrammar] = {}  # sequence id -> its grammar, until compiled

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self._make_backend)
        return self._compiler

    def warm_up(self) -> None:
        """Build the tokenizer info now and wait for it (a server does, before it is ready).

        Why wait: built beside the first steps, it held the GIL for seconds and made them ~100x slower,
        which the step-time model then learned as per-token cost (429s for reachable deadlines). A
        failed build is not raised here: it fails each constrained request, as on first use.
        """
        wait([self.compiler.backend])

    def grammar_for(self, seq_id: str, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh grammar state for one sequence (its compile is shared, cached by constraint)."""
        grammar = RequestGrammar(self.compiler.get(params))
        self._pending[seq_id] = grammar  # until take_compile_errors sees it done (at once on a cache hit)
        return grammar

    def take_compile_errors(self) -> list[tuple[str, str]]:
        """(sequence id, error) of compiles that failed since the last call; forgets finished compiles."""
        failed = []
        for seq_id, grammar in list(self._pending.items()):
            if grammar.compiled.done():
                del self._pending[seq_id]
                error = grammar.take_compile_error()
                if error is not None:
                    failed.append((seq_id, error))
        return failed

    def forget(self, seq_id: str) -> None:
        self._pending.pop(seq_id, None)

    @property
    def is_active(self) -> bool:
        """Someone has asked for a grammar (until then a step costs nothing here)."""
        return self._compiler is not None

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait_for_compile(self, timeout_s: float) -> None:
        """Block until a pending compile ends, at most timeout_s (a step with nothing else to run)."""
        futures = [g.compiled for g in self._pending.values()]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def bitmask(self, rows: Sequence[ScheduledRow],
                grammar_of: Callable[[str], RequestGrammar | None]) -> GrammarBitmask | None:
        """The step's masks for every sampled constrained row (None: no row is constrained).

        Logit rows follow the runner's order: each row's num_samples, in row order (a constrained row has
        no drafts, so one)."""
        matchers, logit_rows, position = [], [], 0
        for row in rows:
            grammar = grammar_of(row.request_id) if row.num_samples and not row.is_padding else None
            if grammar is not None:
                assert row.num_samples == 1, "speculative drafts on a constrained row"
                matchers.append(grammar.matcher)
                logit_rows.append(position)
            position += row.num_samples
        if not matchers:
            return None
        from cobatch.structured_output.bitmask import GrammarBitmask  # torch: only where a model runs

        backend = self.compiler.backend.result()  # compiled grammars imply a built backend
        return GrammarBitmask.fill(backend.executor, matchers, logit_rows, backend.vocab_size)
