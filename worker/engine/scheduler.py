"""Continuous batching under a per-step token budget.

Each step serves running requests first (one token per decode, the next chunk per partial
prefill), then admits waiting requests in arrival order while budget, batch slots and KV
blocks last. A waiting request that already owns its KV (a prefilled hand-off on a decode
worker) is admitted before any that still needs blocks: it may hold exactly the blocks the
head of the queue waits for, and it gives them back by running to its end.

When a running request cannot get a block, the most recently admitted running request is
preempted: its blocks are freed and it waits at the front of the queue to be recomputed
(cheaply, when its blocks are still in the prefix cache). No new request is admitted in a step
that preempted. When nothing runs and nothing can be admitted while waiting requests own
blocks, the most recent of them is preempted the same way, so the queue always moves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..kv.manager import KVCacheManager
from ..kv.prefix_hash import block_hashes
from .sequence import Sequence, Status


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, token_budget: int, max_num_seqs: int, chunked_prefill: bool) -> None:
        self.kv = kv
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # cumulative

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted); its blocks are the caller's to free."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._grow_or_preempt(seq, num_new, out):
                break  # seq itself was preempted; everything after it is gone too
            out.scheduled.append((seq, num_new))
            budget -= num_new
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            # Owners of their KV first; otherwise arrival order: nobody overtakes the head of the queue.
            seq = next((s for s in self.waiting if s.owns_kv), self.waiting[0])
            chunk = self._admit(seq, budget)
            if chunk is None:
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, chunk))
            budget -= chunk
        if not out.scheduled and self.waiting and not self.running:
            owners = [s for s in self.waiting if s.owns_kv]
            if owners:  # they hold what the others need and cannot grow themselves: recompute one later
                victim = owners[-1]
                self.waiting.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
        return out

    def _grow_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        while self.kv.allocate_slots(seq.block_table, seq.num_computed_tokens + num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Allocate blocks for the next chunk of a waiting sequence; the chunk's size, or None."""
        cached: list[int] = []
        # A request that wants its prompt's logprobs computes the whole prompt: a cached prefix has no logits.
        skip_cache = seq.needs_prompt_logprobs
        if not seq.block_table:  # new or preempted: start from the longest cached prefix
            if self.kv.enable_prefix_caching and not skip_cache:
                seq.block_hashes = block_hashes(seq.token_ids, self.kv.block_size, seq.block_hashes)
                cached = self.kv.lookup_prefix(seq.block_hashes, seq.num_tokens)
            seq.num_computed_tokens = 0
        num_computed = seq.num_computed_tokens + len(cached) * self.kv.block_size
        remaining = seq.num_tokens - num_computed
        num_new = min(remaining, budget)
        if num_new < remaining and not self.chunked_prefill:
            return None
        if self.kv.allocate_slots(seq.block_table, num_computed + num_new, cached) is None:
            return None
        seq.num_computed_tokens = num_computed
        if cached:
            seq.num_registered_blocks = len(cached)
        if not seq.prefix_recorded:
            seq.prefix_recorded = True
            seq.num_cached_tokens = len(cached) * self.kv.block_size
            if not skip_cache:  # not looked up: not counted (as vLLM counts it)
                self.kv.record_prefix_lookup(seq.num_prompt_tokens, seq.num_cached_tokens)
        return num_new

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(s.num_uncomputed_prompt_tokens for s in self.waiting) + sum(
            s.num_uncomputed_prompt_tokens for s in self.running)
