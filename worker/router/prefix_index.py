"""The router's picture of each prefill worker's prefix cache, learned from the prompts it sent there.

Keys are the engine's own chained block hashes (kv/prefix_hash.py), so "worker W holds the first k
blocks of this prompt" means what the worker's prefix cache means by it. Nothing is asked of the
workers: each placement records the prompt's blocks on the chosen worker, and each worker's picture
is bounded by its KV pool (`capacity` blocks) and evicts least recently used first, the way the
worker's block pool does. A prompt's blocks are recorded tail first, so its head is the most recent
and the tail goes first, as in the worker (a chain without its head is useless).

What it cannot see: blocks the worker evicted earlier than modelled (running requests pin blocks the
picture counts as cache), and traffic from other routers. Both make it optimistic, never wrong in
output: a miss costs a recompute, not a wrong token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tandem.worker.kv.prefix_hash import BlockHash


class PrefixIndex:
    def __init__(self) -> None:
        self._lru: dict[str, OrderedDict[BlockHash, None]] = {}  # worker -> its blocks, oldest first
        self._holders: dict[BlockHash, set[str]] = {}  # block -> workers holding it
        self._capacity: dict[str, int] = {}

    def overlap(self, hashes: Sequence[BlockHash], urls: Iterable[str]) -> dict[str, int]:
        """For each of `urls`: how many leading blocks of `hashes` it holds (0 when none)."""
        matched = dict.fromkeys(urls, 0)
        alive = set(matched)
        for i, h in enumerate(hashes):
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for url in alive:
                matched[url] = i + 1
        return matched

    def record(self, url: str, hashes: Sequence[BlockHash], capacity: int | None = None) -> None:
        """`url` now holds these blocks (a prompt's chained hashes, head first)."""
        if capacity is not None and capacity > 0:
            self._capacity[url] = capacity
        lru = self._lru.setdefault(url, OrderedDict())
        for h in reversed(hashes):  # tail first: the head ends most recent, evicted last
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(url)
        limit = self._capacity.get(url)
        while limit is not None and len(lru) > limit:
            self._drop(url, lru.popitem(last=False)[0])

    def forget(self, url: str) -> None:
        """The worker restarted or left: its cache is gone."""
        for h in self._lru.pop(url, OrderedDict()):
            self._drop(url, h)
        self._capacity.pop(url, None)

    def known(self) -> list[str]:
        return list(self._lru)

    def size(self, url: str) -> int:
        return len(self._lru.get(url, ()))

    def _drop(self, url: str, h: BlockHash) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(url)
            if not holders:
                del self._holders[h]
