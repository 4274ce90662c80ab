"""The llguidance side of one engine: its tokenizer info (built once) and grammars compiled against it."""

from __future__ import annotations

import os

import llguidance
import llguidance.hf

from cobatch.structured_output.grammar_spec import StructuredOutputsError

# The mask fill runs between two steps (nothing else computes then): the host's cores, up to a few.
_MAX_FILL_THREADS = 4


class GrammarBackend:
    """llguidance's LLTokenizer for a HF tokenizer, an executor for batched mask fills, and compiles."""

    def __init__(self, hf_tokenizer: object, eos_token_ids: tuple[int, ...] = ()) -> None:
        # ~2 s for a 49k vocabulary (docs/SERVER.md): built once per engine, on the compiler's thread.
        eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=eos)  # type: ignore[arg-type]
        self.vocab_size: int = self.tokenizer.vocab_size
        self.executor = llguidance.LLExecutor(num_threads=min(_MAX_FILL_THREADS, os.cpu_count() or 1))

    def compile(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher at the start of `grammar`, the pristine copy each sequence deep-copies."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputsError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher
