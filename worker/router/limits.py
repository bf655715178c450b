"""The router's limits on its clients (their defaults here, so the command's help needs nothing heavy)
and admission: a cap on the requests the router serves at once and on the work queued behind them.

A request takes a place on arrival, before its body is read. It then reads and tokenizes its
prompt and waits for one of `max_running` running slots (FIFO) for at most `queue_timeout` seconds;
with the slot it goes to the workers, and gives both back when its answer has been sent. At most
`max_running + max_queued` requests hold a place: the next one gets 429 with Retry-After at once,
without its body being read, and so does one whose wait for a slot runs out. So memory held for
requests (bodies, token ids) and the work sent to the workers are both bounded, and a request under
the caps waits for nothing.
"""

from __future__ import annotations

import asyncio
import time

from tandem.worker.router.errors import APIError

# The defaults: far above what a few decode workers run at once (64 sequences each by default), so
# only a flood meets them; a deployment sizes them to its pools.
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_QUEUE_TIMEOUT_S = 30.0
# The read timeouts (read_timeouts.ReadTimeoutProtocol): a request's head, then its whole body.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
RETRY_AFTER_S = 1  # what a refused client is told to wait: places free as fast as requests finish


def overloaded(message: str) -> APIError:
    return APIError(429, message, code="too_many_requests", headers={"retry-after": str(RETRY_AFTER_S)})


class Ticket:
    """One request's place; `release` (idempotent) gives back the place and, if it had one, the slot."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.running = False
        self.released = False

    async def start(self, deadline: float) -> None:
        """Wait for a running slot: at most the queue timeout, and never past `deadline` (monotonic)."""
        a = self._admission
        wait = max(0.0, min(a.queue_timeout, deadline - time.monotonic()))
        try:
            async with asyncio.timeout(wait):
                await a._slots.acquire()
        except TimeoutError:
            raise overloaded(f"the router is at its limit of {a.max_running} requests running at once and no "
                             f"slot came free within {wait:g} s; retry later (tandem router "
                             "--max-concurrent-requests, --queue-timeout)") from None
        self.running = True
        a._running += 1

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._admission._places -= 1
        if self.running:
            self._admission._running -= 1
            self._admission._slots.release()


class Admission:
    def __init__(self, max_running: int, max_queued: int, queue_timeout: float) -> None:
        if max_running < 1 or max_queued < 0 or queue_timeout < 0:
            raise ValueError("max_running >= 1, max_queued >= 0 and queue_timeout >= 0 are needed")
        self.max_running, self.max_queued, self.queue_timeout = max_running, max_queued, queue_timeout
        self._slots = asyncio.Semaphore(max_running)
        self._places = 0
        self._running = 0

    @property
    def admitted(self) -> int:
        return self._places

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return self._places - self.running

    def enter(self) -> Ticket:
        """A place, or 429 when all max_running + max_queued are taken."""
        if self._places >= self.max_running + self.max_queued:
            raise overloaded(f"the router is full: {self.max_running} requests running and {self.max_queued} "
                             "queued, its limits (tandem router --max-concurrent-requests, --max-queued-requests); "
                             "retry later")
        self._places += 1
        return Ticket(self)
