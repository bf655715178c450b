"""The pool of KV blocks: reference counts, a free queue and the prefix-cache index.

Free blocks wait in one queue, least recently freed first. A block that holds a cached prefix
stays indexed by its hash while it sits in the queue, so a later request can revive it; it is
evicted (its hash forgotten) only when the queue hands it out again. Blocks freed without a
hash go to the front of the queue, so cached blocks are evicted last (LRU among them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from .events import KVEventLog
from .prefix_hash import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.events = KVEventLog()  # what the index stored and forgot, for the router (events.py)

    @property
    def num_free(self) -> int:
        """Blocks with no owner, including cached ones that could be evicted."""
        return len(self._free)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks (evicting cached ones as needed), or None if there are not enough."""
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per block; pass a sequence's blocks tail first, so its tail is evicted first."""
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"KV block {block} freed more often than allocated")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Index a full, computed block under its prefix hash (first writer wins)."""
        if self.block_hash[block] is not None or block_hash in self.cached:
            return
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        self.events.stored(block_hash)

    def reset_prefix_cache(self) -> None:
        for block_hash, block in list(self.cached.items()):
            del self.cached[block_hash]
            self.block_hash[block] = None
        self.events.cleared()

    def _forget(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block] = None
            self.events.evicted(block_hash)
