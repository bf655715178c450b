"""A peer's RDMA memory keys cover its own reservation only, over an EMULATED NIC.

There is no RDMA hardware here. These tests run the real RdmaSender/RdmaReceiver over
rdma_loopback.LoopbackVerbs, which models what a NIC checks for a WRITE: its rkey must be live,
granted to the QP the WRITE arrives on (type-2 memory windows; or, with memory_windows=False, the
fallback of a registration per range, not bound to a QP) and cover the whole range; else it
completes with IBV_WC_REM_ACCESS_ERR and both QPs go to ERR. A hostile peer is played by posting
WRITEs on a real sender connection's QP with keys it should not use; nothing here shows that the
pyverbs path behaves so on a real NIC.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tandem.worker.transfer import TransferError
from tandem.worker.transfer.conformance import (
    RDMA_LOOPBACK,
    TINY_LAYOUT,
    DoneWaiter,
    Pair,
    build_sender,
    make_cache,
    transport_pair,
)
from tandem.worker.transfer.rdma import GrantedKeys, _offset, block_runs, grant_messages
from tandem.worker.transfer.rdma_loopback import LoopbackVerbs

pytestmark = pytest.mark.timeout(60)
LAYERS = TINY_LAYOUT.num_layers
UNIT = TINY_LAYOUT.bytes_per_block_layer_kv
K = 0


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    until = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < until, "condition not reached in time"
        time.sleep(0.005)


@dataclass
class Scene:
    pair: Pair
    nic: LoopbackVerbs  # the receiver's
    conn: Any  # sender 1's connection: transfers "A" (blocks 2, 3) and "B" (6, 7)
    other: Any  # sender 2's connection (its own process-local QP): transfer "C" (blocks 10, 11)
    transfers: dict[str, Any]
    done: dict[str, DoneWaiter]
    other_src: torch.Tensor

    def address(self, layer: int, kind: int, block: int) -> int:
        return self.nic.base + _offset(TINY_LAYOUT, 32, layer, kind, block)

    def key(self, transfer_id: str, layer: int = 0, kind: int = K) -> int:
        conn = self.other if transfer_id == "C" else self.conn
        first = DST[transfer_id][0]
        return int(conn._keys[transfer_id].rkey(layer, kind, first, 1, transfer_id))

    def finish_c(self) -> None:
        """Transfer C, on the other sender's connection, completes intact."""
        for layer in range(1, LAYERS):
            self.transfers["C"].send_layer(layer, SRC["C"])
        self.transfers["C"].finish()
        assert self.done["C"].wait(5) is None
        assert torch.equal(self.pair.dst[:, :, DST["C"]], self.other_src[:, :, SRC["C"]])


DST = {"A": [2, 3], "B": [6, 7], "C": [10, 11]}
SRC = {"A": [0, 1], "B": [4, 5], "C": [8, 9]}


@contextmanager
def scene(memory_windows: bool = True) -> Iterator[Scene]:
    """Three transfers begun, each with layer 0 written: A and B from one sender, C from another."""
    factory = lambda cache, remote: LoopbackVerbs(cache, remote, memory_windows=memory_windows)  # noqa: E731
    with transport_pair(RDMA_LOOPBACK, receiver_options={"verbs_factory": factory}) as pair:
        other_src = make_cache(TINY_LAYOUT, 32, random=True, seed=1)
        other_sender = build_sender(RDMA_LOOPBACK, TINY_LAYOUT, other_src)
        try:
            receiver: Any = pair.receiver
            conn, other = pair.sender.connect(receiver.address), other_sender.connect(receiver.address)
            done = {name: DoneWaiter() for name in DST}
            transfers = {}
            for name, dst in DST.items():
                receiver.expect(name, dst, 30.0, done[name])
                transfers[name] = (other if name == "C" else conn).begin(name, dst, 30.0)
                transfers[name].send_layer(0, SRC[name])
            yield Scene(pair, receiver._verbs, conn, other, transfers, done, other_src)
        finally:
            other_sender.close()


def rogue_write(conn: Any, rkey: int, remote_addr: int, nbytes: int) -> None:
    """What a hostile peer can do on its own QP: post a WRITE with any key to any address."""
    with conn._qp_lock:
        conn._verbs.post_write(conn._qp, 10**9, conn._local_base, nbytes, remote_addr, rkey)


def assert_refused(conn: Any, s: Scene, names: list[str]) -> None:
    """The WRITE was refused: its connection broke, and its transfers failed clearly on both sides."""
    wait_until(lambda: not conn.alive)
    assert "IBV_WC_REM_ACCESS_ERR" in str(conn._broken) and "refused the memory key" in str(conn._broken)
    for name in names:
        with pytest.raises(TransferError) as failed:
            s.transfers[name].finish()
        assert failed.value.reason == "invalid_frame" and "IBV_WC_REM_ACCESS_ERR" in failed.value.message
        error = s.done[name].wait(5)  # the receiver learns it from the sender's ABORT; its keys are revoked
        assert error is not None and "IBV_WC_REM_ACCESS_ERR" in error.message
    pending = s.pair.receiver.pending()
    assert "C" in pending and not set(names) & set(pending)


@pytest.mark.parametrize("windows", [True, False], ids=["windows", "registrations"])
def test_a_key_used_outside_its_reservation_is_refused(windows: bool) -> None:
    with scene(windows) as s:
        before = s.pair.dst.clone()
        rogue_write(s.conn, s.key("A"), s.address(0, K, DST["B"][0]), 2 * UNIT)  # A's key, B's blocks
        assert_refused(s.conn, s, ["A", "B"])
        assert torch.equal(s.pair.dst, before), "a WRITE outside its reservation landed"
        s.finish_c()  # the other sender's transfer is unharmed
        assert s.nic.keys == {}


def test_a_write_that_runs_past_its_range_is_refused() -> None:
    with scene() as s:
        before = s.pair.dst.clone()
        rogue_write(s.conn, s.key("A"), s.address(0, K, DST["A"][1]), 2 * UNIT)  # block 3 and block 4
        assert_refused(s.conn, s, ["A", "B"])
        assert torch.equal(s.pair.dst, before)
        s.finish_c()


def test_another_reservations_key_is_refused_and_the_transfer_says_why() -> None:
    """The sender's own data path, with its keys for A swapped for B's: A's WRITEs carry B's keys."""
    with scene() as s:
        before = s.pair.dst.clone()
        keys_a, keys_b = s.conn._keys["A"], s.conn._keys["B"]
        keys_a._runs = {first: (count, keys_b._runs[DST["B"][0]][1]) for first, (count, _k) in keys_a._runs.items()}
        with pytest.raises(TransferError) as failed:
            for layer in range(1, LAYERS):
                s.transfers["A"].send_layer(layer, SRC["A"])
            s.transfers["A"].finish()
        assert failed.value.reason == "invalid_frame"
        assert "remote access error (IBV_WC_REM_ACCESS_ERR" in failed.value.message
        assert "refused the memory key" in failed.value.message
        assert_refused(s.conn, s, ["B"])
        assert torch.equal(s.pair.dst, before), "B's key wrote into A's blocks"
        s.finish_c()


def test_a_key_copied_to_another_queue_pair_is_refused() -> None:
    """Type-2 windows are bound to the receiver's QP for one sender: the other sender cannot use A's key."""
    with scene() as s:
        before = s.pair.dst.clone()
        rogue_write(s.other, s.key("A"), s.address(0, K, DST["A"][0]), UNIT)  # A's own block, from C's QP
        wait_until(lambda: not s.other.alive)
        assert "IBV_WC_REM_ACCESS_ERR" in str(s.other._broken)
        assert torch.equal(s.pair.dst, before)
        error = s.done["C"].wait(5)  # the copier's own transfer failed
        assert error is not None and "IBV_WC_REM_ACCESS_ERR" in error.message
        for name in ("A", "B"):  # the key's owner is unharmed
            for layer in range(1, LAYERS):
                s.transfers[name].send_layer(layer, SRC[name])
            s.transfers[name].finish()
            assert s.done[name].wait(5) is None
            assert torch.equal(s.pair.dst[:, :, DST[name]], s.pair.src[:, :, SRC[name]])
        assert s.conn.alive and s.nic.keys == {}


def test_without_windows_a_copied_key_still_reaches_only_its_reservation() -> None:
    """The fallback (a registration per range, for devices without type-2 windows) is bound to the
    receiver's protection domain, not to a QP: another sender of the same receiver that got hold of
    A's key can write A's blocks (the digests at FINISH then fail A), but nothing outside them."""
    with scene(memory_windows=False) as s:
        rogue_write(s.other, s.key("A"), s.address(0, K, DST["A"][0]), UNIT)
        assert s.other.alive  # it landed: the documented limit of the fallback
        assert torch.equal(s.pair.dst[0, K, DST["A"][0]], s.other_src[0, K, 0])
        before = s.pair.dst.clone()
        rogue_write(s.other, s.key("A"), s.address(0, K, DST["B"][0]), UNIT)
        wait_until(lambda: not s.other.alive)
        assert torch.equal(s.pair.dst, before)


@pytest.mark.parametrize("windows", [True, False], ids=["windows", "registrations"])
def test_a_key_used_after_its_reservation_ended_is_refused(windows: bool) -> None:
    with scene(windows) as s:
        for layer in range(1, LAYERS):
            s.transfers["A"].send_layer(layer, SRC["A"])
        key = s.key("A")
        s.transfers["A"].finish()
        assert s.done["A"].wait(5) is None
        landed = s.pair.dst.clone()  # A's blocks now belong to the decode side
        rogue_write(s.conn, key, s.address(0, K, DST["A"][0]), UNIT)
        assert_refused(s.conn, s, ["B"])
        assert torch.equal(s.pair.dst, landed), "a revoked key wrote into finished blocks"
        s.finish_c()


def test_keys_are_one_per_layer_kv_and_run_and_all_revoked() -> None:
    with transport_pair(RDMA_LOOPBACK) as pair:
        nic: Any = pair.receiver._verbs  # type: ignore[attr-defined]
        dst = [9, 3, 2, 4, 12, 11]  # runs 2-4, 9, 11-12 (coalesced in sorted order)
        done = DoneWaiter()
        pair.receiver.expect("req-runs", dst, 30.0, done)
        transfer = pair.sender.connect(pair.receiver.address).begin("req-runs", dst, 30.0)
        transfer.send_layer(0, [0, 1, 2, 3, 4, 5])
        assert nic.granted == 3 * 2 * LAYERS and len(nic.keys) == nic.granted
        assert sorted((w.addr - nic.base, w.length) for w in nic.keys.values())[:2] == [
            (_offset(TINY_LAYOUT, 32, 0, 0, 2), 3 * UNIT), (_offset(TINY_LAYOUT, 32, 0, 0, 9), UNIT)]
        for layer in range(1, LAYERS):
            transfer.send_layer(layer, [0, 1, 2, 3, 4, 5])
        transfer.finish()
        assert done.wait(5) is None
        assert torch.equal(pair.dst[:, :, dst], pair.src[:, :, [0, 1, 2, 3, 4, 5]])
        assert nic.keys == {} and nic.revoked == nic.granted


def test_runs_and_grant_messages() -> None:
    assert block_runs([9, 3, 2, 4, 12, 11], 100) == [(2, 3), (9, 1), (11, 2)]
    assert block_runs([0, 1, 2, 3, 4], 2) == [(0, 2), (2, 2), (4, 1)]  # a window covers at most max_blocks
    runs = [(n * 2, 1) for n in range(5000)]
    rkeys = list(range(5000 * 2 * 32))
    messages = grant_messages("t", 0x1000, runs, rkeys, 32)  # 32 layers: 64 keys a run, 264 bytes
    assert len(messages) > 1 and all(len(m[3]) <= 256 << 10 for m in messages)
    assert [m[2] for m in messages][-1] != messages[0][2]  # GRANT parts, then BEGUN
    keys = GrantedKeys(32)
    for message in messages:
        keys.add(message[3])
    assert keys.base == 0x1000 and keys.rkey(31, 1, 9998, 1, "t") == rkeys[4999 * 64 + 63]
    with pytest.raises(TransferError, match=r"no key covering blocks 1\.\.1"):
        keys.rkey(0, 0, 1, 1, "t")
    with pytest.raises(ValueError):
        keys.add(b"\x00" * 9)
    split = GrantedKeys(1)  # a run the receiver split (a window covers at most 2 GiB): blocks 0-1, 2-4
    for message in grant_messages("t", 0, [(0, 2), (2, 3)], [10, 11, 20, 21], 1):
        split.add(message[3])
    assert split.split(0, 1, 1, 3, "t") == [(1, 1, 11), (2, 2, 21)]
    with pytest.raises(TransferError, match="span 2 granted ranges"):
        split.rkey(0, 0, 1, 3, "t")
    with pytest.raises(TransferError, match="no key covering"):
        split.split(0, 0, 4, 2, "t")


def test_a_peer_from_before_scoped_keys_is_refused_at_the_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender that expects the whole pool's key (no "keys" in its endpoint) gets a clear refusal."""
    from tandem.worker.transfer.rdma import RdmaConnection

    monkeypatch.setattr(RdmaConnection, "_hello_extra", lambda self: {"rdma": self._verbs.endpoint(self._qp)})
    with transport_pair(RDMA_LOOPBACK) as pair:
        with pytest.raises(TransferError) as refused:
            pair.sender.connect(pair.receiver.address)
        assert refused.value.reason == "version_mismatch" and "whole KV pool" in refused.value.message


def test_a_run_longer_than_one_window_is_split_on_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window covers at most 2 GiB (mlx5): the receiver splits longer runs and the sender its WRITEs."""
    from tandem.worker.transfer import rdma

    monkeypatch.setattr(rdma, "MAX_WINDOW_BYTES", 2 * UNIT)
    with transport_pair(RDMA_LOOPBACK) as pair:
        theirs: Any = pair.receiver._verbs  # type: ignore[attr-defined]
        mine: Any = pair.sender.verbs  # type: ignore[attr-defined]
        done = DoneWaiter()
        pair.receiver.expect("req-split", [3, 4, 5, 6, 7], 30.0, done)
        transfer = pair.sender.connect(pair.receiver.address).begin("req-split", [3, 4, 5, 6, 7], 30.0)
        for layer in range(LAYERS):
            transfer.send_layer(layer, [0, 1, 2, 3, 4])
        transfer.finish()
        assert done.wait(5) is None
        assert torch.equal(pair.dst[:, :, 3:8], pair.src[:, :, 0:5])
        assert theirs.granted == 3 * 2 * LAYERS and mine.posted == 3 * 2 * LAYERS  # runs 3-4, 5-6, 7
