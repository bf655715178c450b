"""Block pool and KV cache manager: exact block ids through allocate, free, prefix hits and eviction."""

from __future__ import annotations

import pytest

from tandem.worker.kv.block_pool import BlockPool
from tandem.worker.kv.manager import KVCacheManager
from tandem.worker.kv.prefix_hash import block_hashes, hash_block

BS = 4


def test_allocate_hands_out_lowest_ids_first_and_none_when_short() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None  # only one left; nothing taken
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) is None


def test_freed_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3]
    assert a == [0, 1] and b == [2, 3]
    pool.cache(0, b"h0")
    pool.free(reversed(a))  # block 1 (no hash) goes to the front, cached block 0 to the back
    pool.free(reversed(b))  # 3 then 2 go to the front
    assert pool.allocate(3) == [2, 3, 1]
    assert pool.lookup(b"h0") == 0  # still cached: it was evicted last
    assert pool.allocate(1) == [0]
    assert pool.lookup(b"h0") is None  # handing it out evicted it


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    for block, h in zip(blocks, (b"a", b"b", b"c"), strict=True):
        pool.cache(block, h)
    pool.free([1])
    pool.free([2])
    pool.free([0])
    assert pool.allocate(1) == [1]
    assert pool.lookup(b"b") is None and pool.lookup(b"a") == 0 and pool.lookup(b"c") == 2


def test_refcounts_keep_shared_blocks_alive() -> None:
    pool = BlockPool(2)
    [block] = pool.allocate(1) or []
    pool.cache(block, b"x")
    pool.touch([block])  # a second sequence shares it
    pool.free([block])
    assert pool.num_free == 1  # still owned once
    pool.free([block])
    assert pool.num_free == 2
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_prefix_hashes_chain_over_the_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], BS)
    assert len(a) == 2 and len(b) == 2  # partial blocks are not hashed
    assert a[1] != b[1]  # same block content, different prefix
    assert a[0] == hash_block(b"", [1, 2, 3, 4])
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, known=a[:1]) == a


def test_manager_prefix_hits_counted_and_shared() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    hashes: list[bytes] = []
    table_a: list[int] = []
    assert kv.allocate_slots(table_a, len(tokens)) == [0, 1, 2]
    assert kv.cache_blocks(table_a, hashes, tokens, num_computed_tokens=10, num_registered=0) == 2

    table_b: list[int] = []
    other = [*tokens[:8], 77, 78, 79]
    cached = kv.lookup_prefix(block_hashes(other, BS), len(other))
    assert cached == [0, 1]
    assert kv.allocate_slots(table_b, len(other), cached) == [3]
    assert table_b == [0, 1, 3]
    kv.record_prefix_lookup(len(other), len(cached) * BS)
    assert (kv.prefix_queries, kv.prefix_hits) == (11, 8)

    # An exact block-aligned match still leaves its last token to compute (its logits are needed).
    assert kv.lookup_prefix(block_hashes(tokens[:8], BS), 8) == [0]


def test_manager_allocate_none_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    table: list[int] = []
    assert kv.allocate_slots(table, 8) == [0, 1]
    assert kv.allocate_slots(table, 9) == [2]
    before = list(table)
    assert kv.allocate_slots(table, 13) is None
    assert table == before and kv.num_free_blocks == 0
    kv.free(table)
    assert table == [] and kv.num_free_blocks == 3 and kv.usage == 0.0


def test_reviving_a_free_cached_block_counts_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    tokens = list(range(5))
    hashes: list[bytes] = []
    table: list[int] = []
    kv.allocate_slots(table, 5)
    kv.cache_blocks(table, hashes, tokens, 5, 0)
    kv.free(table)  # block 0 cached and free, block 1 free
    cached = kv.lookup_prefix(block_hashes(tokens, BS), 5)
    assert cached == [0]
    assert not kv.can_allocate([], 12, cached)  # 1 revived + 2 fresh > 2 free
    assert kv.allocate_slots(table, 8, cached) == [1]
    assert table == [0, 1] and kv.num_free_blocks == 0


def test_prefix_caching_off_finds_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    table: list[int] = []
    hashes: list[bytes] = []
    kv.allocate_slots(table, 8)
    assert kv.cache_blocks(table, hashes, list(range(8)), 8, 0) == 0
    assert kv.lookup_prefix(block_hashes(list(range(9)), BS), 9) == []
