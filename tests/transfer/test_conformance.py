"""Transport conformance: the same behaviour from every KV transport (see conftest.py).

Real receivers and senders on 127.0.0.1; peers that must die mid-transfer run in their own
process and get SIGKILL, like a crashed worker. "rdma-loopback" is the rdma transport over an
emulated NIC (see conftest.py): not a hardware result.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from tandem.worker import metrics as m
from tandem.worker.kv.layout import KVLayout
from tandem.worker.transfer import TransferError, TransferTelemetry, wire
from tandem.worker.transfer.conformance import (
    RDMA_LOOPBACK,
    SEALED,
    TINY_LAYOUT,
    DoneWaiter,
    Pair,
    RawTcpPeer,
    build_receiver,
    build_sender,
    spawn_receiver,
    spawn_sender,
    transport_label,
    transport_pair,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def transport(conformance_transport: str) -> str:
    """tcp, rdma (where usable) and rdma-loopback (conftest.py)."""
    return conformance_transport


def failures(telemetry: TransferTelemetry, transport: str, reason: str) -> float:
    return float(telemetry.failures(transport_label(transport), reason))


def needs_two_processes(transport: str) -> None:
    if transport.removesuffix(SEALED) == RDMA_LOOPBACK:
        pytest.skip("the emulated NIC connects queue pairs of one process only; a peer that dies in its own "
                    "process needs real RDMA hardware")


def assert_copied(pair: Pair, src_ids: list[int], dst_ids: list[int]) -> None:
    assert torch.equal(pair.dst[:, :, dst_ids], pair.src[:, :, src_ids])
    untouched = [b for b in range(pair.dst.shape[2]) if b not in dst_ids]
    assert not pair.dst[:, :, untouched].any(), "blocks outside the reservation were written"


def test_blocks_land_where_the_reservation_says(transport: str) -> None:
    src_ids, dst_ids = [3, 1, 7, 8, 9], [20, 2, 5, 6, 31]
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-1", dst_ids, 10.0, done)
        transfer = pair.sender.connect(pair.receiver.address).begin("req-1", dst_ids, 10.0)
        for layer in range(TINY_LAYOUT.num_layers):
            transfer.send_layer(layer, src_ids)
        result = transfer.finish()
        assert done.wait(5) is None
        assert result.bytes_sent == len(src_ids) * TINY_LAYOUT.bytes_per_block
        assert_copied(pair, src_ids, dst_ids)
        assert pair.receiver.pending() == []
        assert pair.recv_telemetry.registry.get_sample_value(
            m.exposed_name(m.KV_TRANSFER_BYTES),
            {"model": "", "role": "decode", "pool": "", "transport": transport_label(transport),
             "direction": "recv"},
        ) == result.bytes_sent


def test_order_of_layers_and_chunks_does_not_matter(transport: str) -> None:
    """Layers sent last-first, and each layer in two chunks (as chunked prefill would), land right."""
    src_ids, dst_ids = list(range(10)), list(range(12, 22))
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-order", dst_ids, 10.0, done)
        transfer = pair.sender.connect(pair.receiver.address).begin("req-order", dst_ids, 10.0)
        for layer in reversed(range(TINY_LAYOUT.num_layers)):
            transfer.send_layer(layer, src_ids[6:], dst_start=6)
        for layer in range(TINY_LAYOUT.num_layers):
            transfer.send_layer(layer, src_ids[:6])
        transfer.finish()
        assert done.wait(5) is None
        assert_copied(pair, src_ids, dst_ids)


@pytest.mark.parametrize(("blocks", "frame_bytes", "max_inflight"), [
    (1, 4 << 20, 64 << 20),  # one block: the smallest transfer
    (200, 1024, 4096),  # many one-block frames through a tiny in-flight window (backpressure)
    (200, 64 << 20, 64 << 20),  # each (layer, K/V) in a single big frame
], ids=["one-block", "many-small-frames", "big-frames"])
def test_small_and_large_batches(transport: str, blocks: int, frame_bytes: int, max_inflight: int) -> None:
    src_ids = list(range(blocks))
    dst_ids = [blocks - 1 - i for i in range(blocks)]  # reversed: a scattered destination
    with transport_pair(transport, src_blocks=blocks, dst_blocks=blocks, frame_bytes=frame_bytes,
                        max_inflight_bytes=max_inflight) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-batch", dst_ids, 20.0, done)
        transfer = pair.sender.connect(pair.receiver.address).begin("req-batch", dst_ids, 20.0)
        for layer in range(TINY_LAYOUT.num_layers):
            transfer.send_layer(layer, src_ids)
        result = transfer.finish()
        assert done.wait(5) is None
        per_frame = max(1, frame_bytes // (2 * TINY_LAYOUT.bytes_per_block_layer_kv))
        assert result.frames == TINY_LAYOUT.num_layers * -(-blocks // per_frame)  # K and V share a frame
        assert torch.equal(pair.dst[:, :, dst_ids], pair.src[:, :, src_ids])


def test_several_transfers_share_a_connection(transport: str) -> None:
    with transport_pair(transport) as pair:
        conn = pair.sender.connect(pair.receiver.address)
        waiters = {}
        transfers = []
        for n in range(4):
            dst_ids = [4 * n + i for i in range(4)]
            waiters[n] = DoneWaiter()
            pair.receiver.expect(f"req-{n}", dst_ids, 10.0, waiters[n])
            transfers.append(conn.begin(f"req-{n}", dst_ids, 10.0))
        for layer in range(TINY_LAYOUT.num_layers):  # interleaved, as a batched prefill would
            for n, transfer in enumerate(transfers):
                transfer.send_layer(layer, [16 + 4 * n + i for i in range(4)])
        for transfer in transfers:
            transfer.finish()
        assert all(w.wait(5) is None for w in waiters.values())
        assert torch.equal(pair.dst[:, :, :16], pair.src[:, :, 16:32])
        assert pair.sender.connect(pair.receiver.address) is conn  # reused while healthy


@pytest.mark.parametrize("difference", ["layout", "tag"])
def test_layout_mismatch_is_refused_on_both_sides(transport: str, difference: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    other = KVLayout(model="conformance", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=16)
    options = ({"sender_layout": other} if difference == "layout"
               else {"receiver_tag": "hash-a", "sender_tag": "hash-b"})
    caplog.set_level(logging.ERROR)
    with transport_pair(transport, **options) as pair:
        with pytest.raises(TransferError) as refused:
            pair.sender.connect(pair.receiver.address)
        assert refused.value.reason == "layout_mismatch"
        if difference == "layout":
            mine, theirs = TINY_LAYOUT.layout_hash(), other.layout_hash()
            assert mine in str(refused.value) and theirs in str(refused.value)
        else:
            assert "hash-a" in str(refused.value) and "hash-b" in str(refused.value)
        # the receiver refused too: logged and counted, not just the sender's view
        assert failures(pair.recv_telemetry, transport, "layout_mismatch") == 1
        assert failures(pair.send_telemetry, transport, "layout_mismatch") == 1
        receiver_logs = [r.getMessage() for r in caplog.records if "refused a sender" in r.getMessage()]
        assert receiver_logs and "layout" in receiver_logs[0]


def test_corrupt_frame_is_rejected_and_never_written(transport: str) -> None:
    if transport != "tcp":
        pytest.skip("frames are injected with the tcp wire protocol; rdma verifies its checksums at finish "
                    "(test_rdma_logic.py corrupts a piece instead)")
    dst_ids = [4, 5, 6]
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-bad", dst_ids, 10.0, done)
        peer = RawTcpPeer(pair.receiver.address, TINY_LAYOUT)
        try:
            payload = b"\x01" * (len(dst_ids) * TINY_LAYOUT.bytes_per_block_layer_kv)
            peer.send_frame("req-bad", 0, dst_ids, payload, payload, flip_byte=17)
            error = done.wait(5)
            assert error is not None and error.reason == "corrupt_frame"
            _kind, body = peer.recv(5)
            assert b"corrupt_frame" in body
        finally:
            peer.close()
        assert not pair.dst.any(), "a corrupt frame reached the cache"
        assert pair.receiver.pending() == []
        assert failures(pair.recv_telemetry, transport, "corrupt_frame") == 1


@pytest.mark.parametrize(("dst_ids", "frame_ids", "layer", "kind", "why"), [
    ([4, 5, 6], [4, 5, 9], 0, 2, "outside the reservation"),
    ([4, 5, 6], [4, 5, 6], 7, 2, "out of range"),
    ([4, 5, 6], [4, 5, 6], 0, 0, "not kind 0"),
], ids=["foreign-block", "bad-layer", "k-only-frame"])
def test_misaddressed_frame_is_rejected_and_never_written(transport: str, dst_ids: list[int],
                                                          frame_ids: list[int], layer: int, kind: int,
                                                          why: str) -> None:
    if transport != "tcp":
        pytest.skip("frames are injected with the tcp wire protocol")
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-misaddressed", dst_ids, 10.0, done)
        peer = RawTcpPeer(pair.receiver.address, TINY_LAYOUT)
        try:
            payload = b"\x01" * (len(frame_ids) * TINY_LAYOUT.bytes_per_block_layer_kv)
            peer.send_frame("req-misaddressed", layer, frame_ids, payload, payload, kind=kind)
            error = done.wait(5)
        finally:
            peer.close()
        assert error is not None and error.reason == "invalid_frame" and why in error.message
        assert not pair.dst.any()


class DigestWaiter(DoneWaiter):
    """on_done that also reads, inside the callback, the prompt digest the receiver holds for the transfer
    (what a decode worker does: KVIntake)."""

    def __init__(self, receiver: object) -> None:
        super().__init__()
        self.receiver = receiver
        self.digests: list[bytes | None] = []

    def __call__(self, transfer_id: str, error: TransferError | None) -> None:
        self.digests.append(self.receiver.prompt_digest(transfer_id))  # type: ignore[attr-defined]
        super().__call__(transfer_id, error)


def test_begin_carries_the_prompt_digest(transport: str) -> None:
    """The prefill side's digest of its prompt reaches the receiver's owner inside the transfer (BEGIN),
    on the authenticated channel; a transfer begun without one reports none."""
    digest = wire.prompt_digest(list(range(100, 140)))
    with transport_pair(transport) as pair:
        conn = pair.sender.connect(pair.receiver.address)
        bound, unbound = DigestWaiter(pair.receiver), DigestWaiter(pair.receiver)
        pair.receiver.expect("req-bound", [1, 2], 10.0, bound)
        pair.receiver.expect("req-unbound", [3, 4], 10.0, unbound)
        assert pair.receiver.prompt_digest("req-bound") is None  # nothing declared before BEGIN
        for transfer_id, dst_ids, declared in (("req-bound", [1, 2], digest), ("req-unbound", [3, 4], None)):
            transfer = conn.begin(transfer_id, dst_ids, 10.0, prompt_digest=declared)
            for layer in range(TINY_LAYOUT.num_layers):
                transfer.send_layer(layer, [5, 6])
            transfer.finish()
        assert bound.wait(5) is None and bound.digests == [digest]
        assert unbound.wait(5) is None and unbound.digests == [None]
        assert pair.receiver.prompt_digest("req-bound") == digest  # still known after on_done
        assert pair.receiver.prompt_digest("req-nobody-expects") is None
        with pytest.raises(ValueError, match="32 bytes"):
            conn.begin("req-short-digest", [7], 5.0, prompt_digest=digest[:16])


def test_a_transfer_completes_only_once_its_begin_arrived(transport: str) -> None:
    """Frames may overtake BEGIN (they use every stream); the transfer completes when BEGIN, which names the
    prompt, has arrived too, and a transfer that never gets one times out saying so."""
    if transport != "tcp":
        pytest.skip("frames are injected with the tcp wire protocol; an rdma sender WRITEs only after BEGIN "
                    "was answered, and its receiver fails a FINISH that comes before BEGIN")
    dst_ids = [4, 5]
    digest = wire.prompt_digest([9, 8, 7])
    payload = b"\x01" * (len(dst_ids) * TINY_LAYOUT.bytes_per_block_layer_kv)
    with transport_pair(transport) as pair:
        late, never = DigestWaiter(pair.receiver), DoneWaiter()
        pair.receiver.expect("req-late-begin", dst_ids, 10.0, late)
        pair.receiver.expect("req-no-begin", [6], 0.5, never)
        peer = RawTcpPeer(pair.receiver.address, TINY_LAYOUT)
        try:
            for layer in range(TINY_LAYOUT.num_layers):
                peer.send_frame("req-late-begin", layer, dst_ids, payload, payload)
                peer.send_frame("req-no-begin", layer, [6], payload[:len(payload) // 2], payload[:len(payload) // 2])
            error = never.wait(5)
            assert error is not None and error.reason == "timeout" and "no BEGIN" in error.message, error
            assert late.calls == [] and pair.receiver.pending() == ["req-late-begin"]
            peer.send_begin("req-late-begin", dst_ids, digest)
            assert late.wait(5) is None and late.digests == [digest]
        finally:
            peer.close()
        assert (pair.dst[:, :, dst_ids].contiguous().view(torch.uint8) == 1).all()  # the frames' bytes landed


@pytest.mark.parametrize("declared", ["zz" * 32, "ab" * 31, 12345], ids=["not-hex", "too-short", "not-a-string"])
def test_a_malformed_prompt_digest_fails_the_transfer(transport: str, declared: object) -> None:
    if transport != "tcp":
        pytest.skip("BEGIN is sent by hand with the tcp wire protocol; both transports parse it in tcp_receiver.py")
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-bad-digest", [4, 5], 10.0, done)
        peer = RawTcpPeer(pair.receiver.address, TINY_LAYOUT)
        try:
            peer.send_begin("req-bad-digest", [4, 5], declared)
            error = done.wait(5)
        finally:
            peer.close()
        assert error is not None and error.reason == "invalid_frame" and "prompt digest" in error.message


def test_a_second_begin_fails_the_transfer(transport: str) -> None:
    """A BEGIN could otherwise declare another prompt for blocks already sent."""
    if transport != "tcp":
        pytest.skip("BEGIN is sent by hand with the tcp wire protocol; both transports parse it in tcp_receiver.py")
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-twice", [4, 5], 10.0, done)
        peer = RawTcpPeer(pair.receiver.address, TINY_LAYOUT)
        try:
            peer.send_begin("req-twice", [4, 5], wire.prompt_digest([1, 2, 3]))
            peer.send_begin("req-twice", [4, 5], wire.prompt_digest([3, 2, 1]))
            error = done.wait(5)
        finally:
            peer.close()
        assert error is not None and error.reason == "invalid_frame" and "twice" in error.message


@pytest.mark.integration
def test_sender_death_mid_transfer_frees_the_reservation(transport: str) -> None:
    needs_two_processes(transport)
    dst_ids = [1, 2, 3, 4]
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-orphan", dst_ids, 60.0, done)
        peer = spawn_sender(transport, pair.receiver.address, "req-orphan", dst_ids, layers=1)
        try:
            assert peer.recv() == "sent"
            started = time.monotonic()
            peer.kill()
            error = done.wait(10)
        finally:
            peer.kill()
        assert error is not None and error.reason == "peer_lost"
        assert time.monotonic() - started < 10, "a dead sender must be noticed long before the deadline"
        assert pair.receiver.pending() == []
        assert failures(pair.recv_telemetry, transport, "peer_lost") == 1


@pytest.mark.integration
def test_receiver_death_mid_transfer_fails_the_sender(transport: str) -> None:
    from tandem.worker.transfer.conformance import make_cache

    needs_two_processes(transport)
    peer = spawn_receiver(transport, 16)
    telemetry = TransferTelemetry()
    sender = build_sender(transport, TINY_LAYOUT, make_cache(TINY_LAYOUT, 16, random=True), telemetry=telemetry)
    try:
        address = peer.recv()
        peer.pipe.send(("req-lost", [0, 1, 2]))
        assert peer.recv() == "expected"
        conn = sender.connect(address)
        transfer = conn.begin("req-lost", [0, 1, 2], 60.0)
        transfer.send_layer(0, [5, 6, 7])
        peer.kill()
        started = time.monotonic()
        with pytest.raises(TransferError) as lost:
            for layer in range(1, TINY_LAYOUT.num_layers):
                transfer.send_layer(layer, [5, 6, 7])
            transfer.finish()
        assert lost.value.reason == "peer_lost"
        assert time.monotonic() - started < 10
        assert not conn.alive
        assert failures(telemetry, transport, "peer_lost") == 1
    finally:
        peer.kill()
        sender.close()


def test_receiver_deadline_expires_and_releases(transport: str) -> None:
    dst_ids = [7, 8]
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-slow", dst_ids, 0.5, done)
        transfer = pair.sender.connect(pair.receiver.address).begin("req-slow", dst_ids, 10.0)
        transfer.send_layer(0, [0, 1])  # then stall: the other layers never come
        started = time.monotonic()
        error = done.wait(5)
        assert error is not None and error.reason == "timeout"
        assert time.monotonic() - started < 3
        assert pair.receiver.pending() == []
        with pytest.raises(TransferError) as late:  # the sender hears about it too
            for layer in range(1, TINY_LAYOUT.num_layers):
                transfer.send_layer(layer, [0, 1])
            transfer.finish()
        assert late.value.reason == "timeout"
        assert failures(pair.recv_telemetry, transport, "timeout") == 1


def test_short_deadline_expires_on_time_beside_a_long_one(transport: str) -> None:
    # The receiver's I/O thread sleeps until its earliest deadline (at most 1 s); a reservation
    # that ends sooner than that must wake it, or it would expire up to a second late.
    with transport_pair(transport) as pair:
        pair.receiver.expect("req-long", [1], 30.0, DoneWaiter())
        for attempt in range(3):
            time.sleep(0.2)  # the I/O thread is asleep again, planning to look in up to a second
            done = DoneWaiter()
            started = time.monotonic()
            pair.receiver.expect(f"req-short-{attempt}", [2], 0.05, done)
            error = done.wait(5)
            assert error is not None and error.reason == "timeout"
            assert time.monotonic() - started < 0.5, f"expired {time.monotonic() - started:.2f}s after expect()"
        assert pair.receiver.pending() == ["req-long"]


def test_sender_deadline_expires_and_receiver_is_told(transport: str) -> None:
    dst_ids = [7, 8]
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-stuck", dst_ids, 30.0, done)
        transfer = pair.sender.connect(pair.receiver.address).begin("req-stuck", dst_ids, 0.5)
        transfer.send_layer(0, [0, 1])
        started = time.monotonic()
        error = done.wait(5)  # the sender's deadline aborts the receiver's reservation at once
        assert error is not None and error.reason == "aborted" and "timeout" in error.message
        assert time.monotonic() - started < 3
        with pytest.raises(TransferError) as expired:
            transfer.finish()
        assert expired.value.reason == "timeout"
        assert failures(pair.send_telemetry, transport, "timeout") == 1


def test_finish_before_every_layer_was_sent(transport: str) -> None:
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-short", [1, 2], 10.0, done)
        transfer = pair.sender.connect(pair.receiver.address).begin("req-short", [1, 2], 10.0)
        transfer.send_layer(0, [3, 4])
        with pytest.raises(TransferError) as short:
            transfer.finish()
        assert short.value.reason == "incomplete"
        error = done.wait(5)
        assert error is not None and error.reason == "aborted"
        assert pair.receiver.pending() == []


def test_transfer_nobody_expects(transport: str) -> None:
    with transport_pair(transport) as pair:
        transfer = pair.sender.connect(pair.receiver.address).begin("req-unknown", [1, 2], 5.0)
        with pytest.raises(TransferError) as unknown:
            for layer in range(TINY_LAYOUT.num_layers):
                transfer.send_layer(layer, [1, 2])
            transfer.finish()
        assert unknown.value.reason == "unknown_transfer"


def test_destination_must_match_the_reservation(transport: str) -> None:
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-wrong", [1, 2], 10.0, done)
        transfer = pair.sender.connect(pair.receiver.address).begin("req-wrong", [2, 1], 5.0)
        error = done.wait(5)
        assert error is not None and error.reason == "invalid_frame"
        with pytest.raises(TransferError):
            for layer in range(TINY_LAYOUT.num_layers):
                transfer.send_layer(layer, [1, 2])
            transfer.finish()
        assert not pair.dst.any()


def test_connect_to_nobody_fails_fast(transport: str) -> None:
    with transport_pair(transport, connect_timeout_s=0.5) as pair:
        address = pair.receiver.address
        pair.receiver.close()
        started = time.monotonic()
        with pytest.raises(TransferError) as nobody:
            pair.sender.connect(address)
        assert nobody.value.reason == "connect_failed"
        assert time.monotonic() - started < 3


def test_close_releases_pending_reservations(transport: str) -> None:
    with transport_pair(transport) as pair:
        done = DoneWaiter()
        pair.receiver.expect("req-closing", [1], 30.0, done)
        pair.receiver.close()
        error = done.wait(5)
        assert error is not None and error.reason == "closed"


def test_bad_arguments_are_refused_at_once(transport: str) -> None:
    with transport_pair(transport, src_blocks=8, dst_blocks=8) as pair:
        noop = DoneWaiter()
        with pytest.raises(ValueError, match="out of range"):
            pair.receiver.expect("x", [3, 8], 1.0, noop)
        with pytest.raises(ValueError, match="repeat"):
            pair.receiver.expect("x", [3, 3], 1.0, noop)
        with pytest.raises(ValueError, match="deadline_s"):
            pair.receiver.expect("x", [3], 0, noop)
        pair.receiver.expect("x", [3], 5.0, noop)
        with pytest.raises(ValueError, match="already expected"):
            pair.receiver.expect("x", [4], 5.0, noop)
        conn = pair.sender.connect(pair.receiver.address)
        with pytest.raises(ValueError, match="out of range"):
            conn.begin("x", [9], 1.0)
        transfer = conn.begin("x", [3], 5.0)
        with pytest.raises(ValueError, match="layer"):
            transfer.send_layer(TINY_LAYOUT.num_layers, [0])
        with pytest.raises(ValueError, match="do not fit"):
            transfer.send_layer(0, [0, 1])
        transfer.abort("test is done")
    with pytest.raises(ValueError, match="shape"):
        build_receiver(transport, TINY_LAYOUT, torch.zeros(3, 2, 4, 4, 2, 4))
    with pytest.raises(ValueError, match="dtype"):
        build_sender(transport, TINY_LAYOUT, torch.zeros(3, 2, 4, 4, 2, 8, dtype=torch.float16))
