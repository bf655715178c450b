"""Runs one LLMEngine in a dedicated thread that steps continuously.

The engine is not thread-safe, so every call into it (add, abort, reserve, release...) is a
command queued here and executed on the engine thread between two steps. Outputs go back to
asyncio consumers through per-request queues (loop.call_soon_threadsafe), so HTTP handlers
never block the event loop and the engine never waits for a slow client.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Idle wait between checks when the engine has nothing to do: short enough that a new request
# starts promptly (a command also wakes the thread at once), long enough not to spin a core.
IDLE_WAIT_S = 0.05


@dataclass
class Subscription:
    """Where one request's outputs go: an asyncio queue living on `loop`."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]
    arrival: float = field(default_factory=time.monotonic)


class EngineLoop:
    def __init__(self, engine: Any, on_step: Callable[[list[Any], Any], None] | None = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[Any], Any], Future[Any]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._subs: dict[str, Subscription] = {}
        self._subs_lock = threading.Lock()
        self._on_step = on_step  # (outputs, stats) after every step; used for metrics
        self._on_fatal = on_fatal  # (message) once, when the engine can never step again; the loop then ends
        self.stats: Any = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.fatal_error: str | None = None
        self._stall: str | None = None  # the engine's last stall reason, logged once per episode

    # --- lifecycle ---
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- calls from any thread ---
    def call(self, fn: Callable[[Any], Any]) -> Future[Any]:
        """Run fn(engine) on the engine thread; the future holds its result or exception."""
        fut: Future[Any] = Future()
        if self._stop.is_set() or not self._thread.is_alive():
            fut.set_exception(RuntimeError("engine loop is not running"))
            return fut
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    async def acall(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def subscribe(self, request_id: str) -> Subscription:
        sub = Subscription(asyncio.get_running_loop(), asyncio.Queue())
        with self._subs_lock:
            if request_id in self._subs:
                raise ValueError(f"request id {request_id!r} is already in flight on this worker")
            self._subs[request_id] = sub
        return sub

    def unsubscribe(self, request_id: str) -> None:
        with self._subs_lock:
            self._subs.pop(request_id, None)

    def num_subscribers(self) -> int:
        with self._subs_lock:
            return len(self._subs)

    # --- engine thread ---
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if self._stop.is_set():
                break
            try:
                busy = self.engine.has_unfinished_requests()
                if not busy:
                    self.engine.check_health()
                outputs = self.engine.step() if busy else []
            except Exception as exc:  # a bug in the engine must not silently hang every client
                if _is_fatal(exc):
                    log.error("the engine cannot go on: %s", exc)
                    self.fatal_error = str(exc)
                    self._fail_everything(f"the worker's engine failed: {exc}")
                    if self._on_fatal is not None:
                        self._on_fatal(str(exc))
                    break
                log.exception("engine step failed")
                self._fail_everything(f"engine step failed: {exc}")
                continue
            if outputs:
                self._dispatch(outputs)
            self.stats = self.engine.stats()
            if self._on_step is not None:
                try:
                    self._on_step(outputs, self.stats)
                except Exception:
                    log.exception("metrics hook failed")
            stall = None if outputs else self.engine.stall
            if stall is not None and self._stall is None:
                log.warning("the queue is stalled until a KV transfer ends: %s", stall)
            self._stall = stall
            if not busy or stall is not None:  # a stalled queue waits for a command (release, cancel, add)
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
        self._drain_commands()

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:
                fut.set_exception(exc)

    def _dispatch(self, outputs: list[Any]) -> None:
        with self._subs_lock:
            targets = [(self._subs.get(out.request_id), out) for out in outputs]
        for sub, out in targets:
            if sub is not None:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, out)

    def _fail_everything(self, message: str) -> None:
        with self._subs_lock:
            subs = dict(self._subs)
        for request_id, sub in subs.items():
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort after engine failure")
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, EngineFailure(request_id, message))


def _is_fatal(exc: Exception) -> bool:
    """A tensor-parallel group that failed has ended: its ranks are out of step and no later step can run."""
    from tandem.worker.engine.tp_group import TensorParallelError

    return isinstance(exc, TensorParallelError)


@dataclass
class EngineFailure:
    """Put on a subscriber's queue instead of a RequestOutput when the engine itself failed."""

    request_id: str
    message: str
