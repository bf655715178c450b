"""KV cache manager: block tables in and out of the pool, with prefix caching.

Block tables are plain lists owned by the caller (the engine keeps one per sequence); the
manager extends and clears them. `allocate_slots` answers None when the tokens do not fit and
then changes nothing, so the scheduler can decide whom to preempt; nothing on this path raises.
"""

from __future__ import annotations

from collections.abc import Sequence

from .block_pool import BlockPool
from .prefix_hash import BlockHash, block_hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_queries = 0  # prompt tokens looked up (cumulative)
        self.prefix_hits = 0  # of which found in the cache

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def lookup_prefix(self, hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """Cached blocks holding the longest known prefix of a sequence of `num_tokens` tokens.

        At least the last token is always left to compute, since its logits are needed.
        """
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        for block_hash in hashes[: (num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def can_allocate(self, block_table: Sequence[int], num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        fresh = blocks_for(num_tokens, self.block_size) - len(block_table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        return max(fresh, 0) + revived <= self.pool.num_free

    def allocate_slots(self, block_table: list[int], num_tokens: int,
                       cached_blocks: Sequence[int] = ()) -> list[int] | None:
        """Grow `block_table` (first by `cached_blocks`) until it holds `num_tokens` tokens.

        Returns the freshly allocated block ids (possibly none), or None when they do not fit;
        on None, nothing changed.
        """
        if not self.can_allocate(block_table, num_tokens, cached_blocks):
            return None
        self.pool.touch(cached_blocks)
        block_table.extend(cached_blocks)
        fresh = self.pool.allocate(max(blocks_for(num_tokens, self.block_size) - len(block_table), 0))
        assert fresh is not None  # guaranteed by can_allocate
        block_table.extend(fresh)
        return fresh

    def cache_blocks(self, block_table: Sequence[int], hashes: list[BlockHash], token_ids: Sequence[int],
                     num_computed_tokens: int, num_registered: int) -> int:
        """Index a sequence's full, computed blocks in the prefix cache.

        `num_registered` leading blocks are already indexed; `hashes` is extended in place as
        needed. Returns the new number of indexed blocks.
        """
        if not self.enable_prefix_caching:
            return num_registered
        num_full = num_computed_tokens // self.block_size
        if num_full <= num_registered:
            return num_registered
        if len(hashes) < num_full:
            hashes[:] = block_hashes(token_ids[: num_full * self.block_size], self.block_size, hashes)
        for i in range(num_registered, num_full):
            self.pool.cache(block_table[i], hashes[i])
        return num_full

    def free(self, block_table: list[int]) -> None:
        """Release a sequence's blocks (tail first, so its tail is evicted first) and empty the table."""
        self.pool.free(reversed(block_table))
        block_table.clear()
