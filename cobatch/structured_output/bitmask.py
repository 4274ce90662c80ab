"""One step's token masks: every constrained row in one [C, ceil(V/32)] int32 bitmask, applied in one op.

Bit j of word w allows token 32 * w + j (llguidance's and xgrammar's layout). The apply is ours, in
plain torch: llguidance's helper is a torch.compile kernel, ~8 s to compile on first use on this CPU
(docs/SERVER.md "Structured outputs"), which would land on the first constrained request's TTFT.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

# [256, 8] bool: bit k of byte value b is clear, i.e. token (byte's first token + k) is masked out.
_BYTE_BLOCKED = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0


class GrammarBitmask:
    """Masks of `logit_rows` (rows of the step's [R, V] logits) as one int32 bitmask [C, W]."""

    __slots__ = ("logit_rows", "bitmask")

    def __init__(self, logit_rows: Sequence[int], bitmask: torch.Tensor) -> None:
        self.logit_rows = list(logit_rows)
        self.bitmask = bitmask  # [C, W] int32

    @classmethod
    def fill(cls, executor: llguidance.LLExecutor, matchers: Sequence[llguidance.LLMatcher],
             logit_rows: Sequence[int], vocab_size: int) -> GrammarBitmask:
        """All rows' next-token masks, in one call into llguidance (its threads, the GIL released)."""
        num_words = (vocab_size + 31) // 32
        bitmask = torch.empty((len(matchers), num_words), dtype=torch.int32)  # every word is written
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                         num_words * 4, len(matchers))
        return cls(logit_rows, bitmask)

    def blocked(self, vocab_size: int) -> torch.Tensor:
        """[C, vocab_size] bool, True where the token is masked; columns past the bitmask are masked
        (the model's vocabulary may be padded past the tokenizer's)."""
        bits = _BYTE_BLOCKED[self.bitmask.view(torch.uint8).long()]  # [C, 4W, 8]: little-endian words
        bits = bits.view(len(self.logit_rows), -1)  # [C, 32W]
        if bits.shape[1] >= vocab_size:
            return bits[:, :vocab_size]
        pad = torch.ones((bits.shape[0], vocab_size - bits.shape[1]), dtype=torch.bool)
        return torch.cat([bits, pad], dim=1)

    def apply(self, logits: torch.Tensor) -> None:
        """Masked tokens' logits to -inf, in place, for all rows at once. logits: [R, V]."""
        blocked = self.blocked(logits.shape[1]).to(logits.device)  # [C, V]
        if self.logit_rows == list(range(logits.shape[0])):
            logits.masked_fill_(blocked, float("-inf"))
            return
        rows = torch.tensor(self.logit_rows, device=logits.device)
        logits[rows] = logits[rows].masked_fill(blocked, float("-inf"))
