"""The router's picture of its prefill workers' prefix caches follows what the prefills did (issue 24).

The dispatcher runs against stand-in workers (httpx.MockTransport): a decode worker that reserves, and
prefill workers that answer, refuse (503), drop the connection or never answer. Only a prefill that
answered may leave the prompt's blocks in the picture; before this, each placement recorded them
up front for good, so a worker that refused or never computed a prompt was pictured holding it and
the next turn of that conversation was sent there for a cache it did not have. The same runs check
the per-worker hit-rate counters on the router's /metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.worker.kv.prefix_hash import block_hashes
from tandem.worker.router.discovery import StaticDiscovery
from tandem.worker.router.dispatch import Dispatcher
from tandem.worker.router.telemetry import RouterTelemetry
from tandem.worker.router.workers import WorkerRegistry, WorkerState
from tandem.worker.server.protocol import Sampling, WorkerInfo

BS = 16
PROMPT = list(range(1, 65))  # 4 full blocks
A, B, DECODE = "http://prefill-a", "http://prefill-b", "http://decode"

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


def info(role: str) -> WorkerInfo:
    return WorkerInfo(model="tiny", role=role, pool="local", layout_hash="h", kv_address="tcp://x", transport="tcp",
                      max_model_len=4096, block_size=BS, ready=True, draining=False, load_progress=1.0,
                      stats={"num_free_blocks": 100, "num_total_blocks": 100})


def dispatcher(prefill: dict[str, Handler]) -> Dispatcher:
    """A dispatcher whose decode worker reserves and whose prefill workers answer with `prefill[url]`
    (A is tried first: both are idle, and ties go by URL)."""
    reg = WorkerRegistry(StaticDiscovery([]), "tiny")
    for url, role in ((DECODE, "decode"), *((u, "prefill") for u in prefill)):
        reg.workers[url] = WorkerState(url, info=info(role), up=True, last_poll=time.monotonic())

    async def handle(request: httpx.Request) -> httpx.Response:
        base, path = f"{request.url.scheme}://{request.url.host}", request.url.path
        if path == "/kv/reserve":
            return httpx.Response(200, json={"transfer_id": "t", "kv_address": "tcp://x", "block_ids": [1, 2, 3, 4, 5],
                                             "layout_hash": "h"})
        if path == "/kv/cancel":
            return httpx.Response(200, json={})
        assert path == "/prefill", path
        return await prefill[base](request)

    disp = Dispatcher(reg, RouterTelemetry("tiny"), set(), block_size=BS)
    disp.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return disp


async def answers(request: httpx.Request) -> httpx.Response:
    n = len(json.loads(request.content)["prompt_token_ids"])
    return httpx.Response(200, json={"first_token_id": 5, "num_prompt_tokens": n, "kv_sent": True})


async def draining(request: httpx.Request) -> httpx.Response:
    return httpx.Response(503, json={"detail": "draining"})


async def drops(request: httpx.Request) -> httpx.Response:
    raise httpx.RemoteProtocolError("the worker closed the connection", request=request)


async def start(disp: Dispatcher, rid: str = "r1") -> str:
    """One disaggregated start of PROMPT; the prefill worker that answered."""
    first = await disp._disaggregated_start(rid, PROMPT, Sampling(max_tokens=4), disp.registry.workers[DECODE],
                                            time.monotonic() + 30)
    assert first is not None
    return disp.placer.holder(block_hashes(PROMPT, BS)) or "?"


def held(disp: Dispatcher, url: str) -> int:
    return disp.placer.index.overlap(block_hashes(PROMPT, BS), [url])[url]


def counters(disp: Dispatcher) -> dict[tuple[str, str], float]:
    """(series, worker) -> value for the router's per-worker prefill series."""
    return {(s.name, s.labels["worker"]): s.value
            for f in text_string_to_metric_families(disp.telemetry.render().decode()) for s in f.samples
            if "worker" in s.labels and s.name.endswith("_total")}


@pytest.mark.parametrize("failure", [draining, drops], ids=["refused-503", "connection-dropped"])
def test_a_prefill_that_failed_leaves_no_blocks_on_its_worker(failure: Handler) -> None:
    async def run() -> None:
        disp = dispatcher({A: failure, B: answers})
        try:
            assert await start(disp) == B  # A was placed first, failed; B took the prompt
            assert held(disp, A) == 0, "the refused prefill left the prompt in A's picture"
            assert held(disp, B) == 4 and disp.placer.index.pending(B) == 0
            # Only the prefill that answered is counted: 64 prompt tokens on B, none expected cached yet.
            assert counters(disp) == {("tandem_router_prefill_prompt_tokens_total", B): 64.0,
                                      ("tandem_router_prefix_expected_hit_tokens_total", B): 0.0}
        finally:
            await disp.close()

    asyncio.run(run())


def test_a_prefill_given_up_by_its_caller_leaves_no_blocks() -> None:
    entered = asyncio.Event()

    async def never(request: httpx.Request) -> httpx.Response:
        entered.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def run() -> None:
        disp = dispatcher({A: never})
        try:
            task = asyncio.create_task(start(disp))
            await asyncio.wait_for(entered.wait(), 10)
            assert held(disp, A) == 4  # in flight: requests right behind it see the prompt there
            task.cancel()  # the client went away
            with pytest.raises(asyncio.CancelledError):
                await task
            assert held(disp, A) == 0 and disp.placer.index.size(A) == 0
            assert counters(disp) == {}
        finally:
            await disp.close()

    asyncio.run(run())


def test_the_second_placement_of_a_prompt_counts_as_a_hit_on_its_worker() -> None:
    async def run() -> None:
        disp = dispatcher({A: answers, B: answers})
        try:
            first = await start(disp, "r1")
            assert await start(disp, "r2") == first
            other = B if first == A else A
            disp.telemetry.initialise_workers([A, B])  # as /metrics does for every known prefill worker
            assert counters(disp) == {
                ("tandem_router_prefill_prompt_tokens_total", first): 128.0,
                # the second time 3 of the 4 blocks: the engine computes the last token's block whatever it holds
                ("tandem_router_prefix_expected_hit_tokens_total", first): 48.0,
                ("tandem_router_prefill_prompt_tokens_total", other): 0.0,
                ("tandem_router_prefix_expected_hit_tokens_total", other): 0.0,
            }
        finally:
            await disp.close()

    asyncio.run(run())
