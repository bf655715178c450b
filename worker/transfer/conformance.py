"""Helpers for the transport conformance suite (tests/transfer/) and for tests that need a pair.

They build real receivers and senders on 127.0.0.1 with a tiny layout, run a peer in a
separate process (so it can be killed mid-transfer), and speak the tcp wire protocol by hand
to inject damaged frames, which no well-behaved sender would produce.

The kind "rdma-loopback" is the rdma transport's real logic over rdma_loopback.LoopbackVerbs, an
emulated in-process NIC (this machine has no RDMA hardware): it says nothing about real NICs, and
its peers must live in one process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from tandem.worker.kv.layout import KVLayout

from . import wire
from .errors import TransferError
from .interface import KVReceiver, KVSender
from .sealing import SealSecrets
from .select import make_receiver, make_sender
from .telemetry import TransferTelemetry

TINY_LAYOUT = KVLayout(model="conformance", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2,
                       head_dim=8)


RDMA_LOOPBACK = "rdma-loopback"
SEALED = "-sealed"  # a kind ending so ("tcp-sealed", "rdma-loopback-sealed") runs with sealing on both sides
CONFORMANCE_SEAL = SealSecrets.from_tokens(["conformance-control-token-0123456789"])


def _unseal(kind: str, options: dict[str, Any]) -> str:
    """The transport kind without the sealed ending; adds the seal to `options` when it had one."""
    if kind.endswith(SEALED):
        options.setdefault("seal", CONFORMANCE_SEAL)
        return kind.removesuffix(SEALED)
    return kind


def transport_label(kind: str) -> str:
    """The `transport` metric label of `kind` (rdma-loopback runs the rdma transport)."""
    kind = kind.removesuffix(SEALED)
    return "rdma" if kind == RDMA_LOOPBACK else kind


def build_receiver(kind: str, layout: KVLayout, kv_cache: torch.Tensor, **options: Any) -> KVReceiver:
    """make_receiver, plus "rdma-loopback": RdmaReceiver over the emulated NIC (and the -sealed kinds)."""
    kind = _unseal(kind, options)
    if kind == RDMA_LOOPBACK:
        from .rdma import RdmaReceiver
        from .rdma_loopback import LoopbackVerbs

        return RdmaReceiver(layout, kv_cache, verbs_factory=options.pop("verbs_factory", LoopbackVerbs), **options)
    return make_receiver(kind, layout, kv_cache, **options)


def build_sender(kind: str, layout: KVLayout, kv_cache: torch.Tensor, **options: Any) -> KVSender:
    """make_sender, plus "rdma-loopback": RdmaSender over the emulated NIC (and the -sealed kinds)."""
    kind = _unseal(kind, options)
    if kind == RDMA_LOOPBACK:
        from .rdma import RdmaSender
        from .rdma_loopback import LoopbackVerbs

        return RdmaSender(layout, kv_cache, verbs_factory=options.pop("verbs_factory", LoopbackVerbs), **options)
    return make_sender(kind, layout, kv_cache, **options)


def make_cache(layout: KVLayout, num_blocks: int, *, random: bool, seed: int = 0) -> torch.Tensor:
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    dtype = getattr(torch, layout.dtype)
    if not random:
        return torch.zeros(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


class DoneWaiter:
    """An on_done callback that records the outcome and lets a test wait for it."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.calls: list[tuple[str, TransferError | None]] = []

    def __call__(self, transfer_id: str, error: TransferError | None) -> None:
        self.calls.append((transfer_id, error))
        self._event.set()

    def wait(self, timeout: float) -> TransferError | None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"on_done was not called within {timeout}s")
        return self.calls[0][1]


@dataclass
class Pair:
    receiver: KVReceiver
    sender: KVSender
    src: torch.Tensor
    dst: torch.Tensor
    recv_telemetry: TransferTelemetry
    send_telemetry: TransferTelemetry


@contextmanager
def transport_pair(kind: str, layout: KVLayout = TINY_LAYOUT, *, src_blocks: int = 32, dst_blocks: int = 32,
                   sender_layout: KVLayout | None = None, receiver_tag: str | None = None,
                   sender_tag: str | None = None, receiver_options: dict[str, Any] | None = None,
                   **sender_options: Any) -> Iterator[Pair]:
    """A receiver (zeroed cache) and a sender (random cache) of `kind`, closed afterwards."""
    sender_layout = sender_layout or layout
    recv_telemetry, send_telemetry = TransferTelemetry(role="decode"), TransferTelemetry(role="prefill")
    dst = make_cache(layout, dst_blocks, random=False)
    src = make_cache(sender_layout, src_blocks, random=True)
    receiver = build_receiver(kind, layout, dst, layout_tag=receiver_tag, telemetry=recv_telemetry,
                              **(receiver_options or {}))
    try:
        sender = build_sender(kind, sender_layout, src, layout_tag=sender_tag, telemetry=send_telemetry,
                              **sender_options)
        try:
            yield Pair(receiver, sender, src, dst, recv_telemetry, send_telemetry)
        finally:
            sender.close()
    finally:
        receiver.close()


# --- peers in their own process (killed mid-transfer by the tests) -------------------------

def _sender_process(kind: str, address: str, transfer_id: str, dst_ids: list[int], layers: int,
                    pipe: Connection) -> None:
    src = make_cache(TINY_LAYOUT, len(dst_ids), random=True)
    sender = build_sender(kind, TINY_LAYOUT, src)
    transfer = sender.connect(address).begin(transfer_id, dst_ids, 60.0)
    for layer in range(layers):
        transfer.send_layer(layer, list(range(len(dst_ids))))
    time.sleep(0.5)  # send_layer only queues: let the frames leave before the parent kills us
    pipe.send("sent")
    time.sleep(120)  # wait to be killed


def _reconnecting_sender_process(address: str, pipe: Connection) -> None:
    """Connect by hand (one connection), close when told, connect a real sender, then run the transfer
    the parent names: what a sender restarting next to a live receiver does."""
    src = make_cache(TINY_LAYOUT, 8, random=True, seed=3)
    first = RawTcpPeer(address, TINY_LAYOUT)
    pipe.send("first connected")
    if pipe.recv() != "close it":
        return
    first.close()
    sender = make_sender("tcp", TINY_LAYOUT, src, streams=1)
    connection = sender.connect(address)
    pipe.send("second connected")
    transfer_id, block_ids = pipe.recv()
    try:
        transfer = connection.begin(transfer_id, block_ids, 20.0)
        for layer in range(TINY_LAYOUT.num_layers):
            transfer.send_layer(layer, list(range(len(block_ids))))
        transfer.finish()
        pipe.send("ok")
    except Exception as exc:  # the parent asserts on what the sender saw
        pipe.send(f"{type(exc).__name__}: {exc}")
    sender.close()


def _receiver_process(kind: str, num_blocks: int, pipe: Connection) -> None:
    receiver = build_receiver(kind, TINY_LAYOUT, make_cache(TINY_LAYOUT, num_blocks, random=False))
    pipe.send(receiver.address)
    while True:
        transfer_id, block_ids = pipe.recv()
        receiver.expect(transfer_id, block_ids, 60.0, lambda *_: None)
        pipe.send("expected")


class PeerProcess:
    """A sender or receiver in a child process; kill() is SIGKILL, like a crashed worker."""

    def __init__(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(*args, child), daemon=True)
        self.process.start()

    def recv(self, timeout: float = 60.0) -> Any:
        if not self.pipe.poll(timeout):
            raise TimeoutError("the peer process did not answer")
        return self.pipe.recv()

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)


def spawn_sender(kind: str, address: str, transfer_id: str, dst_ids: list[int], layers: int) -> PeerProcess:
    return PeerProcess(_sender_process, kind, address, transfer_id, dst_ids, layers)


def spawn_receiver(kind: str, num_blocks: int) -> PeerProcess:
    return PeerProcess(_receiver_process, kind, num_blocks)


def spawn_reconnecting_sender(address: str) -> PeerProcess:
    """tcp only; its cache is make_cache(TINY_LAYOUT, 8, random=True, seed=3)."""
    return PeerProcess(_reconnecting_sender_process, address)


# --- a hand-written tcp peer, for frames no real sender would send --------------------------

def raw_zmtp_dealer(port: int, source_host: str, host: str = "127.0.0.1") -> socket.socket:
    """A plain TCP connection from `source_host` that has completed the ZMTP 3.0 NULL handshake as a DEALER,
    for a test to send bytes no zmq socket would (a huge part, endless parts).

    It waits for zmq's greeting and READY: a message part that arrives while zmq is still sending its own
    READY is a protocol error to zmq, which drops the connection as a failed handshake instead of letting
    the receiver's limits meet it (a race that a loaded machine loses now and then)."""
    sock = socket.create_connection((host, port), timeout=30, source_address=(source_host, 0))
    sock.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + b"\0" * 48)
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    sock.sendall(b"\x04" + bytes([len(body)]) + body)
    greeting = _recv_exactly(sock, 64)
    if greeting[:1] != b"\xff" or greeting[10:11] != b"\x03":
        raise ConnectionError(f"not a ZMTP 3 greeting: {greeting!r}")
    flags, size = _recv_exactly(sock, 2)
    if flags != 0x04 or not _recv_exactly(sock, size).startswith(b"\x05READY"):
        raise ConnectionError("the receiver did not answer READY")
    sock.settimeout(None)  # the handshake's bound only: a flood blocks on TCP's push-back, as intended
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the receiver closed the connection during the ZMTP handshake")
        data += chunk
    return data


class RawTcpPeer:
    """Speaks the tcp wire protocol directly, so a test can send a damaged or misaddressed frame."""

    def __init__(self, address: str, layout: KVLayout) -> None:
        self.layout = layout
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sock.send_multipart(wire.encode_control(wire.HELLO, wire.hello(layout, None, uuid.uuid4().hex, "tcp")))
        kind, body = self.recv(5.0)
        if kind != wire.WELCOME:
            raise TransferError.from_wire(wire.decode_control(body))

    def recv(self, timeout: float) -> list[bytes]:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no reply from the receiver")
        return self.sock.recv_multipart()

    def send_begin(self, transfer_id: str, dst_ids: list[int], prompt_digest: object = None) -> None:
        """Send BEGIN; `prompt_digest` goes on the wire as given (bytes as hex; a str as is, even a malformed one)."""
        body: dict[str, Any] = {"transfer_id": transfer_id, "dst_block_ids": dst_ids}
        if prompt_digest is not None:
            body["prompt_digest"] = prompt_digest.hex() if isinstance(prompt_digest, bytes) else prompt_digest
        self.sock.send_multipart(wire.encode_control(wire.BEGIN, body))

    def send_frame(self, transfer_id: str, layer: int, dst_ids: list[int], k_payload: bytes, v_payload: bytes,
                   flip_byte: int | None = None, kind: int = wire.KV) -> None:
        """Send one data frame; with flip_byte, that V-payload byte is flipped after the digest is taken."""
        raw_id = transfer_id.encode()
        ids = struct.pack(f"<{len(dst_ids)}i", *dst_ids)
        k_body, v_body = bytearray(k_payload), bytearray(v_payload)
        nbytes = len(k_body) + len(v_body)
        digest = wire.frame_digest(0, layer, kind, len(dst_ids), nbytes, raw_id, ids, k_body, v_body)
        if flip_byte is not None:
            v_body[flip_byte] ^= 0x40
        header = wire.pack_header(0, layer, kind, len(dst_ids), nbytes, digest)
        self.sock.send_multipart([wire.DATA, header, raw_id, ids, bytes(k_body), bytes(v_body)])

    def close(self) -> None:
        self.sock.close()
        self._ctx.term()
