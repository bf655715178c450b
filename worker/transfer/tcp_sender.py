"""Prefill side of the tcp transport: connections to receivers and outgoing transfers.

A connection is several zmq DEALER sockets (parallel streams, one TCP connection each) owned
by one I/O thread. Callers (the engine's per-layer callback) pack frames on their own thread:
gather the blocks (zero-copy when they are one run of a CPU cache), checksum them, and queue
them; the I/O thread hands them to zmq without copying. Backpressure: at most
`max_inflight_bytes` of frames may be unacknowledged per connection, so a slow receiver
slows the sender down instead of filling memory.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from tandem.worker.kv.layout import KVLayout

from . import allocator, wire
from .blocks import check_cache, read_blocks
from .errors import ABORTED, CLOSED, CONNECT_FAILED, INCOMPLETE, PEER_LOST, TIMEOUT, TransferError
from .telemetry import TransferTelemetry
from .tracking import validate_block_ids
from .zmqutil import Wakeup, check_deadline, disconnected_fds, encode_transfer_id

log = logging.getLogger(__name__)
_SEQ = struct.Struct("<Q")


@dataclass(frozen=True)
class TransferResult:
    transfer_id: str
    bytes_sent: int
    seconds: float
    frames: int


@dataclass
class _State:
    """An outgoing transfer's mutable state; guarded by its connection's condition variable."""

    done: bool = False
    error: TransferError | None = None
    next_seq: int = 0
    unacked: dict[int, int] = field(default_factory=dict)  # seq -> bytes
    bytes_sent: int = 0


class OutgoingTransfer:
    """One request's KV on its way: send_layer() as layers are computed, then finish()."""

    def __init__(self, conn: TcpConnection, transfer_id: str, dst_ids: torch.Tensor, deadline: float) -> None:
        self.transfer_id = transfer_id
        self.raw_id = transfer_id.encode()
        self._conn, self._dst_ids, self.deadline = conn, dst_ids, deadline
        # Per layer, 1 per destination position once sent (K and V travel together).
        self._sent = [bytearray(dst_ids.numel()) for _ in range(conn.layout.num_layers)]
        self._unsent = conn.layout.num_layers * dst_ids.numel()
        self._state = _State()
        self._started = time.monotonic()

    def send_layer(self, layer: int, src_block_ids: list[int], dst_start: int = 0) -> None:
        """Send K and V of `layer` for `src_block_ids` into destination blocks dst_start.. (positions
        in the dst_block_ids given to begin()). Returns once the frames are queued; blocks only
        while the connection's in-flight window is full. Raises TransferError if the transfer failed.
        """
        conn = self._conn
        self._raise_if_failed()
        if not isinstance(layer, int) or not 0 <= layer < conn.layout.num_layers:
            raise ValueError(f"layer {layer!r} out of range 0..{conn.layout.num_layers - 1}")
        src = validate_block_ids(src_block_ids, conn.local_blocks, f"send_layer({layer})")
        if not isinstance(dst_start, int) or dst_start < 0 or dst_start + src.numel() > self._dst_ids.numel():
            raise ValueError(f"send_layer({layer}): {src.numel()} blocks from position {dst_start} do not fit "
                             f"the {self._dst_ids.numel()} destination blocks")
        count = src.numel()
        if self._sent[layer].find(1, dst_start, dst_start + count) != -1:
            raise ValueError(f"send_layer({layer}): some of these destination blocks were already sent")
        per_frame = max(1, conn.frame_bytes // (2 * conn.layout.bytes_per_block_layer_kv))
        for first in range(0, src.numel(), per_frame):
            src_chunk = src[first:first + per_frame]
            dst_chunk = self._dst_ids[dst_start + first:dst_start + first + src_chunk.numel()]
            conn.transmit(self, layer, src_chunk, dst_chunk)
        self._sent[layer][dst_start:dst_start + count] = b"\x01" * count
        self._unsent -= count

    def finish(self) -> TransferResult:
        """Wait until the receiver confirms every (layer, K/V, block) arrived and verified."""
        self._raise_if_failed()
        if self._unsent:
            layer = next(index for index, sent in enumerate(self._sent) if sent.find(0) != -1)
            error = TransferError(INCOMPLETE, f"finish() before every block was sent (layer {layer} is "
                                  "missing blocks)", self.transfer_id)
            self._conn.fail(self, error, tell_receiver=True)
            raise error
        extra = self._conn.prepare_finish(self)
        self._conn.enqueue(self, wire.encode_control(wire.FINISH, {"transfer_id": self.transfer_id, **extra}))
        self._conn.wait(self, lambda s: s.done)
        seconds = time.monotonic() - self._started
        result = TransferResult(self.transfer_id, self._state.bytes_sent, seconds, self._state.next_seq)
        self._conn.telemetry.transferred(self._conn.transport, "send", result.bytes_sent, seconds)
        return result

    def abort(self, message: str = "aborted by the sender") -> None:
        """Give up: the receiver frees its reservation at once. Safe to call more than once."""
        self._conn.fail(self, TransferError(ABORTED, message, self.transfer_id), tell_receiver=True)

    @property
    def error(self) -> TransferError | None:
        return self._state.error

    def _raise_if_failed(self) -> None:
        error = self._state.error
        if error is not None:
            raise error

    def __enter__(self) -> OutgoingTransfer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is not None and not self._state.done:
            self.abort(f"the sender raised {type(exc).__name__}")


class TcpConnection:
    """Streams to one receiver, after a successful handshake. Made by TcpSender.connect()."""

    transport = "tcp"

    def __init__(self, sender: TcpSender, address: str) -> None:
        self.address = address
        self.layout, self.kv_cache, self.telemetry = sender.layout, sender.kv_cache, sender.telemetry
        self.local_blocks = sender.kv_cache.shape[2]
        self.frame_bytes, self.max_inflight_bytes = sender.frame_bytes, sender.max_inflight_bytes
        self.cv = threading.Condition()
        self._inflight = 0
        self._outbox: deque[tuple[OutgoingTransfer | None, Sequence[bytes | memoryview], bool]] = deque()
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._broken: TransferError | None = None
        self._closing = False
        self._next_stream = 0
        self._wakeup = Wakeup()
        session = uuid.uuid4().hex
        self._sockets: list[zmq.Socket[bytes]] = []
        self._monitors: list[zmq.Socket[bytes]] = []
        for index in range(sender.streams):
            sock = sender.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"{session}/{index}".encode())
            for option, value in ((zmq.LINGER, 200), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
                sock.setsockopt(option, value)
            self._monitors.append(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
            sock.connect(address)
            self._sockets.append(sock)
        try:
            self.remote_blocks = self._handshake(sender, session)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{address}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._broken is None and not self._closing

    def _handshake(self, sender: TcpSender, session: str) -> int:
        first = self._sockets[0]
        first.send_multipart(wire.encode_control(wire.HELLO, wire.hello(
            self.layout, sender.layout_tag, session, self.transport, self._hello_extra())))
        if not first.poll(int(sender.connect_timeout_s * 1000)):
            self.telemetry.failed(self.transport, CONNECT_FAILED)
            raise TransferError(CONNECT_FAILED, f"no KV receiver answered at {self.address} within "
                                f"{sender.connect_timeout_s:g}s")
        kind, body = first.recv_multipart()
        reply = wire.decode_control(body)
        if kind == wire.REFUSE:
            error = TransferError.from_wire(reply)
            log.error("KV receiver at %s refused this sender: %s", self.address, error.message)
            self.telemetry.failed(self.transport, error.reason)
            raise error
        if kind != wire.WELCOME or not isinstance(reply.get("num_blocks"), int):
            raise TransferError(CONNECT_FAILED, f"unexpected handshake reply from {self.address}")
        self._on_welcome(reply)
        for index, sock in enumerate(self._sockets[1:], start=1):
            sock.send_multipart(wire.encode_control(wire.ATTACH, {"session": session, "stream": index}))
        return int(reply["num_blocks"])

    # --- transport-specific parts (rdma.py overrides these) -------------------------------

    def _hello_extra(self) -> dict[str, Any]:
        return {}

    def _on_welcome(self, reply: dict[str, Any]) -> None:
        pass

    def transmit(self, transfer: OutgoingTransfer, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Send one frame: K and V of kv_cache[layer, :, src] into the receiver's blocks dst."""
        count = src.numel()
        nbytes = 2 * count * self.layout.bytes_per_block_layer_kv
        seq = self.reserve_frame(transfer, nbytes)
        src_list = src.tolist()
        try:
            k_part = read_blocks(self.kv_cache, layer, wire.K, src_list)
            v_part = read_blocks(self.kv_cache, layer, wire.V, src_list)
        except Exception as exc:
            self.fail(transfer, TransferError(ABORTED, f"could not read source blocks: {exc}",
                                              transfer.transfer_id), tell_receiver=True)
            raise
        ids = struct.pack(f"<{count}i", *dst.tolist())
        digest = wire.frame_digest(seq, layer, wire.KV, count, nbytes, transfer.raw_id, ids, k_part, v_part)
        header = wire.pack_header(seq, layer, wire.KV, count, nbytes, digest)
        self.enqueue(transfer, [wire.DATA, header, transfer.raw_id, ids, k_part, v_part], data=True)

    def prepare_finish(self, transfer: OutgoingTransfer) -> dict[str, Any]:
        """Extra FINISH fields; tcp frames were each verified on arrival, so none."""
        return {}

    # --- transfers -------------------------------------------------------------------------

    def begin(self, transfer_id: str, dst_block_ids: list[int], deadline_s: float) -> OutgoingTransfer:
        """Start a transfer into the receiver's reserved `dst_block_ids` (as passed to its expect())."""
        encode_transfer_id(transfer_id)
        deadline = time.monotonic() + check_deadline(deadline_s)
        dst = validate_block_ids(dst_block_ids, self.remote_blocks, f"begin({transfer_id!r})")
        transfer = OutgoingTransfer(self, transfer_id, dst, deadline)
        with self.cv:
            if self._broken is not None or self._closing:
                raise self._broken or TransferError(CLOSED, "the connection is closed", transfer_id)
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already in progress on this connection")
            self._transfers[transfer_id] = transfer
        # Not waited for: a refusal (say, blocks that differ from the reservation) fails the
        # transfer asynchronously and surfaces at the next send_layer() or finish().
        self.enqueue(transfer, wire.encode_control(wire.BEGIN, {"transfer_id": transfer_id,
                                                                "dst_block_ids": dst.tolist()}))
        return transfer

    def reserve_frame(self, transfer: OutgoingTransfer, nbytes: int) -> int:
        """Wait for room in the in-flight window (backpressure); return the frame's sequence number."""
        with self.cv:
            state = transfer._state
            while state.error is None and self._inflight and self._inflight + nbytes > self.max_inflight_bytes:
                remaining = transfer.deadline - time.monotonic()
                if remaining <= 0:
                    self._fail_locked(transfer, TransferError(TIMEOUT, "deadline passed while waiting for the "
                                                              "receiver to drain", transfer.transfer_id), True)
                    break
                self.cv.wait(min(remaining, 0.5))
            if state.error is not None:
                raise state.error
            seq = state.next_seq
            state.next_seq += 1
            state.unacked[seq] = nbytes
            state.bytes_sent += nbytes
            self._inflight += nbytes
            return seq

    def enqueue(self, transfer: OutgoingTransfer | None, parts: Sequence[bytes | memoryview], data: bool = False) -> None:
        with self.cv:
            if transfer is not None and transfer._state.error is not None:
                raise transfer._state.error
            self._outbox.append((transfer, parts, data))
        self._wakeup.set()

    def wait(self, transfer: OutgoingTransfer, predicate: Callable[[_State], bool]) -> None:
        """Block until predicate(state) holds or the transfer fails (raises); never past the deadline."""
        with self.cv:
            state = transfer._state
            while state.error is None and not predicate(state):
                remaining = transfer.deadline - time.monotonic()
                if remaining <= 0:
                    self._fail_locked(transfer, TransferError(TIMEOUT, "deadline passed before the receiver "
                                                              "confirmed", transfer.transfer_id), True)
                    break
                self.cv.wait(min(remaining, 0.5))
            if state.error is not None:
                raise state.error

    def fail(self, transfer: OutgoingTransfer, error: TransferError, tell_receiver: bool) -> None:
        with self.cv:
            self._fail_locked(transfer, error, tell_receiver)

    def _fail_locked(self, transfer: OutgoingTransfer, error: TransferError, tell_receiver: bool) -> None:
        state = transfer._state
        if state.error is not None or state.done:
            return
        # Count it before publishing the error: the caller reads state.error without the lock and
        # must find the failure already in the metrics when it sees the exception.
        log.warning("KV transfer %s failed on the sender: %s", transfer.transfer_id, error)
        self.telemetry.failed(self.transport, error.reason)
        state.error = error
        self._inflight -= sum(state.unacked.values())
        state.unacked.clear()
        self._transfers.pop(transfer.transfer_id, None)
        if tell_receiver and self._broken is None:
            self._outbox.append((None, wire.encode_control(wire.ABORT, {
                "transfer_id": transfer.transfer_id, "message": f"{error.reason}: {error.message}"}), False))
            self._wakeup.set()
        self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            if self._closing:
                return
            for transfer in list(self._transfers.values()):
                self._fail_locked(transfer, TransferError(CLOSED, "the sender was closed", transfer.transfer_id),
                                  True)
            self._closing = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (*self._monitors, *self._sockets):
            sock.close()
        self._wakeup.close()

    # --- I/O thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (*self._sockets, *self._monitors):
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while True:
            backlog = self._flush()
            with self.cv:
                if self._closing:
                    return
            events = dict(poller.poll(10 if backlog else self._poll_timeout_ms()))
            if self._wakeup.fd in events:
                self._wakeup.clear()
            for sock in self._sockets:
                if sock in events:
                    self._drain(sock)
            if any(mon in events and disconnected_fds(mon) for mon in self._monitors):
                self._peer_lost()
            self._expire()

    def _poll_timeout_ms(self) -> int:
        with self.cv:
            deadlines = [t.deadline for t in self._transfers.values()]
        if not deadlines:
            return 1000
        return max(0, min(1000, int((min(deadlines) - time.monotonic()) * 1000) + 1))

    def _flush(self) -> bool:
        """Hand queued messages to zmq; True if some had to wait (no connected peer right now)."""
        while True:
            with self.cv:
                if not self._outbox:
                    return False
                transfer, parts, data = self._outbox.popleft()
                if transfer is not None and transfer._state.error is not None:
                    continue  # the transfer failed: its queued frames are dropped
            if data:
                sock = self._sockets[self._next_stream % len(self._sockets)]
                self._next_stream += 1
            else:
                sock = self._sockets[0]
            try:
                sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                with self.cv:
                    self._outbox.appendleft((transfer, parts, data))
                return True

    def _drain(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._on_reply(parts)
            except Exception:
                log.exception("KV sender: error while handling a reply from %s; dropped", self.address)

    def _on_reply(self, parts: list[bytes]) -> None:
        kind = parts[0]
        if kind == wire.ACK and len(parts) == 3:
            with self.cv:
                transfer = self._transfers.get(parts[1].decode(errors="replace"))
                if transfer is not None:
                    self._inflight -= transfer._state.unacked.pop(_SEQ.unpack(parts[2])[0], 0)
                    self.cv.notify_all()
            return
        if len(parts) != 2:
            log.warning("KV sender: dropped a malformed reply from %s", self.address)
            return
        msg = wire.decode_control(parts[1])
        with self.cv:
            transfer = self._transfers.get(str(msg.get("transfer_id")))
            if transfer is None:
                return  # already finished or failed here
            state = transfer._state
            if kind == wire.DONE:
                state.done = True
                self._inflight -= sum(state.unacked.values())
                state.unacked.clear()
                self._transfers.pop(transfer.transfer_id, None)
            elif kind == wire.FAILED:
                self._fail_locked(transfer, TransferError.from_wire(msg, transfer.transfer_id), False)
            self.cv.notify_all()

    def _peer_lost(self) -> None:
        with self.cv:
            self._broken = TransferError(PEER_LOST, f"the KV receiver at {self.address} closed the connection")
            for transfer in list(self._transfers.values()):
                self._fail_locked(transfer, TransferError(PEER_LOST, self._broken.message, transfer.transfer_id),
                                  False)
            self._outbox.clear()

    def _expire(self) -> None:
        now = time.monotonic()
        with self.cv:
            for transfer in [t for t in self._transfers.values() if now >= t.deadline]:
                self._fail_locked(transfer, TransferError(TIMEOUT, "deadline passed", transfer.transfer_id), True)


class TcpSender:
    """Sends KV blocks from `kv_cache` to receivers; see tandem.worker.transfer for the API."""

    transport = "tcp"

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, layout_tag: str | None = None,
                 streams: int = 2, frame_bytes: int = 2 << 20, max_inflight_bytes: int = 64 << 20,
                 connect_timeout_s: float = 5.0, telemetry: TransferTelemetry | None = None,
                 keep_freed_buffers: bool = True) -> None:
        check_cache(layout, kv_cache)
        if keep_freed_buffers:  # staging buffers of gathered frames: see allocator.py
            allocator.keep_freed_buffers()
        for name, value in (("streams", streams), ("frame_bytes", frame_bytes),
                            ("max_inflight_bytes", max_inflight_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.connect_timeout_s = check_deadline(connect_timeout_s)
        self.layout, self.kv_cache, self.layout_tag = layout, kv_cache, layout_tag
        self.streams, self.frame_bytes, self.max_inflight_bytes = streams, frame_bytes, max_inflight_bytes
        self.telemetry = telemetry or TransferTelemetry()
        self.context = zmq.Context(io_threads=2)
        self._lock = threading.Lock()
        self._connections: dict[str, TcpConnection] = {}
        self._closed = False

    def connect(self, address: str) -> TcpConnection:
        """A handshaken connection to the receiver at `address` (reused while it is healthy).

        Raises TransferError: layout_mismatch / version_mismatch when the receiver refuses this
        sender, connect_failed when nothing answers within connect_timeout_s.
        """
        if not isinstance(address, str) or not address.startswith("tcp://"):
            raise ValueError(f"a tcp KV receiver address looks like tcp://HOST:PORT, got {address!r}")
        with self._lock:
            if self._closed:
                raise TransferError(CLOSED, "the sender is closed")
            conn = self._connections.get(address)
            if conn is not None and conn.alive:
                return conn
            if conn is not None:
                conn.close()
            conn = self._open(address)
            self._connections[address] = conn
            return conn

    def _open(self, address: str) -> TcpConnection:
        return TcpConnection(self, address)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections.values())
        for conn in connections:
            conn.close()
        self.context.term()

    def __enter__(self) -> TcpSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
