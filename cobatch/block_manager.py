"""Paged KV-cache accounting: free list, reference counts, block tables, prefix cache, swap pool.

No tensors here: the block manager hands out block ids; the runner's KV tensors are indexed by them.

A device block is in exactly one of two places:
    in use   ref_count > 0, listed in one or more live block tables (shared by the prefix cache)
    free     ref_count == 0, in `free_blocks` (LRU order). A free block may still hold a cached
             prefix (its hash is kept) and is revived by a cache hit, or evicted when reused.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from cobatch.request import Request

# The parent of a chain's first block. Not None: hash(None) is address-based before Python 3.12, so
# it differs between processes, and a router in another process (cobatch/ray) compares its hashes of
# a prompt with the ones a replica reports. Hashes of ints and tuples of ints are process-independent.
ROOT_HASH = 0x636F6261746368

# How many of the latest evicted block hashes stats report. A router applies the ones evicted since
# the record it last saw (cobatch/ray/prefix_index.py) and forgets the replica's chains when more
# were evicted than listed: sized for a second of heavy churn between two stats records.
NUM_RECENT_EVICTIONS = 256


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block, chained with its prefix so equal blocks at different places differ."""
    return hash((ROOT_HASH if parent_hash is None else parent_hash, token_ids))


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int) -> None:
    """Append to `hashes` the chained hashes of token_ids' full blocks it does not cover yet."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, tuple(token_ids[start:start + block_size])))


class BlockManager:
    """Allocates fixed-size KV blocks to requests; shares full prompt blocks by hash."""

    def __init__(self, num_blocks: int, block_size: int, num_swap_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_swap_blocks = num_swap_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_tables: dict[str, list[int]] = {}
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.block_hash_of: dict[int, int] = {}  # block id -> block hash
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already registered
        # A computed prompt's last block where the prompt does not fill it: its leading slots (the prompt's
        # tail) never change while the block lives (later tokens go after them), so a request with the same
        # prompt can copy it. Hash of the tail (chained as a full block's) -> block; block -> its tail hashes.
        self.cached_tails: dict[int, int] = {}
        self.tail_hashes_of: dict[int, list[int]] = {}
        self._tail_registered: set[str] = set()  # request ids whose prompt tail is registered
        self.free_swap_blocks: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.swap_tables: dict[str, list[int]] = {}  # request id -> host blocks of its copied blocks
        self.swap_resident: dict[str, int] = {}  # request id -> leading shared blocks left on the device
        self.num_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_cache_hits = 0  # of which found
        self.num_evictions_total = 0  # cached blocks reused for other content (their prefix is gone)
        self._recent_evictions: deque[int] = deque(maxlen=NUM_RECENT_EVICTIONS)  # their hashes
        # Stats read the deque every step: copy it only when an eviction changed it.
        self._recent_evictions_copy: tuple[int, tuple[int, ...]] = (0, ())  # (num_evictions_total, hashes)

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_cache_hits / self.num_cache_queries if self.num_cache_queries else 0.0

    @property
    def recent_evicted_hashes(self) -> tuple[int, ...]:
        """The hashes of the last NUM_RECENT_EVICTIONS evicted blocks, oldest first."""
        if self._recent_evictions_copy[0] != self.num_evictions_total:
            self._recent_evictions_copy = (self.num_evictions_total, tuple(self._recent_evictions))
        return self._recent_evictions_copy[1]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.setdefault(request_id, [])

    # ---- prefix cache ------------------------------------------------------------------------

    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes over its newly full blocks (cheap: only new blocks)."""
        extend_block_hashes(request.block_hashes, request.token_ids, self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding this request's leading full blocks (at least one token left to compute)."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(request)
        # The last token is always computed, so the step yields logits to sample from.
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self._cached_run(request.block_hashes[:max_blocks])

    def find_cached_last_block(self, request: Request, prefix: Sequence[int]) -> int | None:
        """The cached block that would extend `prefix` (find_cached_prefix's) over all of the request's tokens:
        a full block where they fill their blocks exactly, else a computed prompt's last block with the same
        tail. A copy of it leaves only the last token to compute (which must be, for its logits), where
        sharing the prefix alone would recompute that whole block."""
        if not self.enable_prefix_caching:
            return None
        num_full, tail = divmod(request.num_tokens, self.block_size)
        if tail == 0:
            return self.cached_blocks.get(request.block_hashes[num_full - 1]) if len(prefix) == num_full - 1 else None
        return self.cached_tails.get(self._tail_hash(request, request.num_tokens)) if len(prefix) == num_full else None

    def _tail_hash(self, request: Request, end: int) -> int:
        """Hash of the request's tokens from its last full block before `end` up to `end`."""
        num_full = end // self.block_size
        parent = request.block_hashes[num_full - 1] if num_full else None
        return hash_block(parent, tuple(request.token_ids[num_full * self.block_size:end]))

    def _cached_run(self, block_hashes: Sequence[int]) -> list[int]:
        """The device blocks of the leading hashes that are cached, up to the first miss."""
        hits: list[int] = []
        for block_hash in block_hashes:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_cache_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_cache_queries += num_query_tokens
        self.num_cache_hits += num_hit_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        table = self.block_tables.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(request.request_id, 0)
        for i in range(start, num_full):  # only blocks that became full since the last call
            block, block_hash = table[i], request.block_hashes[i]
            if block in self.block_hash_of or block_hash in self.cached_blocks:
                continue
            self.cached_blocks[block_hash] = block
            self.block_hash_of[block] = block_hash
        self._num_registered[request.request_id] = max(start, num_full)
        self._cache_prompt_tail(request, table)

    def _cache_prompt_tail(self, request: Request, table: Sequence[int]) -> None:
        """Register the block that ends the request's prompt, once computed, where the prompt does not fill it."""
        num_full, tail = divmod(request.num_prompt_tokens, self.block_size)
        if (tail == 0 or request.num_computed_tokens < request.num_prompt_tokens or len(table) <= num_full
                or request.request_id in self._tail_registered):
            return
        self._tail_registered.add(request.request_id)
        tail_hash = self._tail_hash(request, request.num_prompt_tokens)
        if tail_hash not in self.cached_tails:
            self.cached_tails[tail_hash] = table[num_full]
            self.tail_hashes_of.setdefault(table[num_full], []).append(tail_hash)

    # ---- allocation --------------------------------------------------------------------------

    def can_allocate(self, num_blocks: int, use_watermark: bool) -> bool:
        reserve = self.watermark_blocks if use_watermark else 0
        return num_blocks <= self.num_free_blocks - reserve

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_prefix: list[int] = (), use_watermark: bool = False) -> bool:
        """Give the request blocks for num_computed_tokens + num_new_tokens; False if they don't fit.

        `cached_prefix` (for a request without blocks) are prefix-cache hits taken over first.
        """
        if not self.can_allocate(self.num_blocks_to_allocate(request, num_new_tokens, cached_prefix),
                                 use_watermark):
            return False
        num_needed = self._num_new_blocks(request, num_new_tokens, cached_prefix)
        table = self.block_table(request.request_id)
        for block in cached_prefix:
            self._take(block)
            table.append(block)
        for _ in range(num_needed):
            table.append(self._pop_free_block())
        return True

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                               cached_prefix: Sequence[int] = ()) -> int:
        """Free blocks allocate_slots would take: new ones, and cached ones revived from the free list."""
        num_revived = sum(1 for b in cached_prefix if self.ref_counts[b] == 0)
        return max(self._num_new_blocks(request, num_new_tokens, cached_prefix), 0) + num_revived

    def _num_new_blocks(self, request: Request, num_new_tokens: int, cached_prefix: Sequence[int]) -> int:
        num_held = len(self.block_tables.get(request.request_id, ())) + len(cached_prefix)
        return self.blocks_needed(request.num_computed_tokens + num_new_tokens) - num_held

    def num_shared_prefix_blocks(self, request: Request) -> int:
        """Leading blocks of the request's table that another live request holds too."""
        num = 0
        for block in self.block_tables.get(request.request_id, ()):
            if self.ref_counts[block] < 2:
                break
            num += 1
        return num

    def free(self, request: Request) -> None:
        """Release the request's device blocks (cached ones stay revivable until evicted)."""
        table = self.block_tables.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        self._tail_registered.discard(request.request_id)
        # Free the tail first so that eviction (from the front) takes the deepest prefix blocks last.
        for block in reversed(table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _pop_free_block(self) -> int:
        """The least recently freed block; its cached prefix (if any) is evicted."""
        block, _ = self.free_blocks.popitem(last=False)
        block_hash = self.block_hash_of.pop(block, None)
        if block_hash is not None:
            del self.cached_blocks[block_hash]
            self.num_evictions_total += 1
            self._recent_evictions.append(block_hash)
        for tail_hash in self.tail_hashes_of.pop(block, ()):
            del self.cached_tails[tail_hash]
        self.ref_counts[block] = 1
        return block

    # ---- swap ----------------------------------------------------------------------------------
    # A victim's leading blocks that live requests share stay on the device, uncopied: moving them would
    # free nothing, and a swap-in that brought back private copies would hold the shared prefix twice.
    # Swap-in takes them back by hash from the prefix cache (with any other leading block still cached).

    def can_swap_out(self, request: Request) -> bool:
        num_copied = len(self.block_tables.get(request.request_id, [])) - self.num_shared_prefix_blocks(request)
        return num_copied <= len(self.free_swap_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's unshared blocks to the host pool: (device block, host block) copies to do."""
        num_resident = self.num_shared_prefix_blocks(request)
        copied = self.block_tables[request.request_id][num_resident:]
        host = [self.free_swap_blocks.pop() for _ in copied]
        self.free(request)
        self.swap_tables[request.request_id] = host
        self.swap_resident[request.request_id] = num_resident
        return list(zip(copied, host))

    def _swap_in_prefix(self, request: Request) -> list[int]:
        """Device blocks that still hold the swapped request's leading computed blocks (by hash)."""
        if not self.enable_prefix_caching:
            return []
        return self._cached_run(request.block_hashes[:request.num_computed_tokens // self.block_size])

    def is_swap_prefix_resident(self, request: Request) -> bool:
        """False when a shared block left on the device was evicted while the request was out."""
        return len(self._swap_in_prefix(request)) >= self.swap_resident[request.request_id]

    def num_blocks_to_swap_in(self, request: Request) -> int:
        """Free blocks swap_in would take: cached ones revived from the free list, and the copies' ones."""
        prefix = self._swap_in_prefix(request)
        num_copied = len(self.swap_tables[request.request_id]) + self.swap_resident[request.request_id]
        return sum(1 for b in prefix if self.ref_counts[b] == 0) + num_copied - len(prefix)

    def can_swap_in(self, request: Request, use_watermark: bool = True) -> bool:
        return self.can_allocate(self.num_blocks_to_swap_in(request), use_watermark)

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring the request's blocks back: (host block, device block) copies to do (none for cached ones)."""
        prefix = self._swap_in_prefix(request)
        num_resident = self.swap_resident.pop(request.request_id)
        assert len(prefix) >= num_resident, "a resident prefix block was evicted (check is_swap_prefix_resident)"
        host = self.swap_tables.pop(request.request_id)
        table = self.block_table(request.request_id)
        assert not table, "a swapped request holds no device blocks"
        for block in prefix:
            self._take(block)
            table.append(block)
        copies = []
        for host_block in host[len(prefix) - num_resident:]:  # host copies of cached blocks go unused
            table.append(self._pop_free_block())
            copies.append((host_block, table[-1]))
        self.free_swap_blocks.extend(reversed(host))
        # The copies land before this step's forward: other swapped requests may take these blocks now.
        self.cache_full_blocks(request)
        return copies

    def free_swap(self, request: Request) -> None:
        self.swap_resident.pop(request.request_id, None)
        self.free_swap_blocks.extend(reversed(self.swap_tables.pop(request.request_id, [])))

    # ---- invariants --------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Blocks conserved; ref counts equal table membership; the free list is exactly ref 0."""
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block in table:
                counts[block] += 1
        assert counts == self.ref_counts, "ref counts disagree with block tables"
        free = {b for b, c in enumerate(counts) if c == 0}
        assert free == set(self.free_blocks), "free list disagrees with ref counts"
        for block_hash, block in self.cached_blocks.items():
            assert self.block_hash_of[block] == block_hash
        for tail_hash, block in self.cached_tails.items():
            assert tail_hash in self.tail_hashes_of[block], "a prompt tail's block does not list it"
        host_used = [b for t in self.swap_tables.values() for b in t]
        assert len(host_used) == len(set(host_used)), "a host block is in two swap tables"
        assert len(host_used) + len(self.free_swap_blocks) == self.num_swap_blocks, "host blocks leaked"
        assert self.swap_resident.keys() == self.swap_tables.keys(), "a swap record is half gone"
