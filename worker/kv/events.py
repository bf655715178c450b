"""What a worker's prefix cache stores and evicts, as a log the router reads (issue 24).

The router places prompts where their prefix is cached. Its own picture of each cache (router/
prefix_index.py) is built from what it sent where; this log corrects it with what the cache did: a
block indexed under its hash (`stored`), a hash forgotten when its block was handed out again
(`evicted`), the whole index dropped (`cleared`). The router polls it with its cursor beside /info;
a cursor the log no longer reaches (too old, or of another `epoch`: the worker restarted) gets a
snapshot of every hash held instead.

Why a polled log, not pushed events: the router already polls every worker twice a second, a poll
needs no connection of its own or delivery guarantees, and a missed poll loses nothing (the next one
reads on from its cursor). The cost is the poll's lag (0.5 s) and 33 bytes of JSON per event.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .prefix_hash import BlockHash

STORED, EVICTED = 1, 0
DEFAULT_CAPACITY = 65_536  # events kept: at 2 polls/s, 32k events/s between two polls before a snapshot


@dataclass(frozen=True)
class EventBatch:
    """What a reader gets: events after its cursor, or (`snapshot` not None) every hash held now."""

    epoch: str
    next: int  # the cursor to ask with next time
    events: list[tuple[int, BlockHash]]  # (STORED | EVICTED, hash), oldest first
    snapshot: list[BlockHash] | None = None


class KVEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.epoch = uuid.uuid4().hex[:12]  # a new log (a new process) invalidates every reader's cursor
        self._events: deque[tuple[int, BlockHash]] = deque(maxlen=capacity)
        self._next = 0  # the number of events ever logged

    def stored(self, block_hash: BlockHash) -> None:
        self._log(STORED, block_hash)

    def evicted(self, block_hash: BlockHash) -> None:
        self._log(EVICTED, block_hash)

    def cleared(self) -> None:
        """The whole index was dropped: every reader starts over from a snapshot (of nothing)."""
        self._events.clear()
        self._next += self._events.maxlen or 1  # past what any cursor reached, so it reads a snapshot

    def read(self, cursor: int, epoch: str | None, held: Iterable[BlockHash]) -> EventBatch:
        """Events after `cursor` (of `epoch`); a snapshot of `held` when the log cannot answer from there."""
        first = self._next - len(self._events)
        if epoch != self.epoch or not first <= cursor <= self._next:
            return EventBatch(self.epoch, self._next, [], list(held))
        return EventBatch(self.epoch, self._next, list(self._events)[cursor - first:])

    def _log(self, kind: int, block_hash: BlockHash) -> None:
        self._events.append((kind, block_hash))
        self._next += 1
