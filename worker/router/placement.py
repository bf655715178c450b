"""Pure placement policy: which prefill and which decode worker get a request.

Decode: most free KV blocks (the scarce resource while decoding), after subtracting blocks the
router has handed out since that worker last reported. Prefill: shortest queued-token backlog,
but stay on the worker that last served the same prompt prefix (its prefix cache has it) unless
that worker is more than `affinity_slack` tokens behind the best one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

AFFINITY_SLACK_TOKENS = 2048
AFFINITY_ENTRIES = 4096


@dataclass
class Candidate:
    url: str
    layout_hash: str
    free_blocks: int = 0
    queued_tokens: int = 0
    active: int = 0  # requests the router has in flight there


def pick_decode(cands: list[Candidate], exclude: set[str] | frozenset[str] = frozenset(),
                layout_hash: str | None = None) -> Candidate | None:
    pool = [c for c in cands if c.url not in exclude and (layout_hash is None or c.layout_hash == layout_hash)]
    if not pool:
        return None
    return max(pool, key=lambda c: (c.free_blocks, -c.active, c.url))


def prefix_key(token_ids: list[int], block_size: int) -> str | None:
    """Identity of the prompt's first full block (None for prompts shorter than a block)."""
    if len(token_ids) < block_size:
        return None
    return hashlib.blake2b(repr(token_ids[:block_size]).encode(), digest_size=8).hexdigest()


class PrefixAffinity:
    """Remembers which prefill worker last saw a prefix (bounded, least recently used out)."""

    def __init__(self, capacity: int = AFFINITY_ENTRIES) -> None:
        self._map: OrderedDict[str, str] = OrderedDict()
        self.capacity = capacity

    def get(self, key: str | None) -> str | None:
        if key is None or key not in self._map:
            return None
        self._map.move_to_end(key)
        return self._map[key]

    def put(self, key: str | None, url: str) -> None:
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
