"""The router's live view of its workers: discovered URLs, polled GET /info, local bookkeeping.

A worker is usable when its last /info poll succeeded and said ready (not draining). A request
that fails against a worker marks it down at once, so the next request does not wait for the
next poll to avoid it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import httpx
from pydantic import ValidationError

from tandem.worker.router.discovery import Discovery
from tandem.worker.router.placement import Candidate
from tandem.worker.server.protocol import KV_EVENTS_SINCE, KVEvents, WorkerInfo

log = logging.getLogger(__name__)

DISCOVER_SOON_GAP_S = 1.0  # discover_soon() looks at most this often (a list call to the Kubernetes API)


@dataclass
class WorkerState:
    url: str
    info: WorkerInfo | None = None
    up: bool = False
    last_error: str | None = None
    last_poll: float = 0.0
    pending_blocks: int = 0  # blocks reserved by the router since the last poll (decode)
    # Prefill load (see queued_tokens): prompt tokens of this router's /prefill calls still in
    # flight there, and the polled queue less the part of it those calls accounted for.
    inflight_prefill_tokens: int = 0
    other_queued_tokens: int = 0
    active: int = 0
    first_seen: float = field(default_factory=time.monotonic)
    kv_cursor: int = 0  # where this router's reading of the worker's prefix-cache log stands (GET /kv/events)
    kv_epoch: str | None = None

    @property
    def usable(self) -> bool:
        return self.up and self.info is not None and self.info.ready and not self.info.draining

    @property
    def role(self) -> str | None:
        return self.info.role if self.info else None

    def prefill_started(self, num_tokens: int) -> None:
        self.inflight_prefill_tokens += num_tokens

    def prefill_ended(self, num_tokens: int) -> None:
        """The /prefill call returned or failed: its tokens no longer wait there."""
        self.inflight_prefill_tokens = max(0, self.inflight_prefill_tokens - num_tokens)

    def observe(self, info: WorkerInfo, inflight_during_poll: int) -> None:
        """Take a polled /info. Its queued_prompt_tokens may include prompts of this router's
        in-flight prefills (at most `inflight_during_poll` tokens), which inflight_prefill_tokens
        already counts: only the rest (other routers' work, or none) is added to it."""
        self.info = info
        self.other_queued_tokens = max(0, int(info.stats.get("queued_prompt_tokens", 0)) - inflight_during_poll)
        self.pending_blocks = 0

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens waiting on this worker: ours exactly (a finished prefill no longer counts,
        however recent the last poll), plus others' as of the last poll."""
        return self.other_queued_tokens + self.inflight_prefill_tokens

    def candidate(self) -> Candidate:
        assert self.info is not None
        stats = self.info.stats
        return Candidate(
            url=self.url, layout_hash=self.info.layout_hash,
            free_blocks=int(stats.get("num_free_blocks", 0)) - self.pending_blocks,
            queued_tokens=self.queued_tokens, active=self.active,
            cache_blocks=int(stats.get("num_total_blocks", 0)), cache_queries=int(stats.get("prefix_cache_queries", 0)))


class _ControlRefused(ValueError):
    def __init__(self, url: str) -> None:
        super().__init__(f"{url} refused this router's worker control token (401): the router and the worker "
                         "hold different tokens (--control-token-file)")


class WorkerRegistry:
    def __init__(self, discovery: Discovery, model_name: str | None, poll_interval: float = 0.5,
                 discovery_interval: float = 5.0, headers: Mapping[str, str] | None = None) -> None:
        self.discovery = discovery
        self.model_name = model_name
        self.poll_interval = poll_interval
        self.discovery_interval = discovery_interval
        self.workers: dict[str, WorkerState] = {}
        # The last report of a loaded worker, kept when every worker is down or gone (see any_info).
        self._last_loaded: WorkerInfo | None = None
        # `headers`: the worker control token (control_token.ControlTokens.headers), sent on every poll.
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(2.0), headers=dict(headers or {}))
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()
        self._discover_soon = False  # set by discover_soon(): refresh at the next round, not the next interval
        # Prefill workers' prefix-cache events, read beside each poll, go here (the placer's picture).
        self.on_kv_events: Callable[[str, KVEvents], None] | None = None

    async def start(self) -> None:
        await self.refresh_discovery()
        await self.poll_all()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        await self._client.aclose()

    async def _loop(self) -> None:
        last_discovery = time.monotonic()
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                since = time.monotonic() - last_discovery
                if since >= self.discovery_interval or (self._discover_soon and since >= DISCOVER_SOON_GAP_S):
                    last_discovery, self._discover_soon = time.monotonic(), False
                    await self.refresh_discovery()
                await self.poll_all()
            except Exception:  # keep polling whatever one round did
                log.exception("worker poll round failed")

    async def refresh_discovery(self) -> None:
        try:
            urls = await self.discovery.urls()
        except Exception as exc:
            log.warning("worker discovery failed (keeping %d known workers): %s", len(self.workers), exc)
            return
        for url in urls:
            self.workers.setdefault(url, WorkerState(url))
        for url in list(self.workers):
            if url not in urls:
                log.info("worker %s left discovery", url)
                self.any_info()  # remember the model's facts before the last loaded worker goes
                del self.workers[url]

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(w) for w in list(self.workers.values())))
        self.changed.set()
        self.changed = asyncio.Event()

    async def poll(self, w: WorkerState) -> None:
        inflight_before = w.inflight_prefill_tokens
        try:
            resp = await self._client.get(f"{w.url}/info")
            if resp.status_code == 401:
                raise _ControlRefused(w.url)
            resp.raise_for_status()
            info = WorkerInfo.model_validate(resp.json())
        except (httpx.HTTPError, ValidationError, ValueError) as exc:
            before = w.last_error
            w.up, was_up, w.last_error = False, w.up, f"{type(exc).__name__}: {exc}"  # a timeout's str() is empty
            if was_up or (isinstance(exc, _ControlRefused) and before != w.last_error):
                log.warning("worker %s is down: %s", w.url, w.last_error)
            return
        if self.model_name and info.model != self.model_name:
            w.up, w.last_error = False, f"serves model {info.model!r}, not {self.model_name!r}"
            return
        # Whatever was in flight at either end of the poll may be in the reported queue.
        w.observe(info, max(inflight_before, w.inflight_prefill_tokens))
        w.up, w.last_error, w.last_poll = True, None, time.monotonic()
        if self.on_kv_events is not None and info.role == "prefill" and info.api_version >= KV_EVENTS_SINCE:
            await self._read_kv_events(w, self.on_kv_events)

    async def _read_kv_events(self, w: WorkerState, deliver: Callable[[str, KVEvents], None]) -> None:
        params: dict[str, str | int] = {"since": w.kv_cursor}
        if w.kv_epoch is not None:
            params["epoch"] = w.kv_epoch
        try:
            resp = await self._client.get(f"{w.url}/kv/events", params=params)
            resp.raise_for_status()
            events = KVEvents.model_validate(resp.json())
        except (httpx.HTTPError, ValidationError, ValueError) as exc:  # the next poll reads on from the cursor
            log.debug("worker %s: no prefix-cache events this round: %s", w.url, exc)
            return
        try:
            deliver(w.url, events)
        except ValueError as exc:  # a hash that is not hex: read it all again (a snapshot) next time
            log.warning("worker %s sent prefix-cache events that do not parse: %s", w.url, exc)
            w.kv_cursor, w.kv_epoch = 0, None
            return
        w.kv_cursor, w.kv_epoch = events.next, events.epoch

    def discover_soon(self) -> None:
        """A request found no usable worker: look for new ones at the next poll round. In a rollout the new
        pod is often in the Service already while the old one drains; waiting out the discovery interval
        (5 s) made the gap longer than it is."""
        self._discover_soon = True

    def mark_down(self, url: str, reason: str) -> None:
        w = self.workers.get(url)
        if w is not None and w.up:
            log.warning("worker %s marked down: %s", url, reason)
            w.up, w.last_error = False, reason

    def usable(self, roles: tuple[str, ...]) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.usable and w.role in roles]

    def any_info(self) -> WorkerInfo | None:
        """The report of a worker whose model is loaded (one still loading knows no context length yet)."""
        for w in self.workers.values():
            if w.up and w.info is not None and w.info.max_model_len > 0:
                self._last_loaded = w.info
                return w.info
        # In a rolling update the last old worker can leave discovery before the first new one is
        # polled (seen on the real node: 503s mid-rollout). The model's facts still hold, and the
        # request then waits in dispatch for a usable worker like any other.
        return self._last_loaded

    async def wait_for_change(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout)
