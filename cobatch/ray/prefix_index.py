"""The router's picture of which prompt prefixes each replica's KV cache holds, as block-hash chains.

The engine's prefix cache shares *full* blocks whose chained hash matches (block_manager.hash_block),
so the router hashes a prompt the same way and remembers, per replica, the chains it sent there. What
a replica reports evicted is taken out; memory is bounded per replica by LRU. This is a prediction
(a request may be aborted before its prefill, an eviction report may be missed), never ground truth.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from cobatch.block_manager import extend_block_hashes


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks, exactly as the engine's prefix cache computes them."""
    hashes: list[int] = []
    extend_block_hashes(hashes, token_ids, block_size)
    return hashes


def max_cached_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Leading blocks a prompt can take from the cache: its last token is always computed (for logits)."""
    return max(num_prompt_tokens - 1, 0) // block_size


class PrefixIndex:
    """Per replica, an LRU set of block hashes it probably holds; chains are matched from their root."""

    def __init__(self, block_size: int, max_blocks_per_replica: int = 65536) -> None:
        self.block_size = block_size
        self.max_blocks_per_replica = max_blocks_per_replica
        self._blocks: dict[str, OrderedDict[int, None]] = {}  # replica -> hashes, least recent first
        self._capacity: dict[str, int] = {}  # replica -> its KV pool size, when reported
        self._num_evictions_seen: dict[str, int] = {}  # replica -> its eviction counter last applied

    @property
    def replica_ids(self) -> list[str]:
        return list(self._blocks)

    def num_blocks(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))

    def set_capacity(self, replica_id: str, num_kv_blocks: int) -> None:
        """A replica cannot cache more blocks than its pool has: bound its entry by that too."""
        self._capacity[replica_id] = num_kv_blocks
        self._trim(replica_id)

    def record_routed(self, replica_id: str, block_hashes: Sequence[int]) -> None:
        """The replica will compute (so cache) these blocks: remember them as most recently used."""
        blocks = self._blocks.setdefault(replica_id, OrderedDict())
        # Touch the chain tail first so the root ends most recent: LRU then drops the deepest blocks
        # first, as the engine does (it frees a table tail-first), and never keeps a child without
        # its parent longer than the parent.
        for block_hash in reversed(block_hashes):
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        self._trim(replica_id)

    def num_matched_blocks(self, replica_id: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain the replica probably holds."""
        blocks = self._blocks.get(replica_id)
        if not blocks:
            return 0
        num = 0
        for block_hash in block_hashes:
            if block_hash not in blocks:
                break
            num += 1
        return num

    def apply_evictions(self, replica_id: str, block_hashes: Sequence[int]) -> None:
        blocks = self._blocks.get(replica_id)
        if blocks is not None:
            for block_hash in block_hashes:
                blocks.pop(block_hash, None)

    def apply_eviction_report(self, replica_id: str, num_evictions_total: int,
                              recent_evicted_hashes: Sequence[int]) -> bool:
        """Apply the evictions a stats record reports; False if some were missed (the entry is dropped).

        A replica reports a running count of evicted cached blocks and its last few evicted hashes
        (oldest first). Stats reach the router as snapshots, so records can be skipped: when more were
        evicted than the report lists, the router no longer knows what is cached there and forgets the
        replica's chains. Guessing cold only costs affinity; guessing warm would herd requests onto a
        replica that lost the prefix.
        """
        seen = self._num_evictions_seen.get(replica_id, 0)
        self._num_evictions_seen[replica_id] = num_evictions_total
        num_new = num_evictions_total - seen
        if num_new == 0:
            return True
        if 0 < num_new <= len(recent_evicted_hashes):
            self.apply_evictions(replica_id, recent_evicted_hashes[len(recent_evicted_hashes) - num_new:])
            return True
        self._blocks.pop(replica_id, None)  # missed records (or a counter that went back): unknown
        return False

    def remove_replica(self, replica_id: str) -> None:
        self._blocks.pop(replica_id, None)
        self._capacity.pop(replica_id, None)
        self._num_evictions_seen.pop(replica_id, None)

    def _trim(self, replica_id: str) -> None:
        blocks = self._blocks.get(replica_id)
        if blocks is None:
            return
        limit = min(self.max_blocks_per_replica,
                    self._capacity.get(replica_id, self.max_blocks_per_replica))
        while len(blocks) > limit:
            blocks.popitem(last=False)
