"""Runs a worker: HTTP up first (probes answer while the model loads), engine load in a thread,
and graceful drain on SIGTERM/SIGINT: readiness goes 503, new work is refused, in-flight
requests finish and their KV is released, then the process exits 0. A second Ctrl-C forces it.
An engine that can never step again (a tensor-parallel rank died) ends the process with code 1, at
once: its requests have already failed (the router migrates them), and the pod or `tandem serve`
shows the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from types import FrameType

import uvicorn

from tandem.worker.server.config import WorkerConfig
from tandem.worker.server.http import create_app
from tandem.worker.server.worker import WorkerServer

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first stop signal drains the worker before shutting HTTP down."""

    def __init__(self, config: uvicorn.Config, worker: WorkerServer) -> None:
        super().__init__(config)
        self.worker = worker
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None:
            if sig == signal.SIGINT or self._loop is None:
                self.should_exit = True
                self.force_exit = True
            return
        log.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def exit_now(self) -> None:
        """From any thread: stop serving without a drain (the engine is gone; nothing in flight can finish)."""
        self.should_exit = True

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            await self.worker.drain()
            self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain_then_exit())


def run_worker(cfg: WorkerConfig) -> int:
    worker = WorkerServer(cfg)
    app = create_app(worker)
    # Idle connections stay open longer than the router keeps them (dispatch.KEEPALIVE_S): with equal
    # limits a router could send on one this worker is closing, and read an error instead of an answer.
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5, timeout_keep_alive=30, lifespan="off")
    server = DrainingServer(config, worker)
    worker.on_fatal = server.exit_now
    loader = threading.Thread(target=_load, args=(worker,), name="model-loader", daemon=True)
    loader.start()
    try:
        server.run()
    finally:
        worker.close()
    return 1 if worker.load_error or worker.fatal_error else 0


def _load(worker: WorkerServer) -> None:
    # A failure is reported by /health and the log; the process stays up so probes can say why.
    with contextlib.suppress(Exception):
        worker.load()
