"""The prefix cache's event log (worker/kv/events.py) and the router's picture it corrects
(router/prefix_index.py `apply`)."""

from __future__ import annotations

from tandem.worker.kv.block_pool import BlockPool
from tandem.worker.kv.events import EVICTED, STORED, KVEventLog
from tandem.worker.router.prefix_index import PrefixIndex

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def test_a_reader_gets_the_events_after_its_cursor_in_order() -> None:
    log = KVEventLog()
    first = log.read(0, None, [])
    assert first.snapshot == [] and first.next == 0  # a new reader starts from a snapshot
    log.stored(A)
    log.stored(B)
    log.evicted(A)
    batch = log.read(first.next, first.epoch, [B])
    assert batch.snapshot is None and batch.events == [(STORED, A), (STORED, B), (EVICTED, A)]
    assert log.read(batch.next, batch.epoch, [B]).events == []


def test_a_cursor_the_log_no_longer_reaches_gets_a_snapshot() -> None:
    log = KVEventLog(capacity=2)
    for h in (A, B, C):
        log.stored(h)
    assert log.read(0, log.epoch, [A, B, C]).snapshot == [A, B, C]  # event 0 fell out of the ring
    assert log.read(1, log.epoch, []).events == [(STORED, B), (STORED, C)]
    assert log.read(1, "another-epoch", [C]).snapshot == [C]  # the worker restarted
    assert log.read(99, log.epoch, []).snapshot == []  # a cursor from the future
    cursor = log.read(0, None, []).next
    log.cleared()
    assert log.read(cursor, log.epoch, []).snapshot == []


def test_the_block_pool_logs_what_its_index_stores_and_forgets() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.cache(blocks[0], A)
    pool.cache(blocks[1], A)  # first writer wins: not stored twice
    pool.free(blocks)
    assert pool.allocate(2) is not None  # hands the cached block out again: its hash is forgotten
    assert pool.events.read(0, pool.events.epoch, []).events == [(STORED, A), (EVICTED, A)]


def test_events_and_snapshots_correct_the_routers_picture() -> None:
    index = PrefixIndex()
    index.record("w1", [A, B])
    index.apply("w1", [(False, B)])  # the worker evicted B
    assert index.overlap([A, B], ["w1"]) == {"w1": 1}
    index.apply("w2", [(True, A), (True, B)])  # another router's prompt, computed on w2
    assert index.overlap([A, B], ["w1", "w2"]) == {"w1": 1, "w2": 2}
    claim = index.claim("w1", [A, B, C])  # B and C in flight (A is held already)
    index.apply("w1", snapshot=[C])  # the worker holds C only: A goes, the claim's B stays, C is confirmed
    assert index.overlap([A], ["w1"]) == {"w1": 0} and index.overlap([B, C], ["w1"]) == {"w1": 2}
    index.release(claim)  # its prefill failed: B, which only it held, goes; C, confirmed, stays
    assert index.overlap([B], ["w1"]) == {"w1": 0} and index.overlap([C], ["w1"]) == {"w1": 1}
