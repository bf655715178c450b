"""A canary for silent wrong output: one greedy probe, disaggregated and local, must give the same tokens.

Disaggregated serving can fail without an error: KV written to the wrong blocks, or computed for
another layout that happens to have the same size, decodes into fluent nonsense. Every `interval_s`
the router runs one small greedy probe twice on the same decode worker, first prefilled by that worker
itself and then prefilled by a prefill worker of its layout that ships the KV (local first: the
decode worker's own prefix cache then holds its own KV for the prompt, never the shipped one), and
compares the token ids. The result is counted in tandem_router_canary_probes_total{result}:
match, mismatch, skipped (no prefill+decode pair of one layout, or the KV did not arrive, so nothing
was compared) or error (a path failed). Each probe's prompt is new (a counter in its text), so no
prefix cache on either side answers it from an earlier probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from tandem.worker import metrics as m
from tandem.worker.router.dispatch import Dispatcher
from tandem.worker.router.errors import APIError
from tandem.worker.router.telemetry import RouterTelemetry
from tandem.worker.server.protocol import CANARY_ID_PREFIX, Sampling

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 60.0
PROBE_TOKENS = 8
PROBE_TIMEOUT_S = 60.0
# About 50 tokens with common tokenizers: several KV blocks at the usual block sizes, so a block-order or
# layout fault shows. {n} makes every probe's prompt new.
PROBE_TEXT = ("Canary probe {n}. The router compares this greedy continuation, computed once by the decode "
              "worker alone and once from KV shipped by a prefill worker, token by token. Rivers, bridges, "
              "seven lanterns, a copper kettle and the quiet harbour at dawn.")


class Canary:
    def __init__(self, dispatcher: Dispatcher, telemetry: RouterTelemetry,
                 encode: Callable[[str], Awaitable[list[int]]], interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.dispatcher = dispatcher
        self.telemetry = telemetry
        self.encode = encode  # the router's tokenizer (it is fetched from a worker, so it may not exist yet)
        self.interval_s = interval_s
        self.probes = 0
        self.last: str | None = None  # the last probe's result, for /workers and tests

    async def run(self) -> None:
        """Probe every interval until cancelled; one probe's failure never ends the loop."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("canary probe failed")
                self._count("error")

    async def probe(self) -> str:
        self.probes += 1
        try:
            prompt = await self.encode(PROBE_TEXT.format(n=self.probes))
        except APIError as exc:  # no worker could give the tokenizer yet: nothing to compare
            log.info("canary probe skipped: %s", exc.message)
            return self._count("skipped")
        sampling = Sampling.model_validate({"max_tokens": PROBE_TOKENS, "temperature": 0.0, "ignore_eos": True})
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        try:
            compared = await self.dispatcher.compare_paths(f"{CANARY_ID_PREFIX}{uuid.uuid4().hex[:12]}", prompt,
                                                          sampling, deadline)
        except APIError as exc:
            log.warning("canary probe failed: %s", exc.message)
            return self._count("error")
        if compared is None:
            return self._count("skipped")
        decode_url, prefill_url, local, shipped = compared
        if local == shipped:
            return self._count("match")
        log.error("canary: greedy output differs between the disaggregated path (prefill %s -> decode %s) and a "
                  "local prefill on the same decode worker: %s vs %s. The KV that decode worker receives is "
                  "wrong (a KV layout or block mismatch between the pools?)", prefill_url, decode_url, shipped,
                  local)
        return self._count("mismatch")

    def _count(self, result: str) -> str:
        self.last = result
        self.telemetry.inc(m.ROUTER_CANARY_PROBES, result=result)
        return result


@contextlib.asynccontextmanager
async def running(canary: Canary | None) -> AsyncIterator[Canary | None]:
    """Run the canary's loop for the life of the app (nothing when it is off)."""
    task = asyncio.create_task(canary.run()) if canary is not None else None
    try:
        yield canary
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
