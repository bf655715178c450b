"""Prefill load as the router counts it: its own in-flight prefills exactly, the polled queue without
counting those twice (back-to-back requests sharing a prefix must keep their worker)."""

from __future__ import annotations

from tandem.worker.router.placement import AFFINITY_SLACK_TOKENS, pick_prefill
from tandem.worker.router.workers import WorkerState
from tandem.worker.server.protocol import WorkerInfo


def worker(url: str, queued: int = 0) -> WorkerState:
    w = WorkerState(url, up=True)
    w.observe(info(queued), inflight_during_poll=0)
    return w


def info(queued: int) -> WorkerInfo:
    return WorkerInfo(model="tiny", role="prefill", pool="local", layout_hash="h", kv_address=None, transport=None,
                      max_model_len=4096, block_size=16, ready=True, draining=False, load_progress=1.0,
                      stats={"queued_prompt_tokens": queued, "num_free_blocks": 10})


def test_finished_prefills_stop_counting_before_the_next_poll() -> None:
    a, b = worker("http://a"), worker("http://b")
    for _ in range(10):  # 10 x 800 tokens, one after the other, no poll in between
        chosen = pick_prefill([a.candidate(), b.candidate()], "h", preferred="http://a")
        assert chosen is not None and chosen.url == "http://a"
        a.prefill_started(800)
        assert a.candidate().queued_tokens == 800
        a.prefill_ended(800)
    assert a.candidate().queued_tokens == 0


def test_concurrent_prefills_do_count() -> None:
    a, b = worker("http://a"), worker("http://b")
    for _ in range(3):
        a.prefill_started(1000)
    assert a.candidate().queued_tokens == 3000 > AFFINITY_SLACK_TOKENS
    chosen = pick_prefill([a.candidate(), b.candidate()], "h", preferred="http://a")
    assert chosen is not None and chosen.url == "http://b"


def test_poll_that_saw_our_prefill_is_not_counted_twice() -> None:
    a = worker("http://a")
    a.prefill_started(800)
    a.observe(info(800), inflight_during_poll=800)  # the worker reports our prompt as queued
    assert a.candidate().queued_tokens == 800
    a.prefill_ended(800)
    assert a.candidate().queued_tokens == 0
    a.prefill_started(800)
    a.observe(info(1300), inflight_during_poll=800)  # 500 tokens from elsewhere (another router)
    assert a.candidate().queued_tokens == 1300
    a.prefill_ended(800)
    assert a.candidate().queued_tokens == 500
    a.prefill_ended(800)  # a stray second end never goes negative
    assert a.candidate().queued_tokens == 500
