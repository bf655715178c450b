"""Pure placement policy: which prefill and which decode worker get a request.

Decode: most free KV blocks (the scarce resource while decoding), after subtracting blocks the
router has handed out since that worker last reported.

Prefill (`PrefillPlacer`, policy `prefix`, the default): the worker that would finish this prompt
soonest, counting its queued prompt tokens plus the prompt tokens it would have to compute, that is
the prompt less the longest prefix its cache holds (prefix_index.py). So a conversation's next turn
goes where its history is cached, and a new conversation that shares only the system prompt goes
where the backlog is shortest. Bounded load keeps one hot prefix from taking a worker over: a worker
whose recent share of prompt tokens (decayed per placement) would pass `balance` times the mean is
left out, unless every worker would. The older policies stay for comparison (`--placement`):
`first-block` (affinity keyed on the prompt's first block, within `AFFINITY_SLACK_TOKENS` of the
shortest queue), `least-loaded` (shortest queue) and `round-robin`.

Whatever the policy, `placed` returns a `Placement`: the prompt's blocks as a claim on the chosen
worker's picture and the prefix the picture expected it to hold. The dispatcher settles it when the
prefill answers (`prefilled`: the blocks stay, the expected hit is counted) or not (`failed`: the
blocks it added go, so a refused or abandoned prefill leaves no cache in the picture).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from tandem.worker.kv.prefix_hash import BlockHash
from tandem.worker.router.prefix_index import Claim, PrefixIndex
from tandem.worker.server.protocol import KVEvents

AFFINITY_SLACK_TOKENS = 2048
AFFINITY_ENTRIES = 4096
PLACEMENTS = ("prefix", "first-block", "least-loaded", "round-robin")
DEFAULT_PLACEMENT = "prefix"
DEFAULT_BALANCE = 1.25  # no worker's recent prompt tokens above this times the mean
# The recent load halves every this many placements per worker: long enough to even out one
# conversation's turns, short enough that a worker that joins gets its share within minutes.
LOAD_HALF_LIFE_PER_WORKER = 64


@dataclass
class Candidate:
    url: str
    layout_hash: str
    free_blocks: int = 0
    queued_tokens: int = 0
    active: int = 0  # requests the router has in flight there
    cache_blocks: int = 0  # the worker's KV pool, in blocks (bounds what its prefix cache can hold)
    cache_queries: int = 0  # its cumulative prefix-cache lookups: a drop means it restarted, cache empty


@dataclass(frozen=True)
class Placement:
    """One prompt sent to one prefill worker, until its prefill answers."""

    url: str
    num_tokens: int
    expected_blocks: int  # leading blocks of the prompt the router's picture said that worker held
    claim: Claim

    def expected_hit_tokens(self, block_size: int) -> int:
        """The prompt tokens the worker's prefix cache should serve, if the picture is right: as the engine
        looks up (kv/manager.py lookup_prefix), whole blocks, and never the last token (its logits are
        computed), so this compares one to one with the worker's tandem_prefix_cache_hits_total."""
        usable = max(0, self.num_tokens - 1) // block_size if block_size > 0 else 0
        return min(self.expected_blocks, usable) * block_size


def pick_decode(cands: list[Candidate], exclude: set[str] | frozenset[str] = frozenset(),
                layout_hash: str | None = None) -> Candidate | None:
    pool = [c for c in cands if c.url not in exclude and (layout_hash is None or c.layout_hash == layout_hash)]
    if not pool:
        return None
    return max(pool, key=lambda c: (c.free_blocks, -c.active, c.url))


class PrefixAffinity:
    """Remembers which prefill worker last saw a prefix, keyed by its first block's hash (bounded, least
    recently used out). The first-block policy's memory."""

    def __init__(self, capacity: int = AFFINITY_ENTRIES) -> None:
        self._map: OrderedDict[Hashable, str] = OrderedDict()
        self.capacity = capacity

    def get(self, key: Hashable | None) -> str | None:
        if key is None or key not in self._map:
            return None
        self._map.move_to_end(key)
        return self._map[key]

    def put(self, key: Hashable | None, url: str) -> None:
        if key is None:
            return
        self._map[key] = url
        self._map.move_to_end(key)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)


def pick_prefill(cands: list[Candidate], layout_hash: str, preferred: str | None,
                 exclude: set[str] | frozenset[str] = frozenset(),
                 slack: int = AFFINITY_SLACK_TOKENS) -> Candidate | None:
    pool = [c for c in cands if c.url not in exclude and c.layout_hash == layout_hash]
    if not pool:
        return None
    best = min(pool, key=lambda c: (c.queued_tokens, c.active, c.url))
    for c in pool:
        if c.url == preferred and c.queued_tokens <= best.queued_tokens + slack:
            return c
    return best


def pick_by_prefix(pool: Sequence[Candidate], overlap: dict[str, int], recent: dict[str, float],
                   num_tokens: int, block_size: int, balance: float = DEFAULT_BALANCE) -> Candidate | None:
    """The prefix policy's choice: least work ahead of this prompt's last token (queued tokens plus the
    tokens not in the worker's cache), among workers whose recent load stays within `balance` x mean."""
    if not pool:
        return None

    def todo(c: Candidate) -> int:
        return c.queued_tokens + max(0, num_tokens - overlap.get(c.url, 0) * block_size)

    mean_after = (sum(recent.get(c.url, 0.0) for c in pool) + num_tokens) / len(pool)
    # As bounded-load hashing rounds its bound up to a whole request: one prompt above the mean is
    # always allowed, or the first few requests could only go round robin, whatever they share.
    bound = max(balance * mean_after, mean_after + num_tokens)
    within = [c for c in pool if recent.get(c.url, 0.0) + num_tokens <= bound]
    if within:
        return min(within, key=lambda c: (todo(c), recent.get(c.url, 0.0), c.active, c.url))
    # Every worker would pass the bound (a cold start, or one prompt far above the mean): spread.
    return min(pool, key=lambda c: (recent.get(c.url, 0.0), todo(c), c.active, c.url))


class PrefillPlacer:
    """Chooses prefill workers under one policy and keeps what that needs: the prefix index and the
    recent load (prefix), the first-block affinity (first-block), the rotation (round-robin)."""

    def __init__(self, policy: str = DEFAULT_PLACEMENT, balance: float = DEFAULT_BALANCE) -> None:
        if policy not in PLACEMENTS:
            raise ValueError(f"unknown placement {policy!r}; expected one of {', '.join(PLACEMENTS)}")
        if balance < 1.0:
            raise ValueError(f"the balance factor is a bound on max/mean load and must be >= 1, got {balance}")
        self.policy = policy
        self.balance = balance
        self.index = PrefixIndex()
        self.affinity = PrefixAffinity()
        self.recent: dict[str, float] = {}
        self._queries: dict[str, int] = {}
        self._turn = itertools.count()

    def choose(self, cands: Sequence[Candidate], layout_hash: str, num_tokens: int, block_size: int,
               hashes: Sequence[BlockHash], exclude: Iterable[str] = ()) -> Candidate | None:
        """The worker for a prompt of `num_tokens` tokens whose full blocks (of `block_size` tokens) hash to
        `hashes`, or None when no candidate fits."""
        skip = set(exclude)
        self._notice_restarts(cands)
        pool = [c for c in cands if c.url not in skip and c.layout_hash == layout_hash]
        if self.policy == "first-block":
            return pick_prefill(pool, layout_hash, self.affinity.get(hashes[0] if hashes else None))
        if self.policy == "least-loaded":
            return pick_prefill(pool, layout_hash, None)
        if self.policy == "round-robin":
            ordered = sorted(pool, key=lambda c: c.url)
            return ordered[next(self._turn) % len(ordered)] if ordered else None
        overlap = self.index.overlap(hashes, [c.url for c in pool])
        return pick_by_prefix(pool, overlap, self.recent, num_tokens, block_size, self.balance)

    def placed(self, cand: Candidate, num_tokens: int, hashes: Sequence[BlockHash]) -> Placement:
        """The prompt went to `cand`: its cache will hold the prompt's blocks (claimed until `prefilled` or
        `failed`), and its recent load grows."""
        self.affinity.put(hashes[0] if hashes else None, cand.url)
        expected = self.index.overlap(hashes, [cand.url])[cand.url]
        claim = self.index.claim(cand.url, hashes, cand.cache_blocks or None)
        workers = max(1, len(self.recent | {cand.url: 0.0}))
        decay = 0.5 ** (1.0 / (LOAD_HALF_LIFE_PER_WORKER * workers))
        for url in self.recent:
            self.recent[url] *= decay
        self.recent[cand.url] = self.recent.get(cand.url, 0.0) + num_tokens
        return Placement(cand.url, num_tokens, expected, claim)

    def prefilled(self, placement: Placement) -> None:
        """Its prefill answered: the worker's cache holds the prompt's blocks."""
        self.index.confirm(placement.claim)

    def failed(self, placement: Placement) -> None:
        """Its prefill failed, was refused or given up: the blocks only it put in the picture go. Does
        nothing after `prefilled`, so it can run in a `finally`."""
        self.index.release(placement.claim)

    def observe_cache(self, url: str, events: KVEvents) -> None:
        """A prefill worker's account of its prefix cache (GET /kv/events, read by the registry's poll)."""
        snapshot = None if events.snapshot is None else [bytes.fromhex(h) for h in events.snapshot]
        self.index.apply(url, [(kind == 1, bytes.fromhex(h)) for kind, h in events.stored_evicted], snapshot)

    def holder(self, hashes: Sequence[BlockHash]) -> str | None:
        """The worker the index says holds the longest prefix of these blocks (None: none holds any)."""
        overlap = self.index.overlap(hashes, self.index.known())
        best = max(overlap.items(), key=lambda kv: kv[1], default=(None, 0))
        return best[0] if best[1] > 0 else None

    def retain(self, urls: Iterable[str]) -> None:
        """Forget workers that left (their cache and load no longer count)."""
        keep = set(urls)
        for url in [u for u in self.index.known() if u not in keep]:
            self.index.forget(url)
        for url in [u for u in self.recent if u not in keep]:
            del self.recent[url]

    def _notice_restarts(self, cands: Iterable[Candidate]) -> None:
        for c in cands:
            if c.cache_queries < self._queries.get(c.url, 0):
                self.index.forget(c.url)
            self._queries[c.url] = c.cache_queries
