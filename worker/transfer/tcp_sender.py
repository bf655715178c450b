"""Prefill side of the tcp transport: connections to receivers and outgoing transfers.

A connection is a control socket and several data sockets (zmq DEALER, one TCP connection
each). Callers (the engine's per-layer callback) do the data path on their own thread: gather
the blocks (zero-copy when they are one run of a CPU cache), digest them, and hand the frame to
zmq on the next data socket, without copying and without waking another Python thread (zmq
sockets are not thread-safe: each data socket has a lock, held for the send). The receiver
replies on the control socket only, and the caller that waits for a reply (finish(), or a
full window) reads it itself, so that reply wakes it directly; callers that wait at the same
time take turns. The connection's I/O thread only watches for a lost receiver, enforces the
deadlines of transfers nobody is waiting on, and sends ABORTs.

Backpressure: at most `max_inflight_bytes` of frames may be unacknowledged per connection, so a
slow receiver slows the sender down instead of filling memory. Frames sent while the window is
at most half full are not acknowledged one by one (their transfer's DONE or failure releases
them); the others carry the ACK_ME flag, and the receiver acknowledges each once verified.

A receiver that stops answering (a frozen or hopelessly overloaded process: its connection stays
open) fails a transfer that waits on it with `timeout` after `silence_timeout_s` without a reply,
not only at the transfer's deadline, which is the whole request's: a prefill worker must not hold
its first token, nor its engine thread on a full window, that long.
"""

from __future__ import annotations

import itertools
import json
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

from tandem.worker.kv.keys import KVKeys
from tandem.worker.kv.layout import KVLayout

from . import allocator, wire
from .blocks import check_cache, read_blocks
from .errors import (
    ABORTED,
    AUTH_FAILED,
    CLOSED,
    CONNECT_FAILED,
    INCOMPLETE,
    PEER_LOST,
    TIMEOUT,
    VERSION_MISMATCH,
    TransferError,
)
from .sealing import K_PART, V_PART, SealError, SealMismatch, SealSecrets, SenderHandshake, SessionCipher
from .security import connect_securely
from .telemetry import TransferTelemetry
from .tracking import validate_block_ids
from .zmqutil import (
    HANDSHAKE_FAILED_EVENTS,
    Wakeup,
    check_deadline,
    disconnected_fds,
    encode_transfer_id,
    failed_handshakes,
    monitor_socket,
    poll_timeout_ms,
)

log = logging.getLogger(__name__)
_SEQ = struct.Struct("<Q")
MAX_REPLY_BYTES = 1 << 20  # the largest message part a receiver may send back (its replies are small JSON)
SILENCE_TIMEOUT_S = 30.0  # a waiting transfer fails after this long without a word from its receiver


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
    inflight: int = 0  # bytes sent and not yet released by an ACK, DONE or failure
    ack_me: dict[int, int] = field(default_factory=dict)  # seq -> bytes of the frames flagged ACK_ME
    bytes_sent: int = 0


class OutgoingTransfer:
    """One request's KV on its way: send_layer() as layers are computed, then finish()."""

    def __init__(self, conn: TcpConnection, transfer_id: str, dst_ids: list[int], deadline: float) -> None:
        self.transfer_id = transfer_id
        self.raw_id = transfer_id.encode()
        self._conn, self._dst_ids, self.deadline = conn, dst_ids, deadline
        # Per layer, 1 per destination position once sent (K and V travel together).
        self._sent = [bytearray(len(dst_ids)) for _ in range(conn.layout.num_layers)]
        self._unsent = conn.layout.num_layers * len(dst_ids)
        self._state = _State()
        self._started = time.monotonic()

    def send_layer(self, layer: int, src_block_ids: list[int], dst_start: int = 0) -> None:
        """Send K and V of `layer` for `src_block_ids` into destination blocks dst_start.. (positions
        in the dst_block_ids given to begin()). Returns once the frames are queued; blocks only
        while the connection's in-flight window is full. Raises TransferError if the transfer failed.
        """
        conn = self._conn
        conn.poll_replies()
        self._raise_if_failed()
        if not isinstance(layer, int) or not 0 <= layer < conn.layout.num_layers:
            raise ValueError(f"layer {layer!r} out of range 0..{conn.layout.num_layers - 1}")
        src = validate_block_ids(src_block_ids, conn.local_blocks, f"send_layer({layer})")
        count = len(src)
        if not isinstance(dst_start, int) or dst_start < 0 or dst_start + count > len(self._dst_ids):
            raise ValueError(f"send_layer({layer}): {count} blocks from position {dst_start} do not fit "
                             f"the {len(self._dst_ids)} destination blocks")
        if self._sent[layer].find(1, dst_start, dst_start + count) != -1:
            raise ValueError(f"send_layer({layer}): some of these destination blocks were already sent")
        per_frame = max(1, conn.frame_bytes // (2 * conn.layout.bytes_per_block_layer_kv))
        for first in range(0, count, per_frame):
            conn.transmit(self, layer, src[first:first + per_frame],
                          self._dst_ids[dst_start + first:dst_start + min(count, first + per_frame)])
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
        self._conn.send(self, self._conn.control(wire.FINISH, {"transfer_id": self.transfer_id, **extra}), 0)
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


class _Stream:
    """A data socket. Callers send on it from their own threads, one at a time: zmq sockets are not
    thread-safe, and the lock both serialises the calls and orders memory between the threads."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self.lock = threading.Lock()


class TcpConnection:
    """Streams to one receiver, after a successful handshake. Made by TcpSender.connect()."""

    transport = "tcp"

    def __init__(self, sender: TcpSender, address: str) -> None:
        self.address = address
        self.layout, self.kv_cache, self.telemetry = sender.layout, sender.kv_cache, sender.telemetry
        self.keys = sender.keys
        self.cipher: SessionCipher | None = None  # sealed transfer (sealing.py): set by the handshake
        self.local_blocks = sender.kv_cache.shape[2]
        self.frame_bytes, self.max_inflight_bytes = sender.frame_bytes, sender.max_inflight_bytes
        self.silence_timeout_s = sender.silence_timeout_s
        self.cv = threading.Condition()
        self._last_reply = time.monotonic()  # when the receiver last said anything on the control socket
        self._inflight = 0  # bytes of frames not yet released, all transfers
        self._ack_me = 0  # the part of them flagged ACK_ME (released frame by frame)
        self._outbox: deque[list[bytes]] = deque()  # ABORTs for the I/O thread to send
        self._transfers: dict[str, OutgoingTransfer] = {}
        self._broken: TransferError | None = None
        self._closing = False
        self._round_robin = itertools.count()
        self._wakeup = Wakeup()  # wakes the I/O thread: ABORTs to send, an earlier deadline, close()
        self._io_wakes_at = 0.0  # the latest the I/O thread looks at deadlines next (monotonic)
        # The control socket is read by the callers that wait for a reply, one at a time (whoever
        # holds _reader_lock); _reader_wakeup breaks its poll when a transfer fails elsewhere.
        self._reader_lock = threading.Lock()
        self._reader_wakeup = Wakeup()
        session = uuid.uuid4().hex
        self._monitors: list[zmq.Socket[bytes]] = []
        self._opened: list[zmq.Socket[bytes]] = []  # closed here if the connection never comes up
        try:
            self._control = self._socket(sender, f"{session}/control")
            self._streams = [_Stream(self._socket(sender, f"{session}/{index}")) for index in range(sender.streams)]
            self.remote_blocks = self._handshake(sender, session)
        except BaseException:
            # Nobody else holds these yet. A socket left open would make the context's term() wait forever.
            for sock in (*self._opened, *self._monitors):
                sock.close()
            self._wakeup.close()
            self._reader_wakeup.close()
            raise
        self._reader_poller = zmq.Poller()
        self._reader_poller.register(self._control, zmq.POLLIN)
        self._reader_poller.register(self._reader_wakeup.fd, zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{address}", daemon=True)
        self._thread.start()

    def _socket(self, sender: TcpSender, identity: str) -> zmq.Socket[bytes]:
        sock = sender.context.socket(zmq.DEALER)
        self._opened.append(sock)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        # Replies (ACK, DONE, FAILED, WELCOME) are small: MAXMSGSIZE bounds what a receiver can make this
        # side hold. RCVHWM stays unbounded: the receiver's ROUTER drops a reply to a full queue, and a
        # dropped ACK would stall the window; only the receiver this sender chose sends here.
        for option, value in ((zmq.LINGER, 200), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0),
                              (zmq.MAXMSGSIZE, MAX_REPLY_BYTES)):
            sock.setsockopt(option, value)
        if sender.keys is not None:
            connect_securely(sock, sender.keys)
        events = zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED_EVENTS
        self._monitors.append(monitor_socket(sock, events))
        sock.connect(self.address)
        return sock

    @property
    def alive(self) -> bool:
        return self._broken is None and not self._closing

    def _handshake(self, sender: TcpSender, session: str) -> int:
        sealing = SenderHandshake(sender.seal, session) if sender.seal is not None else None
        extra = {**self._hello_extra(), **(sealing.hello_fields() if sealing is not None else {})}
        hello = wire.encode_control(wire.HELLO, wire.hello(self.layout, sender.layout_tag, session, self.transport,
                                                           extra))
        deadline = time.monotonic() + sender.connect_timeout_s
        # Not a blocking send: while a security handshake keeps failing, zmq may have no pipe to queue
        # the HELLO on, and the send would wait for one forever (seen once in CI: a 60 s test timeout).
        while True:
            if not self._await_control(zmq.POLLOUT, deadline):
                break
            try:
                self._control.send_multipart(hello, zmq.NOBLOCK)
                break
            except zmq.Again:
                continue
        if time.monotonic() >= deadline or not self._await_control(zmq.POLLIN, deadline):
            self.telemetry.failed(self.transport, CONNECT_FAILED)
            raise TransferError(CONNECT_FAILED, f"no KV receiver answered at {self.address} within "
                                f"{sender.connect_timeout_s:g}s")
        kind, body = self._control.recv_multipart()
        reply = wire.decode_control(body)
        if kind == wire.REFUSE:
            error = TransferError.from_wire(reply)
            log.error("KV receiver at %s refused this sender: %s", self.address, error.message)
            self.telemetry.failed(self.transport, error.reason)
            raise error
        if kind != wire.WELCOME or not isinstance(reply.get("num_blocks"), int):
            raise TransferError(CONNECT_FAILED, f"unexpected handshake reply from {self.address}")
        if sealing is not None:
            try:
                self.cipher, _, boxed = sealing.complete(reply)
            except SealError as exc:  # SealMismatch: the receiver does not seal (rollout, config), else no token
                reason = VERSION_MISMATCH if isinstance(exc, SealMismatch) else AUTH_FAILED
                self.telemetry.failed(self.transport, reason)
                raise TransferError(reason, f"KV receiver at {self.address}: {exc}") from None
            reply = {**reply, **boxed}  # the transport's fields (rdma: the QP) travel sealed
        self._on_welcome(reply)
        for index, stream in enumerate(self._streams):
            attach: dict[str, Any] = {"session": session, "stream": index}
            if self.cipher is not None:  # proof that this stream belongs to the sealed session
                attach["proof"] = self.cipher.seal_body(wire.ATTACH, f"{session}/{index}".encode()).hex()
            stream.sock.send_multipart(wire.encode_control(wire.ATTACH, attach))
        return int(reply["num_blocks"])

    def _await_control(self, event: int, deadline: float) -> bool:
        """Wait until the control socket can send (POLLOUT) or has the handshake reply (POLLIN), until
        `deadline` (monotonic); a failed security handshake fails at once (auth_failed)."""
        poller = zmq.Poller()
        poller.register(self._control, event)
        monitor = self._monitors[0]  # the control socket's
        poller.register(monitor, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if ready.get(self._control, 0) & event:
                return True
            if monitor in ready and failed_handshakes(monitor):
                self.telemetry.failed(self.transport, AUTH_FAILED)
                ours = "with" if self.keys is not None else "without"
                raise TransferError(AUTH_FAILED, (
                    f"the security handshake with the KV receiver at {self.address} failed: this sender runs "
                    f"{ours} KV keys, and the receiver holds other keys or none (kvTransfer.secure / --kv-keys "
                    "must match on every worker of the model)"))
        return False

    def control(self, kind: bytes, payload: dict[str, Any]) -> list[bytes]:
        """A control message (BEGIN, FINISH, ABORT) for the receiver: sealed when the session is."""
        if self.cipher is None:
            return wire.encode_control(kind, payload)
        return [kind, self.cipher.seal_body(kind, json.dumps(payload, separators=(",", ":")).encode())]

    # --- transport-specific parts (rdma.py overrides these) -------------------------------

    def _hello_extra(self) -> dict[str, Any]:
        return {}

    def _on_welcome(self, reply: dict[str, Any]) -> None:
        pass

    def transmit(self, transfer: OutgoingTransfer, layer: int, src: list[int], dst: list[int]) -> None:
        """Send one frame: K and V of kv_cache[layer, :, src] into the receiver's blocks dst."""
        count = len(src)
        nbytes = 2 * count * self.layout.bytes_per_block_layer_kv
        seq, flags = self.reserve_frame(transfer, nbytes)
        try:
            k_part = read_blocks(self.kv_cache, layer, wire.K, src)
            v_part = read_blocks(self.kv_cache, layer, wire.V, src)
        except Exception as exc:
            self.fail(transfer, TransferError(ABORTED, f"could not read source blocks: {exc}",
                                              transfer.transfer_id), tell_receiver=True)
            raise
        ids = struct.pack(f"<{count}i", *dst)
        if self.cipher is not None:
            # Sealed: the GCM tags do the digest's job; the header carries the nonce counter instead.
            counter = self.cipher.next_counter()
            header = wire.pack_header(seq, layer, wire.KV, count, nbytes, (counter, 0), flags)
            aad = wire.sealed_aad(header, transfer.raw_id, ids)
            k_sealed = self.cipher.seal(counter, K_PART, k_part, aad)
            v_sealed = self.cipher.seal(counter, V_PART, v_part, aad)
            self.send(transfer, [wire.DATA, header, transfer.raw_id, ids, k_sealed, v_sealed])
            return
        digest = wire.frame_digest(seq, layer, wire.KV, count, nbytes, transfer.raw_id, ids, k_part, v_part,
                                   flags=flags)
        header = wire.pack_header(seq, layer, wire.KV, count, nbytes, digest, flags)
        self.send(transfer, [wire.DATA, header, transfer.raw_id, ids, k_part, v_part])

    def prepare_finish(self, transfer: OutgoingTransfer) -> dict[str, Any]:
        """Extra FINISH fields; tcp frames were each verified on arrival, so none."""
        return {}

    # --- transfers -------------------------------------------------------------------------

    def begin(self, transfer_id: str, dst_block_ids: list[int], deadline_s: float,
              prompt_digest: bytes | None = None) -> OutgoingTransfer:
        """Start a transfer into the receiver's reserved `dst_block_ids` (as passed to its expect()).

        `prompt_digest` (wire.prompt_digest of the token ids this KV is computed from) travels in BEGIN;
        the receiver hands it to its owner (`prompt_digest()`), who decides whether the blocks fit its
        request. Without one, a decode worker neither uses nor caches the blocks.
        """
        encode_transfer_id(transfer_id)
        deadline = time.monotonic() + check_deadline(deadline_s)
        dst = validate_block_ids(dst_block_ids, self.remote_blocks, f"begin({transfer_id!r})")
        declared = wire.encode_prompt_digest(prompt_digest)
        transfer = OutgoingTransfer(self, transfer_id, dst, deadline)
        with self.cv:
            if self._broken is not None or self._closing:
                raise self._broken or TransferError(CLOSED, "the connection is closed", transfer_id)
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} is already in progress on this connection")
            self._transfers[transfer_id] = transfer
            if deadline < self._io_wakes_at:
                self._wakeup.set()  # the I/O thread enforces it even while nobody waits on this transfer
        # Not waited for: a refusal (say, blocks that differ from the reservation) fails the
        # transfer asynchronously and surfaces at the next send_layer() or finish().
        self.send(transfer, self.control(wire.BEGIN, {"transfer_id": transfer_id, "dst_block_ids": dst,
                                                             **declared}), 0)
        return transfer

    def reserve_frame(self, transfer: OutgoingTransfer, nbytes: int) -> tuple[int, int]:
        """Wait for room in the in-flight window (backpressure); return the frame's sequence number
        and header flags (ACK_ME once the window is more than half full)."""
        state = transfer._state

        def room() -> bool:
            # Only ACK_ME bytes come back by themselves; the rest (at most half the window) wait
            # for their transfers' DONE, which may need this very caller to go on: never wait for them.
            return not self._ack_me or self._inflight + nbytes <= self.max_inflight_bytes

        while True:
            with self.cv:
                if state.error is not None:
                    raise state.error
                if room():
                    seq = state.next_seq
                    state.next_seq += 1
                    state.bytes_sent += nbytes
                    state.inflight += nbytes
                    self._inflight += nbytes
                    if self._inflight <= self.max_inflight_bytes // 2:
                        return seq, 0
                    state.ack_me[seq] = nbytes
                    self._ack_me += nbytes
                    return seq, wire.ACK_ME
            self.wait(transfer, lambda _state: room(), "waiting for the receiver to drain")

    def send(self, transfer: OutgoingTransfer, parts: Sequence[bytes | memoryview], stream: int | None = None) -> None:
        """Hand a message to zmq on a data socket, from the caller's thread (round-robin by default)."""
        chosen = self._streams[(next(self._round_robin) if stream is None else stream) % len(self._streams)]
        while True:
            with chosen.lock:
                if transfer._state.error is not None:
                    raise transfer._state.error
                if self._closing:
                    raise TransferError(CLOSED, "the connection is closed", transfer.transfer_id)
                try:
                    chosen.sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:  # no connection to the receiver right now (it is gone or reconnecting)
                    pass
            if time.monotonic() >= transfer.deadline:
                self.fail(transfer, TransferError(TIMEOUT, "deadline passed while the receiver was unreachable",
                                                  transfer.transfer_id), tell_receiver=True)
            time.sleep(0.001)

    def wait(self, transfer: OutgoingTransfer, predicate: Callable[[_State], bool],
             what: str = "before the receiver confirmed") -> None:
        """Block until predicate(state) holds or the transfer fails (raises); never past the deadline.

        A waiting caller reads the control socket itself (one at a time: the others wait for it to
        hand them their replies), so the reply it waits for wakes it directly.
        """
        state = transfer._state
        started = time.monotonic()
        while True:
            with self.cv:
                now = time.monotonic()
                remaining = transfer.deadline - now
                silent = now - max(started, self._last_reply)
                if state.error is None and not predicate(state):
                    if remaining <= 0:
                        self._fail_locked(transfer, TransferError(TIMEOUT, f"deadline passed {what}",
                                                                  transfer.transfer_id), True)
                    elif silent >= self.silence_timeout_s:
                        self._fail_locked(transfer, TransferError(
                            TIMEOUT, f"the receiver at {self.address} has not answered for {silent:.0f}s {what}",
                            transfer.transfer_id), True)
                if state.error is not None:
                    raise state.error
                if predicate(state):
                    return
            if self._reader_lock.acquire(blocking=False):
                try:
                    self._read_replies(max(1, min(100, int(remaining * 1000) + 1)))
                finally:
                    self._reader_lock.release()
                with self.cv:
                    self.cv.notify_all()  # another waiter may take over the reading
                continue
            with self.cv:  # another caller reads; it notifies on every reply
                if state.error is None and not predicate(state):
                    self.cv.wait(min(remaining, 0.005))

    def poll_replies(self) -> None:
        """Handle replies that already arrived (a failure shows at the next send_layer()), without waiting."""
        if self._reader_lock.acquire(blocking=False):
            try:
                if not self._closing and int(self._control.get(zmq.EVENTS)) & zmq.POLLIN:
                    self._drain()
            finally:
                self._reader_lock.release()

    def _read_replies(self, timeout_ms: int) -> None:
        """Wait up to timeout_ms for replies on the control socket and handle them (holding _reader_lock)."""
        if self._closing:
            return
        events = dict(self._reader_poller.poll(timeout_ms))
        if self._reader_wakeup.fd in events:
            self._reader_wakeup.clear()
        if self._control in events:
            self._drain()

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
        self._release_locked(transfer)
        if tell_receiver and self._broken is None:
            self._outbox.append(self.control(wire.ABORT, {
                "transfer_id": transfer.transfer_id, "message": f"{error.reason}: {error.message}"}))
            self._wakeup.set()
        self._reader_wakeup.set()  # a caller waiting in the control socket's poll sees it at once
        self.cv.notify_all()

    def _release_locked(self, transfer: OutgoingTransfer) -> None:
        """The transfer is over: its frames no longer count against the window."""
        state = transfer._state
        self._inflight -= state.inflight
        self._ack_me -= sum(state.ack_me.values())
        state.inflight = 0
        state.ack_me.clear()
        self._transfers.pop(transfer.transfer_id, None)

    def close(self) -> None:
        with self.cv:
            if self._closing:
                return
            for transfer in list(self._transfers.values()):
                self._fail_locked(transfer, TransferError(CLOSED, "the sender was closed", transfer.transfer_id),
                                  True)
            self._closing = True
        self._wakeup.set()
        self._thread.join(timeout=10)  # it sends the ABORTs above first
        self._close_sockets()

    def _close_sockets(self) -> None:
        for stream in self._streams:
            with stream.lock:  # a caller may be in the middle of a send
                stream.sock.close()
        with self._reader_lock:  # a waiting caller leaves its poll at once (its transfer failed)
            self._control.close()
        for sock in self._monitors:
            sock.close()
        self._wakeup.close()
        self._reader_wakeup.close()

    # --- I/O thread: lost receiver, deadlines, ABORTs ----------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._monitors:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while True:
            backlog = self._flush()
            with self.cv:
                if self._closing:
                    return
                timeout_ms = 10 if backlog else self._poll_timeout_ms()
                self._io_wakes_at = time.monotonic() + timeout_ms / 1000
            events = dict(poller.poll(timeout_ms))
            if self._wakeup.fd in events:
                self._wakeup.clear()
            if any(mon in events and disconnected_fds(mon) for mon in self._monitors):
                self._peer_lost()
            self._expire()

    def _poll_timeout_ms(self) -> int:
        return poll_timeout_ms((t.deadline for t in self._transfers.values()), time.monotonic())  # (under self.cv)

    def _flush(self) -> bool:
        """Send queued ABORTs on the first data socket; True if some had to wait (no connected peer)."""
        stream = self._streams[0]
        while True:
            with self.cv:
                if not self._outbox:
                    return False
                parts = self._outbox.popleft()
            try:
                with stream.lock:
                    stream.sock.send_multipart(parts, zmq.NOBLOCK)
            except zmq.Again:
                with self.cv:
                    self._outbox.appendleft(parts)
                return True

    def _drain(self) -> None:
        while True:
            try:
                parts = self._control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._on_reply(parts)
            except Exception:
                log.exception("KV sender: error while handling a reply from %s; dropped", self.address)

    def _on_reply(self, parts: list[bytes]) -> None:
        self._last_reply = time.monotonic()
        kind = parts[0]
        if kind == wire.ACK and len(parts) == 3:
            with self.cv:
                transfer = self._transfers.get(parts[1].decode(errors="replace"))
                if transfer is not None:
                    state = transfer._state
                    nbytes = state.ack_me.pop(_SEQ.unpack(parts[2])[0], 0)
                    state.inflight -= nbytes
                    self._inflight -= nbytes
                    self._ack_me -= nbytes
                    self.cv.notify_all()
            return
        if len(parts) != 2:
            log.warning("KV sender: dropped a malformed reply from %s", self.address)
            return
        msg = wire.decode_control(parts[1])
        if kind == wire.FAILED and msg.get("reconnect") is True:  # the receiver has no session for us
            self._peer_lost("has no session for this sender (it took the connection for closed)")
            return
        with self.cv:
            transfer = self._transfers.get(str(msg.get("transfer_id")))
            if transfer is None:
                return  # already finished or failed here
            if kind == wire.DONE:
                transfer._state.done = True
                self._release_locked(transfer)
            elif kind == wire.FAILED:
                self._fail_locked(transfer, TransferError.from_wire(msg, transfer.transfer_id), False)
            self.cv.notify_all()

    def _peer_lost(self, why: str = "closed the connection") -> None:
        """The connection is unusable: fail its transfers; the next connect() opens a fresh one."""
        with self.cv:
            self._broken = TransferError(PEER_LOST, f"the KV receiver at {self.address} {why}")
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
                 connect_timeout_s: float = 5.0, silence_timeout_s: float = SILENCE_TIMEOUT_S,
                 telemetry: TransferTelemetry | None = None, keep_freed_buffers: bool = True,
                 keys: KVKeys | None = None, seal: SealSecrets | None = None) -> None:
        check_cache(layout, kv_cache)
        if keys is not None and seal is not None:
            raise ValueError("CURVE keys (--kv-keys) and sealing (--kv-encryption aes-gcm) both encrypt: choose one")
        if keep_freed_buffers:  # staging buffers of gathered frames: see allocator.py
            allocator.keep_freed_buffers()
        for name, value in (("streams", streams), ("frame_bytes", frame_bytes),
                            ("max_inflight_bytes", max_inflight_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.connect_timeout_s = check_deadline(connect_timeout_s)
        self.silence_timeout_s = check_deadline(silence_timeout_s)
        self.layout, self.kv_cache, self.layout_tag = layout, kv_cache, layout_tag
        self.streams, self.frame_bytes, self.max_inflight_bytes = streams, frame_bytes, max_inflight_bytes
        self.telemetry = telemetry or TransferTelemetry()
        self.keys = keys  # kvTransfer.secure: CURVE with the model's keys (security.py)
        self.seal = seal  # sealed transfer with secrets from the control token (sealing.py)
        self.context = zmq.Context(io_threads=2)
        self._lock = threading.Lock()
        self._connections: dict[str, TcpConnection] = {}
        self._handshakes: dict[str, threading.Lock] = {}  # per address: one handshake at a time
        self._refused: dict[str, tuple[float, TransferError]] = {}  # per address: the last failed handshake
        self._closed = False

    def connect(self, address: str) -> TcpConnection:
        """A handshaken connection to the receiver at `address` (reused while it is healthy).

        Raises TransferError: layout_mismatch / version_mismatch when the receiver refuses this
        sender, connect_failed when nothing answers within connect_timeout_s.
        """
        if not isinstance(address, str) or not address.startswith("tcp://"):
            raise ValueError(f"a tcp KV receiver address looks like tcp://HOST:PORT, got {address!r}")
        asked = time.monotonic()
        with self._lock:
            if self._closed:
                raise TransferError(CLOSED, "the sender is closed")
            handshake = self._handshakes.setdefault(address, threading.Lock())
        # Not under self._lock: a receiver that does not answer (frozen) holds up connect() calls for
        # itself only, and those share the outcome of the handshake they waited for instead of each
        # waiting connect_timeout_s again.
        with handshake:
            with self._lock:
                conn = self._connections.get(address)
                refused = self._refused.get(address)
            if conn is not None and conn.alive:
                return conn
            if refused is not None and refused[0] >= asked:
                raise TransferError(refused[1].reason, refused[1].message)
            if conn is not None:
                conn.close()
            try:
                conn = self._open(address)
            except TransferError as exc:
                with self._lock:
                    self._refused[address] = (time.monotonic(), exc)
                raise
            with self._lock:
                if self._closed:
                    conn.close()
                    raise TransferError(CLOSED, "the sender is closed")
                self._connections[address] = conn
                self._refused.pop(address, None)
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
