"""A tcp KV receiver's limits (worker/transfer/limits.py), against the real receiver over real zmq sockets.

Peers over a cap come from 127.0.0.2, a legitimate sender from 127.0.0.1: each cap is per peer address,
so the legitimate transfer must go through untouched while the other address is refused or cut off.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import uuid

import pytest
import zmq

from tandem.worker.transfer import wire
from tandem.worker.transfer.conformance import TINY_LAYOUT, DoneWaiter, raw_zmtp_dealer, transport_pair
from tandem.worker.transfer.limits import ReceiverLimits, max_part_bytes

OTHER = "127.0.0.2"


def hello(address: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{OTHER}:0;{address.removeprefix('tcp://')}")
    sock.send_multipart([b"H", json.dumps({"protocol": wire.PROTOCOL_VERSION, "transport": "tcp",
                                           "session": uuid.uuid4().hex,
                                           "layout_hash": TINY_LAYOUT.layout_hash()}).encode()])
    return sock


def transfer_once(pair: object, transfer_id: str) -> None:
    done = DoneWaiter()
    ids = [0, 1, 2]
    pair.receiver.expect(transfer_id, ids, 10.0, done)  # type: ignore[attr-defined]
    transfer = pair.sender.connect(pair.receiver.address).begin(transfer_id, ids, 10.0)  # type: ignore[attr-defined]
    for layer in range(TINY_LAYOUT.num_layers):
        transfer.send_layer(layer, ids)
    transfer.finish()
    assert done.wait(5) is None
    assert pair.dst[:, :, ids].equal(pair.src[:, :, ids])  # type: ignore[attr-defined]


def wait_for(predicate: object, timeout: float = 5.0) -> None:
    limit = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < limit, "timed out"
        time.sleep(0.02)


def test_max_message_size_is_derived_from_the_layout() -> None:
    unit = TINY_LAYOUT.bytes_per_block_layer_kv  # 256 bytes
    assert max_part_bytes(TINY_LAYOUT, 32, 2 << 20) == 32 * unit + (64 << 10)  # a frame never holds more than the pool
    assert max_part_bytes(TINY_LAYOUT, 100_000, 2 << 20) == (1 << 20) // unit * unit + (64 << 10)
    assert max_part_bytes(TINY_LAYOUT, 10, 1) == unit + (64 << 10)  # at least one block per frame
    assert max_part_bytes(TINY_LAYOUT, 100_000, 1) == 100_000 * 8 + (64 << 10)  # BEGIN naming the whole pool
    with pytest.raises(ValueError, match="rcvhwm"):
        ReceiverLimits(rcvhwm=0)


def test_an_oversized_part_is_dropped_and_counted_and_others_go_on() -> None:
    with transport_pair("tcp") as pair:
        port = int(pair.receiver.address.rpartition(":")[2])
        sock = raw_zmtp_dealer(port, OTHER)
        with pytest.raises(OSError):  # zmq closed it at the size, long before 1 GiB (maybe in the first send)
            sock.sendall(b"\x02" + struct.pack(">Q", 1 << 30) + b"x" * (1 << 20))
            for _ in range(64):
                sock.sendall(b"x" * (1 << 20))
        sock.close()
        wait_for(lambda: pair.recv_telemetry.refusals("tcp", "dropped") == 1)
        transfer_once(pair, "after-oversized")


def test_a_message_of_endless_parts_is_cut_off_and_counted() -> None:
    # 0-byte parts of one never-ending message: zmq queues each (tens of bytes apiece) and delivers nothing.
    # keep_freed_buffers off, as in tests/serving's flood test it is on: this is about the cut. zmq parses such
    # parts slowly here (~40 KB/s), so the connection ends only once zmq has read what the kernel had
    # queued before the cut (about 100 s for a sender that keeps writing until its own send fails): the
    # flood stops at 2 MiB, the cut must be counted long before that is read, and a legitimate transfer
    # must go through meanwhile.
    with transport_pair("tcp", receiver_options={"keep_freed_buffers": False}, keep_freed_buffers=False) as pair:
        port = int(pair.receiver.address.rpartition(":")[2])
        sock = raw_zmtp_dealer(port, OTHER)
        sock.settimeout(60)
        flood = threading.Thread(target=sock.sendall, args=(b"\x01\x00" * (1 << 20),), daemon=True)
        flood.start()
        try:
            wait_for(lambda: pair.recv_telemetry.refusals("tcp", "bytes_in_flight") >= 1, timeout=30)
            transfer_once(pair, "after-parts")
        finally:
            sock.close()
        assert pair.recv_telemetry.refusals("tcp", "bytes_in_flight") == 1


def test_sessions_and_connections_per_peer_are_capped() -> None:
    limits = ReceiverLimits(max_sessions_per_peer=2, max_connections_per_peer=4)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with transport_pair("tcp", receiver_options={"limits": limits}) as pair:
        socks = [hello(pair.receiver.address, ctx) for _ in range(3)]
        replies = []
        for sock in socks:
            assert sock.poll(5000), "no reply to HELLO"
            kind, body = sock.recv_multipart()
            replies.append((kind, json.loads(body)))
        # Three connections: their HELLOs reach the receiver in any order, the third to arrive is refused.
        assert sorted(kind for kind, _ in replies) == [b"R", b"W", b"W"]
        assert "max_sessions_per_peer" in next(body for kind, body in replies if kind == b"R")["message"]
        assert pair.recv_telemetry.refusals("tcp", "peer_sessions") == 1
        transfer_once(pair, "legit-while-capped")  # 127.0.0.1: its own caps

        port = int(pair.receiver.address.rpartition(":")[2])
        more = [socket.create_connection(("127.0.0.1", port), source_address=(OTHER, 0)) for _ in range(3)]
        wait_for(lambda: pair.recv_telemetry.refusals("tcp", "peer_connections") == 2)  # OTHER's 5th and 6th
        assert pair.recv_telemetry.failures("tcp", "auth_failed") == 0, "a connection cut is no failed handshake"
        for sock in socks:
            sock.close()
        for raw in more:
            raw.close()
        transfer_once(pair, "legit-after")
    ctx.term()


def test_the_total_session_cap_refuses_with_a_clear_message() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with transport_pair("tcp", receiver_options={"limits": ReceiverLimits(max_sessions=1)}) as pair:
        transfer_once(pair, "first")  # the legitimate sender holds the one session
        sock = hello(pair.receiver.address, ctx)
        assert sock.poll(5000)
        kind, body = sock.recv_multipart()
        assert kind == b"R" and "max_sessions" in json.loads(body)["message"]
        assert pair.recv_telemetry.refusals("tcp", "too_many_sessions") == 1
        sock.close()
        transfer_once(pair, "second")
    ctx.term()
