"""The router's picture of each prefill worker's prefix cache, learned from the prompts it sent there.

Keys are the engine's own chained block hashes (kv/prefix_hash.py), so "worker W holds the first k
blocks of this prompt" means what the worker's prefix cache means by it. Nothing is asked of the
workers: each placement records the prompt's blocks on the chosen worker, and each worker's picture
is bounded by its KV pool (`capacity` blocks) and evicts least recently used first, the way the
worker's block pool does. A prompt's blocks are recorded tail first, so its head is the most recent
and the tail goes first, as in the worker (a chain without its head is useless).

A placement's blocks are a claim (`claim`) until its prefill answers: they count at once, so the
requests right behind it go where the prompt is being computed, and `confirm` keeps them; `release`
(the prefill failed, was refused or abandoned) takes out those the claim added that no confirmed
prefill and no other claim still in flight holds. So a worker that never computed a prompt is not
pictured holding it.

The workers' own account corrects it (`apply`, from GET /kv/events beside each poll, kv/events.py):
the blocks a worker's cache stored (whoever sent the prompt: another router too) join its picture, those
it evicted leave it (running requests pin blocks, so a worker evicts other blocks than an LRU of the
pool would), and a snapshot replaces the picture's confirmed blocks when the worker restarted or the
router fell behind its log. Between two polls the picture is the router's own guess; a wrong guess
costs a recompute, never a wrong token.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tandem.worker.kv.prefix_hash import BlockHash


@dataclass(frozen=True)
class Claim:
    """The blocks one placement put in a worker's picture before its prefill answered (see `claim`)."""

    url: str
    ticket: int
    blocks: tuple[BlockHash, ...]  # those not already confirmed there when it was placed


class PrefixIndex:
    def __init__(self) -> None:
        self._lru: dict[str, OrderedDict[BlockHash, None]] = {}  # worker -> its blocks, oldest first
        self._holders: dict[BlockHash, set[str]] = {}  # block -> workers holding it
        self._capacity: dict[str, int] = {}
        # worker -> block -> the claims in flight that hold it there; a block in the picture but not
        # here is confirmed (a prefill that computed it answered)
        self._claims: dict[str, dict[BlockHash, set[int]]] = {}
        self._tickets = itertools.count(1)

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
        """`url` now holds these blocks (a prompt's chained hashes, head first), confirmed."""
        self.confirm(self.claim(url, hashes, capacity))

    def claim(self, url: str, hashes: Sequence[BlockHash], capacity: int | None = None) -> Claim:
        """`url` is computing these blocks: in the picture now, until `release` takes out what it added."""
        if capacity is not None and capacity > 0:
            self._capacity[url] = capacity
        lru = self._lru.setdefault(url, OrderedDict())
        claims = self._claims.setdefault(url, {})
        ticket = next(self._tickets)
        claimed: list[BlockHash] = []
        for h in reversed(hashes):  # tail first: the head ends most recent, evicted last
            if h in lru:
                lru.move_to_end(h)
                if h not in claims:
                    continue  # confirmed there already: this placement's outcome cannot take it out
                claims[h].add(ticket)
            else:
                lru[h] = None
                self._holders.setdefault(h, set()).add(url)
                claims[h] = {ticket}
            claimed.append(h)
        limit = self._capacity.get(url)
        while limit is not None and len(lru) > limit:
            self._drop(url, lru.popitem(last=False)[0])
        return Claim(url, ticket, tuple(claimed))

    def confirm(self, claim: Claim) -> None:
        """Its prefill answered: the worker computed (or found) these blocks, whatever other claims do."""
        claims = self._claims.get(claim.url, {})
        for h in claim.blocks:
            if claim.ticket in claims.get(h, ()):  # not evicted or forgotten since
                del claims[h]

    def release(self, claim: Claim) -> None:
        """Its prefill failed or was given up: take out the blocks it added that nothing else holds (no
        confirmed prefill, no other claim in flight). After `confirm`, or a second time, it does nothing."""
        claims = self._claims.get(claim.url, {})
        lru = self._lru.get(claim.url)
        for h in claim.blocks:
            holders = claims.get(h)
            if holders is None or claim.ticket not in holders:
                continue
            holders.discard(claim.ticket)
            if not holders and lru is not None:
                del lru[h]
                self._drop(claim.url, h)

    def apply(self, url: str, events: Iterable[tuple[bool, BlockHash]] = (),
              snapshot: Iterable[BlockHash] | None = None) -> None:
        """The worker's account of its cache: `snapshot` (every block it holds; the confirmed picture
        becomes exactly that, claims in flight kept), then `events` in order ((stored, hash): True when
        its cache stored the block, False when it evicted it)."""
        lru = self._lru.setdefault(url, OrderedDict())
        claims = self._claims.setdefault(url, {})
        if snapshot is not None:
            held = set(snapshot)
            for h in [h for h in lru if h not in held and h not in claims]:
                del lru[h]
                self._drop(url, h)
            for h in held:
                if h not in lru:
                    lru[h] = None
                    lru.move_to_end(h, last=False)  # its place in the worker's LRU is not known: oldest
                    self._holders.setdefault(h, set()).add(url)
                claims.pop(h, None)  # computed there: confirmed, whatever the claims do
        for stored, h in events:
            if stored:
                if h not in lru:
                    self._holders.setdefault(h, set()).add(url)
                lru[h] = None
                lru.move_to_end(h)
                claims.pop(h, None)
            elif h in lru:
                del lru[h]
                self._drop(url, h)
        limit = self._capacity.get(url)
        while limit is not None and len(lru) > limit:
            self._drop(url, lru.popitem(last=False)[0])

    def pending(self, url: str) -> int:
        """Blocks of `url`'s picture that only claims in flight hold."""
        return len(self._claims.get(url, ()))

    def forget(self, url: str) -> None:
        """The worker restarted or left: its cache is gone."""
        for h in self._lru.pop(url, OrderedDict()):
            self._drop(url, h)
        self._capacity.pop(url, None)
        self._claims.pop(url, None)

    def known(self) -> list[str]:
        return list(self._lru)

    def size(self, url: str) -> int:
        return len(self._lru.get(url, ()))

    def _drop(self, url: str, h: BlockHash) -> None:
        """`h` left `url`'s picture (evicted, released or forgotten): no longer held there, nor claimed."""
        self._claims.get(url, {}).pop(h, None)
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(url)
            if not holders:
                del self._holders[h]
