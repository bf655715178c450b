"""The rdma transport's own logic, run end to end over an EMULATED NIC.

There is no RDMA hardware here (no device, no InfiniBand support in the kernel). These tests run
the real RdmaSender/RdmaReceiver (zmq handshake, BEGIN/FINISH with piece digests, the receiver's
checks, deadlines, scoped memory keys) over rdma_loopback.LoopbackVerbs, an in-process stand-in for a NIC
that copies bytes with memmove. They show the transport's bookkeeping is right; they do not show
that any of it works on a real NIC. The pyverbs adapter is tested with fake pyverbs modules, and
with the real pyverbs objects where pyverbs imports.
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from tandem.worker import metrics as m
from tandem.worker.transfer import RdmaProbe, TransferError, TransferTelemetry, make_receiver, make_sender
from tandem.worker.transfer.conformance import (
    RDMA_LOOPBACK,
    TINY_LAYOUT,
    DoneWaiter,
    Pair,
    make_cache,
    transport_pair,
)
from tandem.worker.transfer.rdma import RdmaReceiver, paired_runs
from tandem.worker.transfer.rdma_loopback import LoopbackVerbs
from tandem.worker.transfer.rdma_probe import choose_gid_index, load_pyverbs, pick_port, sysfs_ports
from tandem.worker.transfer.rdma_verbs import PyverbsVerbs, completion_reason, path_mtu, post_write_request

pytestmark = pytest.mark.timeout(60)
LAYERS = range(TINY_LAYOUT.num_layers)


def send_all(transfer: Any, src_ids: list[int], layers: range = LAYERS) -> None:
    for layer in layers:
        transfer.send_layer(layer, src_ids)


def rdma(pair: Pair) -> tuple[Any, Any]:
    """(the receiver's emulated NIC, the sender's)."""
    receiver: Any = pair.receiver
    sender: Any = pair.sender
    return receiver._verbs, sender.verbs


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    until = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < until, "condition not reached in time"
        time.sleep(0.005)


def transfer_again_and_check(pair: Pair, conn: Any, src_ids: list[int], dst_ids: list[int]) -> None:
    """The sender's next transfer uses a new connection, and its bytes arrive intact."""
    fresh = pair.sender.connect(pair.receiver.address)
    assert fresh is not conn and fresh.alive
    done = DoneWaiter()
    pair.receiver.expect("req-again", dst_ids, 10.0, done)
    transfer = fresh.begin("req-again", dst_ids, 10.0)
    send_all(transfer, src_ids)
    transfer.finish()
    assert done.wait(5) is None
    assert torch.equal(pair.dst[:, :, dst_ids], pair.src[:, :, src_ids])


# --- revoking: nothing lands in blocks after on_done(error) / cancel() ---------------------------

@pytest.mark.parametrize("how", ["receiver-timeout", "cancel"])
def test_a_failed_reservations_keys_are_revoked_before_its_blocks_are_freed(how: str) -> None:
    src_ids, dst_ids = [0, 1, 2], [5, 6, 7]
    with transport_pair(RDMA_LOOPBACK) as pair:
        theirs, nic = rdma(pair)
        done = DoneWaiter()
        pair.receiver.expect("req-late", dst_ids, 0.5 if how == "receiver-timeout" else 30.0, done)
        conn = pair.sender.connect(pair.receiver.address)
        transfer = conn.begin("req-late", dst_ids, 30.0)
        transfer.send_layer(0, src_ids)
        assert torch.equal(pair.dst[0, :, dst_ids], pair.src[0, :, src_ids])  # layer 0 landed
        nic.hold_writes = True  # layer 1's WRITEs are on the wire when the reservation ends
        transfer.send_layer(1, src_ids)
        if how == "cancel":
            assert pair.receiver.cancel("req-late")
        else:
            error = done.wait(5)
            assert error is not None and error.reason == "timeout"
        assert theirs.keys == {}  # revoked before on_done ran / cancel() returned
        pair.dst[:, :, dst_ids] = 7.0  # the blocks are reused at once, for something else
        nic.release_writes()
        nic.hold_writes = False
        with pytest.raises(TransferError):
            send_all(transfer, src_ids, range(2, TINY_LAYOUT.num_layers))
            transfer.finish()
        assert bool((pair.dst[:, :, dst_ids] == 7.0).all()), "a late RDMA WRITE landed in freed blocks"
        wait_until(lambda: not conn.alive)  # its late WRITEs were refused: RC puts the QP in ERR
        assert "IBV_WC_REM_ACCESS_ERR" in str(conn._broken)
        transfer_again_and_check(pair, conn, src_ids, [10, 11, 12])


def test_revoking_one_reservation_leaves_the_senders_other_transfers_alone() -> None:
    """A sender that writes nothing more for the transfer that failed keeps its connection."""
    with transport_pair(RDMA_LOOPBACK) as pair:
        waiters = {name: DoneWaiter() for name in ("a", "b")}
        conn = pair.sender.connect(pair.receiver.address)
        transfers = {}
        for n, name in enumerate(waiters):
            pair.receiver.expect(name, [n], 30.0, waiters[name])
            transfers[name] = conn.begin(name, [n], 30.0)
            transfers[name].send_layer(0, [n])
        assert pair.receiver.cancel("a")
        send_all(transfers["b"], [1], range(1, TINY_LAYOUT.num_layers))
        transfers["b"].finish()
        assert waiters["b"].wait(5) is None
        assert torch.equal(pair.dst[:, :, [1]], pair.src[:, :, [1]])
        assert conn.alive and pair.sender.connect(pair.receiver.address) is conn
        assert pair.receiver.pending() == [] and rdma(pair)[0].keys == {}


def test_the_sender_holds_its_abort_until_its_writes_completed() -> None:
    src_ids, dst_ids = [0, 1], [3, 4]
    with transport_pair(RDMA_LOOPBACK) as pair:
        _, nic = rdma(pair)
        landed_at_done: list[int] = []
        done = DoneWaiter()

        def on_done(transfer_id: str, error: TransferError | None) -> None:
            landed_at_done.append(nic.landed)
            done(transfer_id, error)

        pair.receiver.expect("req-abort", dst_ids, 30.0, on_done)
        transfer = pair.sender.connect(pair.receiver.address).begin("req-abort", dst_ids, 30.0)
        nic.hold_writes = True  # the WRITEs stay "on the wire"
        transfer.send_layer(0, src_ids)
        transfer.abort("caller gave up")
        with pytest.raises(TimeoutError):
            done.wait(0.3)  # no ABORT while WRITEs are outstanding
        nic.release_writes()
        error = done.wait(5)
        assert error is not None and error.reason == "aborted"
        assert landed_at_done == [nic.posted] and nic.posted > 0
        assert pair.sender.connect(pair.receiver.address).alive  # the ABORT came after its WRITEs: no harm done


def test_writes_that_never_complete_break_and_fence_the_connection() -> None:
    dst_ids = [3, 4]
    with transport_pair(RDMA_LOOPBACK, drain_timeout_s=0.3) as pair:
        _, nic = rdma(pair)
        done = DoneWaiter()
        pair.receiver.expect("req-stuck", dst_ids, 30.0, done)
        conn = pair.sender.connect(pair.receiver.address)
        transfer = conn.begin("req-stuck", dst_ids, 30.0)
        nic.hold_writes = True
        transfer.send_layer(0, [0, 1])
        transfer.abort("caller gave up")
        error = done.wait(5)  # the ABORT, once the drain timed out
        assert error is not None and error.reason == "aborted"
        assert not conn.alive and "did not complete" in str(conn._broken)
        nic.release_writes()  # too late: the QP is in ERR, they are flushed
        assert nic.landed == 0 and not pair.dst.any()
        nic.hold_writes = False
        transfer_again_and_check(pair, conn, [0, 1], dst_ids)


# --- error completions, post failures, setup failures ------------------------------------------

def test_an_error_completion_breaks_the_connection_and_connect_makes_a_new_one() -> None:
    with transport_pair(RDMA_LOOPBACK) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-badkey", [1, 2], 30.0, done)
        conn: Any = pair.sender.connect(pair.receiver.address)
        transfer = conn.begin("req-badkey", [1, 2], 30.0)
        transfer.send_layer(0, [0, 1])
        keys = conn._keys["req-badkey"]  # a wrong rkey: the WRITE completes with a remote access error
        keys._runs = {first: (count, tuple(k ^ 1 for k in rkeys)) for first, (count, rkeys) in keys._runs.items()}
        with pytest.raises(TransferError) as failed:
            send_all(transfer, [0, 1], range(1, TINY_LAYOUT.num_layers))
            transfer.finish()
        assert failed.value.reason == "invalid_frame" and "IBV_WC_REM_ACCESS_ERR" in failed.value.message
        assert "refused the memory key" in failed.value.message
        assert not conn.alive
        error = done.wait(5)  # the sender's ABORT freed the reservation
        assert error is not None and error.reason == "aborted"
        transfer_again_and_check(pair, conn, [0, 1], [1, 2])


class _FailingPost(LoopbackVerbs):
    def post_write(self, qp: Any, wr_id: int, local_addr: int, length: int, remote_addr: int, rkey: int) -> None:
        raise TransferError("peer_lost", "ibv_post_send failed: [Errno 12] Cannot allocate memory")


def test_a_failed_post_frees_its_slot_and_fails_the_transfer() -> None:
    with transport_pair(RDMA_LOOPBACK, verbs_factory=_FailingPost) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-post", [1], 30.0, done)
        conn: Any = pair.sender.connect(pair.receiver.address)
        transfer = conn.begin("req-post", [1], 30.0)
        with pytest.raises(TransferError) as failed:
            transfer.send_layer(0, [0])
        assert failed.value.reason == "peer_lost" and "could not post" in failed.value.message
        assert conn._outstanding == {} and conn._writes == {} and not conn.alive
        error = done.wait(5)
        assert error is not None and error.reason == "aborted"


class _RefusingConnect(LoopbackVerbs):
    def connect(self, qp: Any, remote: dict[str, Any]) -> None:
        raise RuntimeError("modify QP to RTR failed: Invalid argument")  # as pyverbs would, untyped


def test_a_receiver_that_cannot_set_up_a_queue_pair_refuses_at_once() -> None:
    with transport_pair(RDMA_LOOPBACK, receiver_options={"verbs_factory": _RefusingConnect}) as pair:
        started = time.monotonic()
        with pytest.raises(TransferError) as refused:
            pair.sender.connect(pair.receiver.address)
        assert refused.value.reason == "unavailable" and "Invalid argument" in refused.value.message
        assert time.monotonic() - started < 3  # a REFUSE, not the connect timeout
        receiver: Any = pair.receiver
        assert receiver._qps == {}


def test_a_piece_that_changed_in_flight_fails_its_digest_and_keeps_the_connection() -> None:
    with transport_pair(RDMA_LOOPBACK) as pair:
        _, nic = rdma(pair)
        done = DoneWaiter()
        pair.receiver.expect("req-corrupt", [2, 3], 30.0, done)
        conn = pair.sender.connect(pair.receiver.address)
        transfer = conn.begin("req-corrupt", [2, 3], 30.0)
        nic.hold_writes = True
        send_all(transfer, [0, 1])  # digests taken from the source as it was
        pair.src[1, 0, 0] += 1.0  # ...which changes before the NIC reads it
        nic.release_writes()
        with pytest.raises(TransferError) as corrupt:
            transfer.finish()
        assert corrupt.value.reason == "corrupt_frame"
        error = done.wait(5)
        assert error is not None and error.reason == "corrupt_frame"
        assert pair.sender.connect(pair.receiver.address) is conn  # FINISH came after the WRITEs: no harm done


def test_a_finish_before_begin_fails_the_transfer() -> None:
    """BEGIN names the blocks and the prompt their KV was computed from (the decode worker checks that
    prompt): a FINISH whose transfer was never begun must not complete it. A real sender cannot send one
    (it WRITEs only after BEGIN was answered), so the receiver's handler is called directly."""
    with transport_pair(RDMA_LOOPBACK) as pair:
        receiver: Any = pair.receiver
        done = DoneWaiter()
        receiver.expect("req-unbegun", [2, 3], 30.0, done)
        with receiver._lock:
            reservation = receiver._reservations["req-unbegun"]
        receiver._on_finish(reservation, {"pieces": []})
        error = done.wait(5)
        assert error is not None and error.reason == "invalid_frame" and "before BEGIN" in error.message


class PyverbsRDMAError(Exception):
    """Named like pyverbs' own error: the adapter must not let it escape."""


MW_2A, MW_2B = 1 << 23, 1 << 24  # ibv_device_cap_flags


def fake_pyverbs(cap_flags: int = MW_2B, **broken: Any) -> dict[str, Any]:
    """Fake pyverbs modules: enough of them for PyverbsVerbs' setup and grants; `broken` replaces pieces."""
    port_attr = SimpleNamespace(link_layer=1, gid_tbl_len=1, active_mtu=5, lid=1)
    device_attr = SimpleNamespace(device_cap_flags=cap_flags, max_mw=1 << 16 if cap_flags else 0)
    context = SimpleNamespace(query_port=lambda port: port_attr, close=lambda: None,
                              query_device=lambda: device_attr,
                              query_gid=lambda port, index: SimpleNamespace(gid="fe80:0000:0000:0000:0000:0000:0000:0001"),
                              query_gid_type=lambda port, index: 0)
    enums = SimpleNamespace(IBV_LINK_LAYER_ETHERNET=2,
                            ibv_gid_type_sysfs=SimpleNamespace(IBV_GID_TYPE_SYSFS_ROCE_V2=1),
                            ibv_access_flags=SimpleNamespace(IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2,
                                                             IBV_ACCESS_MW_BIND=16),
                            ibv_device_cap_flags=SimpleNamespace(IBV_DEVICE_MEM_WINDOW_TYPE_2A=MW_2A,
                                                                 IBV_DEVICE_MEM_WINDOW_TYPE_2B=MW_2B),
                            ibv_mw_type=SimpleNamespace(IBV_MW_TYPE_2=2),
                            ibv_wr_opcode=SimpleNamespace(IBV_WR_BIND_MW=8),
                            ibv_send_flags=SimpleNamespace(IBV_SEND_SIGNALED=2),
                            ibv_wc_status=lambda status: SimpleNamespace(name="IBV_WC_SUCCESS" if status == 0
                                                                         else "IBV_WC_MW_BIND_ERR"))
    keys = iter(range(100, 1 << 20))

    def region(pd: Any, n: int, access: int, address: int) -> Any:
        return SimpleNamespace(lkey=1, rkey=next(keys), access=access, addr=address, length=n, closed=[],
                               close=lambda: None)

    class Window:
        made: ClassVar[list[Any]] = []

        def __init__(self, pd: Any, mw_type: int) -> None:
            self.rkey, self.closed = next(keys) << 8, False  # a type-2 window's key before its first bind
            Window.made.append(self)

        def close(self) -> None:
            self.closed = True

    class BindWR:
        def __init__(self, wr_id: int, opcode: int, send_flags: int) -> None:
            self.wr_id, self.opcode, self.closed = wr_id, opcode, False

        def set_bind_wr(self, mw: Any, info: Any) -> None:
            self.rkey, self.info = mw.rkey + 1, info  # set_bind_wr bumps the key's variant byte

        def close(self) -> None:
            self.closed = True

    modules: dict[str, Any] = {
        "device": SimpleNamespace(Context=broken.get("Context", lambda name: context)),
        "pd": SimpleNamespace(PD=lambda ctx: object()),
        "mr": SimpleNamespace(MR=broken.get("MR", region), MW=Window,
                              MWBindInfo=lambda mr, addr, length, access: SimpleNamespace(addr=addr, length=length,
                                                                                          access=access)),
        "wr": SimpleNamespace(SendWR=BindWR),
        "cq": SimpleNamespace(cqe_status_to_str=lambda status: "ok" if status == 0 else "memory window bind error"),
        "enums": enums,
    }
    return modules


class _FakeQP:
    """A receiver QP on the fake device: bind WRs complete with `status` when polled."""

    def __init__(self, status: int = 0) -> None:
        self.posted: list[Any] = []
        self.status = status
        self.qp = SimpleNamespace(post_send=self.posted.append)
        self.cq = SimpleNamespace(poll=self._poll)

    def _poll(self, num_entries: int) -> tuple[int, list[Any]]:
        done = self.posted[:num_entries]
        del self.posted[:num_entries]
        return len(done), [SimpleNamespace(wr_id=wr.wr_id, status=self.status, vendor_err=0) for wr in done]


def test_pyverbs_grants_type2_windows_bound_on_the_peers_qp() -> None:
    """The calls PyverbsVerbs makes to grant and revoke (fake pyverbs: no device here)."""
    cache = make_cache(TINY_LAYOUT, 4, random=False)
    m = fake_pyverbs()
    verbs = PyverbsVerbs(cache, True, modules=m, device=("mlx5_0", 1))
    assert verbs.windows and verbs.key_scope == "queue pair"
    assert verbs.mr.access == 1 | 16  # LOCAL_WRITE | MW_BIND: the pool itself is not remotely writable
    qp = _FakeQP()
    ranges = [(verbs.base + 64 * n, 64) for n in range(70)]  # more than one batch of binds
    rkeys = verbs.grant(qp, ranges)  # type: ignore[arg-type]
    windows = m["mr"].MW.made
    assert len(rkeys) == len(windows) == 70 and rkeys == [w.rkey + 1 for w in windows]
    verbs.revoke(rkeys[:10])
    assert [w.closed for w in windows] == [True] * 10 + [False] * 60
    failing = _FakeQP(status=1)
    with pytest.raises(TransferError) as refused:
        verbs.grant(failing, ranges[:3])  # type: ignore[arg-type]
    assert refused.value.reason == "unavailable" and "memory window bind error" in refused.value.message
    assert all(w.closed for w in windows[70:])  # a failed grant leaves no window behind
    verbs.close()


def test_pyverbs_without_type2_windows_registers_per_range() -> None:
    cache = make_cache(TINY_LAYOUT, 4, random=False)
    verbs = PyverbsVerbs(cache, True, modules=fake_pyverbs(cap_flags=0), device=("mlx5_0", 1))
    assert not verbs.windows and verbs.key_scope == "protection domain" and verbs.mr.access == 1
    rkeys = verbs.grant(_FakeQP(), [(verbs.base, 64), (verbs.base + 128, 64)])  # type: ignore[arg-type]
    regions = [verbs._granted[k] for k in rkeys]
    assert [(r.addr - verbs.base, r.length, r.access) for r in regions] == [(0, 64, 3), (128, 64, 3)]
    verbs.revoke(rkeys)
    assert verbs._granted == {}
    verbs.close()


def _raise(*_args: Any, **_kwargs: Any) -> Any:
    raise PyverbsRDMAError("Failed to open device mlx5_0. Errno: 19, No such device")


def test_pyverbs_errors_in_setup_become_transfer_errors() -> None:
    cache = make_cache(TINY_LAYOUT, 4, random=False)
    verbs = PyverbsVerbs(cache, True, modules=fake_pyverbs(), device=("mlx5_0", 1))
    assert (verbs.gid_index, verbs.lkey) == (0, 1) and verbs.tensor is cache and not hasattr(verbs, "rkey")
    verbs.close()
    assert verbs.tensor is None
    with pytest.raises(TransferError) as unopened:
        PyverbsVerbs(cache, True, modules=fake_pyverbs(Context=_raise), device=("mlx5_0", 1))
    assert unopened.value.reason == "unavailable" and "PyverbsRDMAError" in unopened.value.message
    with pytest.raises(TransferError) as unregistered:
        PyverbsVerbs(cache, True, modules=fake_pyverbs(MR=_raise), device=("mlx5_0", 1))
    assert "RLIMIT_MEMLOCK" in unregistered.value.message


def test_bad_cache_is_refused_before_anything_is_registered() -> None:
    opened: list[object] = []

    def factory(cache: torch.Tensor, remote_write: bool) -> LoopbackVerbs:
        opened.append(cache)
        return LoopbackVerbs(cache, remote_write)

    with pytest.raises(ValueError, match="shape"):
        RdmaReceiver(TINY_LAYOUT, torch.zeros(3, 2, 4, 4, 2, 4), verbs_factory=factory)
    assert opened == []


def test_a_failing_constructor_releases_the_registration() -> None:
    made: list[LoopbackVerbs] = []

    def factory(cache: torch.Tensor, remote_write: bool) -> LoopbackVerbs:
        made.append(LoopbackVerbs(cache, remote_write))
        return made[-1]

    cache = make_cache(TINY_LAYOUT, 4, random=False)
    with RdmaReceiver(TINY_LAYOUT, cache, verbs_factory=factory) as first:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(ValueError, match="cannot listen"):
            RdmaReceiver(TINY_LAYOUT, cache, port=port, verbs_factory=factory)
        assert made[1].closed and not made[0].closed


def test_closing_destroys_every_queue_pair() -> None:
    with transport_pair(RDMA_LOOPBACK) as pair:
        theirs, mine = rdma(pair)
        pair.sender.connect(pair.receiver.address)
        qps = [qp.qpn for qp in theirs.qps + mine.qps]
        assert len(qps) == 2
    assert [theirs.state_of(qpn) for qpn in qps] == ["CLOSED", "CLOSED"]


# --- auto falls back when rdma cannot be set up ------------------------------------------------

def _no_rdma(cache: torch.Tensor, remote_write: bool) -> LoopbackVerbs:
    raise TransferError("unavailable", "cannot register the KV cache (test)")


def test_auto_falls_back_to_tcp_when_rdma_setup_fails(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    usable = lambda: RdmaProbe(True, "mlx5_0 port 1 is ACTIVE (test)")  # noqa: E731
    telemetry = TransferTelemetry(model="m", role="decode", pool="p")
    cache = make_cache(TINY_LAYOUT, 4, random=False)
    with make_receiver("auto", TINY_LAYOUT, cache, telemetry=telemetry, probe_rdma=usable,
                       verbs_factory=_no_rdma) as receiver:
        assert receiver.transport == "tcp"
    sender = make_sender("auto", TINY_LAYOUT, cache, telemetry=telemetry, probe_rdma=usable, verbs_factory=_no_rdma)
    assert sender.transport == "tcp"
    sender.close()
    assert telemetry.registry.get_sample_value(
        m.KV_TRANSPORT_INFO.name, {"model": "m", "role": "decode", "pool": "p", "transport": "tcp"}) == 1
    assert any("cannot register the KV cache (test)" in r.getMessage() for r in caplog.records)
    with pytest.raises(TransferError) as explicit:
        make_receiver("rdma", TINY_LAYOUT, cache, probe_rdma=usable, verbs_factory=_no_rdma)
    assert explicit.value.reason == "unavailable"


# --- pure pieces --------------------------------------------------------------------------------

def test_mtu_is_the_smaller_of_both_sides() -> None:
    assert path_mtu(5, 3) == 3 and path_mtu(3, 5) == 3
    with pytest.raises(TransferError):
        path_mtu(5, None)
    with transport_pair(RDMA_LOOPBACK, receiver_options={"verbs_factory": lambda c, w: LoopbackVerbs(c, w, mtu=3)}) \
            as pair:
        theirs, mine = rdma(pair)
        pair.sender.connect(pair.receiver.address)
        assert [qp.path_mtu for qp in theirs.qps + mine.qps] == [3, 3]


ROCE = [
    (0, "fe80:0000:0000:0000:0202:c9ff:fe00:0001", "roce_v1"),
    (1, "fe80:0000:0000:0000:0202:c9ff:fe00:0001", "roce_v2"),
    (2, "0000:0000:0000:0000:0000:ffff:0a00:0001", "roce_v1"),
    (3, "0000:0000:0000:0000:0000:ffff:0a00:0001", "roce_v2"),
]


def test_gid_selection_by_type() -> None:
    assert choose_gid_index(ROCE, "Ethernet") == 3  # RoCEv2, IPv4-mapped
    assert choose_gid_index(ROCE[:3], "Ethernet") == 1  # RoCEv2
    assert choose_gid_index(ROCE[:1], "Ethernet") == 0  # anything non-zero
    zero = (0, "0000:0000:0000:0000:0000:0000:0000:0000", "roce_v1")
    assert choose_gid_index([zero, ROCE[2]], "Ethernet") == 2
    assert choose_gid_index(ROCE, "InfiniBand") == 0
    assert choose_gid_index(ROCE, "Ethernet", override=2) == 2
    with pytest.raises(TransferError, match="not a populated GID index"):
        choose_gid_index([zero], "Ethernet", override=0)
    with pytest.raises(TransferError, match="no usable"):
        choose_gid_index([zero], "InfiniBand")


def test_device_setting_picks_the_port(tmp_path: Any) -> None:
    for device, port in (("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_1", 2)):
        path = tmp_path / device / "ports" / str(port)
        path.mkdir(parents=True)
        for name, value in (("state", "4: ACTIVE"), ("link_layer", "Ethernet"), ("rate", "100 Gb/sec")):
            (path / name).write_text(value)
    ports = sysfs_ports(tmp_path)
    assert pick_port(ports, "") == ports[0]
    picked = pick_port(ports, "mlx5_1:2")
    assert not isinstance(picked, str) and (picked.device, picked.port) == ("mlx5_1", 2)
    assert "names no ACTIVE port" in str(pick_port(ports, "mlx5_9"))
    assert "DEVICE:PORT" in str(pick_port(ports, "mlx5_1:x"))


def test_completion_statuses_map_to_reasons() -> None:
    assert completion_reason("IBV_WC_SUCCESS") is None
    assert completion_reason("IBV_WC_RETRY_EXC_ERR") == "peer_lost"
    assert completion_reason("IBV_WC_WR_FLUSH_ERR") == "peer_lost"
    assert completion_reason("IBV_WC_REM_ACCESS_ERR") == "invalid_frame"
    assert completion_reason("IBV_WC_LOC_PROT_ERR") == "invalid_frame"


def test_runs_contiguous_on_both_sides() -> None:
    assert paired_runs([0, 1, 2, 7, 8], [4, 5, 9, 10, 11]) == [(0, 4, 2), (2, 9, 1), (7, 10, 2)]
    assert paired_runs([3], [0]) == [(3, 0, 1)]


# --- finding 1: every SGE and SendWR is closed exactly once ------------------------------------

def counting_wr_module(base_sge: Any, base_wr: Any) -> tuple[Any, list[str]]:
    closed: list[str] = []

    class SGE(base_sge):  # type: ignore[misc, valid-type]
        def close(self) -> None:
            closed.append("sge")
            super().close()

    class SendWR(base_wr):  # type: ignore[misc, valid-type]
        def close(self) -> None:
            closed.append("wr")
            super().close()

    return SimpleNamespace(SGE=SGE, SendWR=SendWR), closed


class _Plain:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Qp:
    def __init__(self, fail: bool) -> None:
        self.fail, self.posted = fail, 0

    def post_send(self, wr: Any) -> None:
        if self.fail:
            raise PyverbsRDMAError("Failed to post send. Errno: 12")
        self.posted += 1


@pytest.mark.parametrize("fail", [False, True], ids=["posted", "post-failed"])
def test_work_requests_are_closed_exactly_once(fail: bool) -> None:
    wr_module, closed = counting_wr_module(_Plain, _Plain)
    enums = SimpleNamespace(ibv_wr_opcode=SimpleNamespace(IBV_WR_RDMA_WRITE=0),
                            ibv_send_flags=SimpleNamespace(IBV_SEND_SIGNALED=2))
    qp = _Qp(fail)
    if fail:
        with pytest.raises(PyverbsRDMAError):
            post_write_request({"wr": wr_module, "enums": enums}, qp, 7, 0x1000, 64, 1, 2, 0x2000)
    else:
        post_write_request({"wr": wr_module, "enums": enums}, qp, 7, 0x1000, 64, 1, 2, 0x2000)
    assert sorted(closed) == ["sge", "wr"] and qp.posted == (0 if fail else 1)


def _pyverbs_problem() -> str | None:
    try:
        load_pyverbs()
    except TransferError as exc:
        return exc.message
    return None


@pytest.mark.skipif(_pyverbs_problem() is not None, reason=f"{_pyverbs_problem()}")
def test_real_pyverbs_work_requests_are_closed_after_posting() -> None:
    import pyverbs.libibverbs_enums as e
    import pyverbs.wr

    wr_module, closed = counting_wr_module(pyverbs.wr.SGE, pyverbs.wr.SendWR)
    seen: list[Any] = []

    class Qp:
        def post_send(self, wr: Any) -> None:
            seen.append((wr.wr_id, wr.opcode, wr.num_sge))

    post_write_request({"wr": wr_module, "enums": e}, Qp(), 9, 0x1000, 4096, 11, 12, 0x2000)
    assert seen == [(9, e.ibv_wr_opcode.IBV_WR_RDMA_WRITE, 1)] and sorted(closed) == ["sge", "wr"]
