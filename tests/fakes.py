"""A fake runner that checks paging: it keeps a pretend KV cache and verifies it every step.

Each KV slot holds (token, position). Before a row "attends", every position of its context is read
back through its block table and must hold exactly the request's token at that position: a wrong
block table, a bad swap, or a block shared by mistake shows up as a mismatch. The next token is a
deterministic function of the token history, like a greedy model's, so outputs can be compared
across preemption modes and pool sizes.
"""

from __future__ import annotations

from cobatch.scheduler_output import RunnerOutput, ScheduledRow, SchedulerOutput

EOS = 1
VOCAB = 97


def next_token(token_ids: list[int]) -> int:
    """A 'model': depends on the whole history (through a rolling hash), never on the batch."""
    h = 0
    for t in token_ids:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return 2 + h % (VOCAB - 2)  # never EOS: tests choose lengths with max_tokens / ignore_eos


class FakeRunner:
    """Pure-Python stand-in for ModelRunner with a verifiable KV cache."""

    def __init__(self, num_kv_blocks: int, block_size: int, num_swap_blocks: int = 0,
                 max_model_len: int = 64, eos_token_ids: tuple[int, ...] = (EOS,)) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.num_swap_blocks = num_swap_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (token, position)
        self.host: dict[int, list[tuple[int, int] | None]] = {}  # host block -> its slots
        self.num_steps = 0
        self.script: dict[str, list[int]] = {}  # request id -> tokens to emit instead
        self.copies: list[tuple[int, int]] = []  # every step's blocks_to_copy, in order

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        self.num_steps += 1
        for device, host in output.blocks_to_swap_out:
            self.host[host] = [self.kv.get(self._slot(device, i)) for i in range(self.block_size)]
        for host, device in output.blocks_to_swap_in:
            for i, value in enumerate(self.host.pop(host)):
                if value is not None:
                    self.kv[self._slot(device, i)] = value
        self.copies.extend(output.blocks_to_copy)
        for src, dst in output.blocks_to_copy:
            for i in range(self.block_size):
                value = self.kv.get(self._slot(src, i))
                if value is not None:
                    self.kv[self._slot(dst, i)] = value
                else:
                    self.kv.pop(self._slot(dst, i), None)
        sampled = []
        for row in output.rows:
            self._write_and_check(row)
            sampled.extend(self._samples(row))
        return RunnerOutput(tuple(sampled), (None,) * len(sampled))

    def _slot(self, block: int, offset: int) -> int:
        assert 0 <= block < self.num_kv_blocks, f"block {block} out of range"
        return block * self.block_size + offset

    def _slot_of(self, row: ScheduledRow, position: int) -> int:
        return self._slot(row.block_table[position // self.block_size], position % self.block_size)

    def _write_and_check(self, row: ScheduledRow) -> None:
        tokens = row.token_ids + list(row.spec_token_ids)  # drafts follow the known tokens
        end = row.num_computed_tokens + row.num_new_tokens
        assert end <= len(tokens), "scheduled past the known tokens"
        assert len(row.block_table) * self.block_size >= end, "block table too short"
        if not row.is_padding:  # padding rows' KV writes are discarded by the real runner too
            for pos in range(row.num_computed_tokens, end):
                self.kv[self._slot_of(row, pos)] = (tokens[pos], pos)
        for pos in range(end):
            got = self.kv.get(self._slot_of(row, pos))
            assert got == (tokens[pos], pos), (
                f"{row.request_id}: KV at position {pos} is {got}, expected {(tokens[pos], pos)}")

    def _samples(self, row: ScheduledRow) -> list[int]:
        """The next token after each of the row's last num_samples positions (drafts included)."""
        tokens = row.token_ids + list(row.spec_token_ids)
        end = row.num_computed_tokens + row.num_new_tokens
        return [self._next(row.request_id, tokens[:pos + 1], pos + 1 - row.num_prompt_tokens)
                for pos in range(end - row.num_samples, end)]

    def _next(self, request_id: str, history: list[int], output_index: int) -> int:
        scripted = self.script.get(request_id)
        if scripted and output_index < len(scripted):
            return scripted[output_index]
        return next_token(history)
