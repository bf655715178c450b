"""The router's view of its workers: a worker still loading its model must not define the model's limits."""

from __future__ import annotations

from tandem.worker.router.discovery import StaticDiscovery
from tandem.worker.router.workers import WorkerRegistry, WorkerState
from tandem.worker.server.protocol import WorkerInfo


def info(*, loaded: bool) -> WorkerInfo:
    return WorkerInfo(model="tiny", role="decode", pool="local", layout_hash="abc" if loaded else "",
                      kv_address=None, transport=None, max_model_len=2048 if loaded else 0, block_size=16,
                      ready=loaded, draining=False, load_progress=1.0 if loaded else 0.4)


def registry(*infos: WorkerInfo) -> WorkerRegistry:
    reg = WorkerRegistry(StaticDiscovery([]), "tiny")
    for index, worker_info in enumerate(infos):
        reg.workers[f"http://w{index}"] = WorkerState(f"http://w{index}", info=worker_info, up=True)
    return reg


def test_a_worker_still_loading_gives_no_model_info() -> None:
    assert registry(info(loaded=False)).any_info() is None


def test_the_loaded_worker_answers_even_behind_one_still_loading() -> None:
    found = registry(info(loaded=False), info(loaded=True)).any_info()
    assert found is not None and found.max_model_len == 2048


def test_the_model_s_facts_outlive_a_rollout_gap() -> None:
    """A rolling update: the old workers leave discovery before the new ones are polled. Requests in
    that gap must not fail with "no worker has loaded the model yet" (503s seen on the real node)."""
    import asyncio

    reg = registry(info(loaded=True))
    reg.discovery = StaticDiscovery(["http://new-worker"])  # the old one left, the new one not polled
    asyncio.run(reg.refresh_discovery())
    assert list(reg.workers) == ["http://new-worker"] and not reg.workers["http://new-worker"].up
    found = reg.any_info()
    assert found is not None and found.max_model_len == 2048


def test_a_request_without_a_usable_worker_makes_discovery_look_at_the_next_round() -> None:
    """In a rollout the new pod is listed while the old one drains: a request that found no usable worker
    must not wait out the discovery interval (5 s by default) to learn of it."""
    import asyncio

    class Counting(StaticDiscovery):
        calls = 0

        async def urls(self) -> list[str]:
            Counting.calls += 1
            return await super().urls()

    async def run() -> tuple[int, int]:
        reg = WorkerRegistry(Counting([]), "tiny", poll_interval=0.02, discovery_interval=3600)
        await reg.start()
        try:
            await asyncio.sleep(0.1)
            quiet = Counting.calls
            await asyncio.sleep(1.0)  # DISCOVER_SOON_GAP_S since the start's look
            reg.discover_soon()
            await asyncio.sleep(0.2)
            return quiet, Counting.calls
        finally:
            await reg.close()

    quiet, after = asyncio.run(run())
    assert quiet == 1, "only the start looks before the interval"
    assert after == 2, "discover_soon() looks once, at the next round"
