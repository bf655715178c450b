"""Decode side of the tcp transport: a zmq ROUTER socket that verifies frames into the cache.

One I/O thread owns the socket. It answers handshakes, checks every data frame (header, sizes,
checksum, reservation) before writing it, acknowledges the frames the sender flagged ACK_ME (its
backpressure credit), and enforces deadlines. Every reply goes to the sender's control socket:
its data sockets are only ever sent on. A sender connection that closes mid-transfer is noticed
through a zmq socket monitor and fails that sender's transfers at once.

The monitor names a connection by its file descriptor, and the kernel gives a closed
descriptor's number to the next connection it accepts: "fd 12 closed" may be read after a new
sender's handshake on the new fd 12. So each binding of a session to a descriptor records how
many connections that descriptor had been accepted for (its epoch), and a close applies only to
bindings of its own epoch or older.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import zmq

from tandem.worker.kv.keys import KVKeys
from tandem.worker.kv.layout import KVLayout

from . import allocator, wire
from . import limits as _limits
from .blocks import check_cache, write_blocks
from .errors import (
    ABORTED,
    AUTH_FAILED,
    CLOSED,
    CONNECT_FAILED,
    CORRUPT_FRAME,
    INVALID_FRAME,
    PEER_LOST,
    REASONS,
    TIMEOUT,
    UNKNOWN_TRANSFER,
    VERSION_MISMATCH,
    TransferError,
)
from .sealing import (
    K_PART,
    TAG_BYTES,
    V_PART,
    SealError,
    SealMismatch,
    SealSecrets,
    SessionCipher,
    accept_hello,
    seal_welcome,
)
from .security import serve_securely
from .telemetry import TransferTelemetry
from .tracking import DoneCallback, Reservation, check_data_frame, validate_block_ids
from .zmqutil import (
    HANDSHAKE_FAILED_EVENTS,
    Wakeup,
    check_deadline,
    encode_transfer_id,
    monitor_events,
    monitor_socket,
    poll_timeout_ms,
    source_fd,
)

log = logging.getLogger(__name__)
_SEQ = struct.Struct("<Q")
_RECENT_OUTCOMES = 4096  # finished transfers remembered, to answer late FINISH/frames precisely


@dataclass
class _Session:
    session_id: str
    control: bytes  # routing id of the sender's first stream: replies go there
    host: str | None = None  # the peer's address (the per-peer session cap counts it)
    identities: set[bytes] = field(default_factory=set)
    fds: set[int] = field(default_factory=set)
    opener: SessionCipher | None = None  # sealed session (sealing.py): opens what the sender sends
    streams: set[int] = field(default_factory=set)  # sealed: stream indexes attached (each once)


class TcpReceiver:
    """Receives KV blocks into `kv_cache`; see tandem.worker.transfer for the API."""

    transport = "tcp"

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, host: str = "127.0.0.1", port: int = 0,
                 layout_tag: str | None = None, telemetry: TransferTelemetry | None = None,
                 keep_freed_buffers: bool = True, keys: KVKeys | None = None,
                 limits: _limits.ReceiverLimits | None = None, seal: SealSecrets | None = None) -> None:
        check_cache(layout, kv_cache)
        if keys is not None and seal is not None:
            raise ValueError("CURVE keys (--kv-keys) and sealing (--kv-encryption aes-gcm) both encrypt: choose one")
        self._seal = seal
        self._scratch = bytearray(0)  # sealed frames are opened here, then written to the cache
        if keep_freed_buffers:  # zmq's receive buffers: see allocator.py
            allocator.keep_freed_buffers()
        self.layout, self.kv_cache, self.layout_tag = layout, kv_cache, layout_tag
        self.num_blocks = kv_cache.shape[2]
        self.telemetry = telemetry or TransferTelemetry()
        self.limits = limits or _limits.ReceiverLimits()
        self.max_part_bytes = self._max_part_bytes()
        # The most undelivered bytes one legitimate connection can have: its queued messages and the
        # one being read (a data frame: header, block ids, K and V parts); with none queued, that one.
        self.max_message_bytes = 2 * self.max_part_bytes
        self.max_connection_bytes = (self.limits.rcvhwm + 1) * self.max_message_bytes
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer errors, not blocks
        # Bounded receiving (limits.py): zmq drops a peer that announces a bigger part, and stops
        # reading a connection with rcvhwm messages queued.
        self._router.setsockopt(zmq.MAXMSGSIZE, self.max_part_bytes)
        self._router.setsockopt(zmq.RCVHWM, self.limits.rcvhwm)
        # kvTransfer.secure: only peers holding the model's keys get through (security.py).
        self._auth = serve_securely(self._ctx, self._router, keys) if keys is not None else None
        try:
            if port == 0:
                port = self._router.bind_to_random_port(f"tcp://{host}")
            else:
                self._router.bind(f"tcp://{host}:{port}")
            self._monitor = monitor_socket(self._router, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                                           | HANDSHAKE_FAILED_EVENTS)
        except zmq.ZMQError as exc:
            self._router.close()
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            raise ValueError(f"cannot listen for KV transfers on {host}:{port}: {exc}") from exc
        self.address = f"tcp://{host}:{port}"
        self._lock = threading.Lock()  # guards _reservations; held while a frame is written
        self._reservations: dict[str, Reservation] = {}
        self._outcomes: OrderedDict[str, TransferError | None] = OrderedDict()
        self._digests: OrderedDict[str, bytes | None] = OrderedDict()  # prompt digests of completed transfers
        self._sessions: dict[str, _Session] = {}
        self._identity_session: dict[bytes, str] = {}
        # Connection bookkeeping of the I/O thread, fed by the monitor (see the module docstring):
        self._accepted: dict[int, int] = {}  # fd -> connections accepted on it so far (its epoch)
        self._fd_sessions: dict[int, dict[str, int]] = {}  # fd -> {session id: epoch when bound}
        self._closes: list[tuple[int, int]] = []  # (fd, epoch) of closes read but not yet applied
        self._connections: dict[int, _limits.Connection] = {}  # fd -> the open connection on it (limits.py)
        self._next_check = 0.0  # when the I/O thread next reads the connections' bytes in flight
        self._drained = True  # the last look at the socket found no complete message left
        self._cut_in_handshake = 0  # connections cut at accept whose failed handshake is still to be read
        self._closing = False
        self._wakeup = Wakeup()
        self._io_wakes_at = 0.0  # the latest the I/O thread looks at deadlines next (monotonic)
        self._thread = threading.Thread(target=self._run, name=f"kv-recv-{port}", daemon=True)
        self._thread.start()

    # --- public API ------------------------------------------------------------------------

    def expect(self, transfer_id: str, block_ids: list[int], deadline_s: float, on_done: DoneCallback) -> None:
        """Reserve `block_ids` (every layer, K and V) for `transfer_id`.

        `on_done(transfer_id, None)` runs once all of them arrived and verified; on failure or
        expiry `on_done(transfer_id, TransferError)` runs and nothing more is written into those
        blocks. Callbacks run on the receiver's I/O thread: keep them short.
        """
        encode_transfer_id(transfer_id)
        ids = validate_block_ids(block_ids, self.num_blocks, f"expect({transfer_id!r})")
        deadline = time.monotonic() + check_deadline(deadline_s)
        if not callable(on_done):
            raise ValueError("on_done must be callable")
        with self._lock:
            if self._closing:
                raise TransferError(CLOSED, "the receiver is closed", transfer_id)
            if transfer_id in self._reservations:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            self._outcomes.pop(transfer_id, None)
            self._reservations[transfer_id] = Reservation(transfer_id, ids, self.layout.num_layers,
                                                          deadline, on_done)
            # Wake the I/O thread only if it would sleep past this deadline: waking it for every
            # request costs a trip through the scheduler, often just as that request's frames arrive.
            wake = deadline < self._io_wakes_at
        if wake:
            self._wakeup.set()

    def cancel(self, transfer_id: str, reason: str | None = None) -> bool:
        """Drop a reservation without calling on_done; once this returns nothing more is written.

        With a `reason` (say `abandoned`: the sender never started; `timeout`: the caller stopped
        waiting), a transfer that was still pending also counts as failed with that reason in
        tandem_kv_transfer_failures_total; one that already finished or failed is not counted twice.
        Returns whether the transfer was still pending.
        """
        if reason is not None and reason not in REASONS:
            raise ValueError(f"unknown transfer failure reason {reason!r}")
        with self._lock:
            reservation = self._reservations.pop(transfer_id, None)
            if reservation is not None:
                self._remember(transfer_id, TransferError(ABORTED, "the receiver cancelled the transfer"))
        if reservation is not None:
            self._reservation_ended(reservation, TransferError(ABORTED, "the receiver cancelled the transfer",
                                                               transfer_id))
        if reservation is not None and reason is not None:
            log.warning("KV transfer %s given up by the receiver (%s): %d of %d pieces had arrived", transfer_id,
                        reason, reservation.received, reservation.received + reservation.missing)
            self.telemetry.failed(self.transport, reason)
        return reservation is not None

    def pending(self) -> list[str]:
        with self._lock:
            return list(self._reservations)

    def prompt_digest(self, transfer_id: str) -> bytes | None:
        """The prompt digest the sender declared in this transfer's BEGIN (wire.prompt_digest of the token
        ids its KV was computed from), or None if it declared none. Known while the transfer is pending,
        inside its on_done, and afterwards for the last few thousand completed transfers. The receiver
        does not judge it: the blocks' owner compares it with the prompt it means to use them for."""
        with self._lock:
            reservation = self._reservations.get(transfer_id)
            if reservation is not None:
                return reservation.prompt_digest
            return self._digests.get(transfer_id)

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self._monitor.close(linger=0)
        self._router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self._wakeup.close()

    def __enter__(self) -> TcpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- I/O thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        while not self._closing:
            events = dict(poller.poll(self._poll_timeout_ms()))
            if self._wakeup.fd in events:
                self._wakeup.clear()
            if self._monitor in events:
                self._read_monitor()
            if self._router not in events:
                self._drained = True
            if self._router in events or self._closes:
                # A closed peer's last messages are queued before its disconnect event is sent:
                # read them all first, so its session is known when the disconnect is handled.
                self._drain_router()
            closes, self._closes = self._closes, []
            for fd, epoch in closes:
                self._peer_closed(fd, epoch)
            self._check_connections()
            self._expire()
        self._fail_all(TransferError(CLOSED, "the receiver was closed"))

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        with self._lock:
            timeout_ms = poll_timeout_ms((r.deadline for r in self._reservations.values()), now)
            if self._connections:  # bytes in flight are read every check_interval_s while any is open
                timeout_ms = max(0, min(timeout_ms, int((self._next_check - now) * 1000) + 1))
            self._io_wakes_at = now + timeout_ms / 1000
        return timeout_ms

    def _refused_peers(self, count: int) -> None:
        """Connections that failed the security handshake: say so; zmq has already dropped them."""
        ours = "secure (--kv-keys)" if self._auth is not None else "not secure (no --kv-keys)"
        log.warning("KV receiver %s: refused %d connection(s) whose security handshake failed; this receiver is %s "
                    "and the sender is not, or holds other keys", self.address, count, ours)
        for _ in range(count):
            self.telemetry.failed(self.transport, AUTH_FAILED)

    def _read_monitor(self) -> None:
        """Read the monitor's pending events, in order: count accepts per fd, queue closes."""
        refused = 0
        for event, fd in monitor_events(self._monitor):
            if event == zmq.EVENT_ACCEPTED:
                self._accepted[fd] = self._accepted.get(fd, 0) + 1
                self._connection_accepted(fd, self._accepted[fd])
            elif event == zmq.EVENT_DISCONNECTED:
                self._closes.append((fd, self._accepted.get(fd, 0)))
                self._connection_closed(fd, self._accepted.get(fd, 0))
            elif event & HANDSHAKE_FAILED_EVENTS:
                if self._cut_in_handshake:  # (the value is an errno) one this receiver cut at its accept:
                    self._cut_in_handshake -= 1  # counted under its limit, not as a failed handshake
                else:
                    refused += 1
        if refused:
            self._refused_peers(refused)

    def _drain_router(self) -> None:
        self._drained = False
        handled = 0
        curve = self._auth is not None
        # Bounded, so deadlines and monitor events get their turn; unbounded while closes wait.
        while handled < 256 or self._closes:
            handled += 1
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._drained = True
                return
            conn = self._connections.get(source_fd(parts[1]) or -1) if len(parts) > 1 else None
            if conn is not None:  # its bytes are no longer held by zmq (the routing id never was on the wire)
                conn.delivered += _limits.wire_bytes([len(part) for part in parts[1:]], curve)
                conn.messages += 1
            try:
                self._handle(parts)
            except Exception:  # one bad message must never stop the receiver
                log.exception("KV receiver: error while handling a message; message dropped")

    def _handle(self, parts: list[zmq.Frame]) -> None:
        identity, kind = parts[0].bytes, parts[1].bytes if len(parts) > 1 else b""
        if kind == wire.DATA and len(parts) == 7:
            self._on_data(identity, parts)
        elif kind == wire.HELLO and len(parts) == 3:
            self._on_hello(identity, parts[2], source_fd(parts[1]))
        elif kind == wire.ATTACH and len(parts) == 3:
            self._on_attach(identity, parts[2], source_fd(parts[1]))
        elif kind in (wire.BEGIN, wire.FINISH, wire.ABORT) and len(parts) == 3:
            msg = self._open_control(identity, kind, parts[2].buffer)
            if msg is not None:
                self._on_transfer_control(identity, kind, msg)
        else:
            log.warning("KV receiver: dropped a malformed message (%d parts, kind %r)", len(parts), kind)

    def _open_control(self, identity: bytes, kind: bytes, body: memoryview) -> dict[str, object] | None:
        """A control message's body: opened in a sealed session; None (dropped) when it does not open."""
        session = self._sessions.get(self._identity_session.get(identity, ""))
        if session is None or session.opener is None:
            try:
                return wire.decode_control(body)
            except ValueError:  # sealed for a session this receiver no longer has: it gets "connect again"
                return {} if self._seal is not None else wire.decode_control(body)
        try:
            return wire.decode_control(session.opener.open_body(kind, body))
        except (SealError, ValueError) as exc:
            self._refused_sealed(f"a {kind!r} message of session {session.session_id[:8]} did not open: {exc}")
            return None

    def _refused_sealed(self, message: str) -> None:
        log.warning("KV receiver %s: %s; dropped", self.address, message)
        self.telemetry.failed(self.transport, AUTH_FAILED)

    def _send(self, identity: bytes, parts: list[bytes]) -> None:
        try:
            self._router.send_multipart([identity, *parts], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will time out on its own
            log.debug("KV receiver: could not reply to %r: %s", identity, exc)

    def _on_hello(self, identity: bytes, body: zmq.Frame, fd: int | None) -> None:
        peer = wire.decode_control(body.buffer)
        refusal = wire.check_hello(self.layout, self.layout_tag, self.transport, peer)
        if refusal is not None:
            log.error("KV receiver %s refused a sender: %s", self.address, refusal.message)
            self.telemetry.failed(self.transport, refusal.reason)
            self._send(identity, wire.encode_control(wire.REFUSE, refusal.to_wire()))
            return
        session_id = str(peer.get("session"))
        try:  # before anything is held or sent for this peer (an rdma WELCOME names its QP)
            sealed = accept_hello(self._seal, session_id, peer) if self._seal is not None else None
        except SealError as exc:  # no seal at all: a rollout or a config mismatch; a wrong one: no token
            reason = VERSION_MISMATCH if isinstance(exc, SealMismatch) else AUTH_FAILED
            self._refuse_hello(identity, TransferError(reason, f"KV receiver at {self.address}: {exc}"))
            return
        if sealed is None and isinstance(peer.get("seal"), dict):
            self._refuse_hello(identity, TransferError(VERSION_MISMATCH, (
                f"the KV receiver at {self.address} does not seal KV (--kv-encryption none), the sender does: "
                "every worker of a model must run with the same --kv-encryption")))
            return
        over = self._over_session_limit(session_id, fd)
        if over is not None:
            self._send(identity, wire.encode_control(wire.REFUSE, TransferError(CONNECT_FAILED, over).to_wire()))
            return
        try:
            extra = self._welcome_extra(session_id, peer)
        except TransferError as exc:
            log.error("KV receiver %s refused a sender: %s", self.address, exc.message)
            self.telemetry.failed(self.transport, exc.reason)
            self._send(identity, wire.encode_control(wire.REFUSE, exc.to_wire()))
            return
        conn = self._connections.get(fd) if fd is not None else None
        session = _Session(session_id, identity, host=conn.host if conn is not None else None,
                           opener=sealed.opener if sealed is not None else None)
        self._sessions[session_id] = session
        self._bind(session, identity, fd)
        fields = seal_welcome(sealed, extra) if sealed is not None else extra
        self._send(identity, wire.encode_control(wire.WELCOME, {
            "num_blocks": self.num_blocks, "layout_hash": self.layout.layout_hash(), **fields}))

    def _refuse_hello(self, identity: bytes, error: TransferError) -> None:
        log.error("KV receiver %s refused a sender: %s", self.address, error.message)
        self.telemetry.failed(self.transport, error.reason)
        self._send(identity, wire.encode_control(wire.REFUSE, error.to_wire()))

    def _welcome_extra(self, session_id: str, peer: dict[str, object]) -> dict[str, object]:
        """Transport-specific handshake fields (rdma: the QP; memory keys come per reservation)."""
        return {}

    def _max_part_bytes(self) -> int:
        """ZMQ_MAXMSGSIZE: the largest message part a legitimate sender sends this receiver (limits.py)."""
        return _limits.max_part_bytes(self.layout, self.num_blocks, self.limits.max_frame_bytes)

    # --- limits (limits.py) ------------------------------------------------------------------

    def _refuse_peer(self, reason: str, message: str) -> None:
        log.warning("KV receiver %s: %s", self.address, message)
        self.telemetry.refused(self.transport, reason)

    def _over_session_limit(self, session_id: str, fd: int | None) -> str | None:
        """Why a HELLO must be refused for the receiver's session caps (and count it), or None."""
        if session_id in self._sessions:
            return None  # the same session saying HELLO again: nothing new is held
        conn = self._connections.get(fd) if fd is not None else None
        host = conn.host if conn is not None else None
        if len(self._sessions) >= self.limits.max_sessions:
            reason, message = _limits.TOO_MANY_SESSIONS, (
                f"refused a sender from {host or 'an unknown address'}: {len(self._sessions)} sender sessions "
                f"are open, the most this receiver takes (max_sessions)")
        elif host is not None and sum(1 for s in self._sessions.values() if s.host == host) \
                >= self.limits.max_sessions_per_peer:
            reason, message = _limits.PEER_SESSIONS, (
                f"refused a sender from {host}: that address has {self.limits.max_sessions_per_peer} sender "
                "sessions open, the most one peer may (max_sessions_per_peer)")
        else:
            return None
        self._refuse_peer(reason, message)
        return f"the KV receiver at {self.address} {message.removeprefix('refused a sender from ')}"

    def _connection_accepted(self, fd: int, epoch: int) -> None:
        described = _limits.describe_fd(fd)
        if described is None:
            # Closed again before this event was read (zmq drops a too-large part at once): its close
            # event follows and must still be counted, so it is tracked with no address.
            self._connections[fd] = _limits.Connection(fd, epoch, None, None, "an address already gone")
            return
        local, peer = described
        host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        conn = _limits.Connection(fd, epoch, local, peer, host)
        self._connections[fd] = conn
        count = sum(1 for c in self._connections.values() if c.host == host)
        if count > self.limits.max_connections_per_peer and _limits.shut_down(conn):
            conn.cut = True
            self._cut_in_handshake += 1
            self._refuse_peer(_limits.PEER_CONNECTIONS, (
                f"closed a connection from {host}: that address has {count - 1} connections open, the most one "
                "peer may (max_connections_per_peer)"))

    def _connection_closed(self, fd: int, epoch: int) -> None:
        conn = self._connections.get(fd)
        if conn is None or conn.epoch > epoch:
            return
        del self._connections[fd]
        if conn.messages == 0 and not conn.cut and not self._closing:
            self._refuse_peer(_limits.DROPPED, (
                f"a connection from {conn.host} closed before it delivered any message: a message part over "
                f"{self.max_part_bytes} bytes (zmq's limit, max_frame_bytes), a zmq protocol error, or a peer that "
                "connected and left"))

    def _check_connections(self) -> None:
        """Shut down connections that hold more undelivered bytes than a legitimate sender can."""
        now = time.monotonic()
        if not self._connections or now < self._next_check:
            return
        self._next_check = now + self.limits.check_interval_s
        per_peer: dict[str, list[_limits.Connection]] = {}
        for conn in list(self._connections.values()):
            held = _limits.undelivered_bytes(conn)
            held = held if held is not None else 0
            # With nothing left to read, a legitimate connection holds at most the message being read;
            # one that held more at the last look too and delivered nothing since is not sending messages.
            stuck = (self._drained and held > self.max_message_bytes and conn.last_held > self.max_message_bytes
                     and conn.messages == conn.messages_at_check)
            conn.last_held, conn.messages_at_check = held, conn.messages
            if held > self.max_connection_bytes or stuck:
                if _limits.shut_down(conn):
                    conn.cut = True
                    self._refuse_peer(_limits.BYTES_IN_FLIGHT, (
                        f"closed a connection from {conn.host}: zmq held {held} bytes of it not yet delivered, "
                        f"more than a sender can have in flight on one connection ({self.max_connection_bytes}: "
                        f"rcvhwm + 1 frames; {self.max_message_bytes} while it delivers nothing)"))
                conn.last_held = 0
            per_peer.setdefault(conn.host, []).append(conn)
        for host, conns in per_peer.items():
            total = sum(c.last_held for c in conns)
            for conn in sorted(conns, key=lambda c: c.last_held, reverse=True):
                if total <= self.limits.max_inflight_bytes_per_peer or conn.last_held <= 0:
                    break
                if _limits.shut_down(conn):
                    conn.cut = True
                    self._refuse_peer(_limits.BYTES_IN_FLIGHT, (
                        f"closed a connection from {host}: zmq held {total} bytes of that address's connections "
                        f"not yet delivered, more than max_inflight_bytes_per_peer "
                        f"({self.limits.max_inflight_bytes_per_peer})"))
                total -= conn.last_held

    def _reservation_ended(self, reservation: Reservation, error: TransferError) -> None:
        """A reservation failed or was cancelled: runs before on_done / before cancel() returns, on the
        I/O thread or cancel()'s caller. rdma revokes the reservation's memory keys here (tcp: nothing to do,
        frames are written only while their reservation exists)."""

    def _session_closed(self, session_id: str) -> None:
        """A sender went away (rdma frees its queue pair here)."""

    def _on_finish(self, reservation: Reservation, msg: dict[str, object]) -> None:
        """tcp: every frame was verified as it came; DONE goes out when the last one is written."""
        reservation.finish_requested = True

    def _on_attach(self, identity: bytes, body: zmq.Frame, fd: int | None) -> None:
        msg = wire.decode_control(body.buffer)
        session = self._sessions.get(str(msg.get("session")))
        if session is None:
            log.warning("KV receiver: a stream attached to an unknown session; ignored")
            return
        if session.opener is not None:  # sealed: only the session's sender can attach, each stream once
            stream, proof = msg.get("stream"), msg.get("proof")
            try:
                opened = session.opener.open_body(wire.ATTACH, bytes.fromhex(proof if isinstance(proof, str) else ""))
            except (SealError, ValueError):
                opened = b""
            if opened != f"{session.session_id}/{stream}".encode() or stream in session.streams:
                self._refused_sealed(f"a stream without a valid proof tried to attach to session "
                                     f"{session.session_id[:8]}")
                return
            session.streams.add(stream if isinstance(stream, int) else -1)
        self._bind(session, identity, fd)

    def _bind(self, session: _Session, identity: bytes, fd: int | None) -> None:
        session.identities.add(identity)
        self._identity_session[identity] = session.session_id
        if fd is not None:
            # zmq reported this connection's accept before it delivered the connection's first
            # message: read the monitor now, and the epoch below is this connection's (or, if it
            # died at once and another took its fd, a later one: its session then ends with that).
            self._read_monitor()
            session.fds.add(fd)
            self._fd_sessions.setdefault(fd, {})[session.session_id] = self._accepted.get(fd, 0)

    def _on_transfer_control(self, identity: bytes, kind: bytes, msg: dict[str, object]) -> None:
        transfer_id = str(msg.get("transfer_id"))
        session_id = self._identity_session.get(identity)
        if session_id is None:
            self._unknown_session(identity, transfer_id)
            return
        reply_to = self._control_identity(identity)
        with self._lock:
            reservation = self._reservations.get(transfer_id)
        if reservation is None:
            self._reply_unknown(reply_to, transfer_id, finishing=kind == wire.FINISH)
            return
        if reservation.session not in (None, session_id):
            self._send(reply_to, self._failed_msg(transfer_id, TransferError(
                INVALID_FRAME, "another sender already began this transfer", transfer_id)))
            return
        if kind == wire.BEGIN:
            dst = msg.get("dst_block_ids")
            if dst != reservation.block_ids:
                self._fail(reservation, TransferError(INVALID_FRAME, "the sender's destination blocks differ "
                                                      "from the receiver's reservation", transfer_id), reply_to)
                return
            if reservation.begin_seen:  # a second BEGIN could declare another prompt for blocks already sent
                self._fail(reservation, TransferError(INVALID_FRAME, "BEGIN sent twice for this transfer",
                                                      transfer_id), reply_to)
                return
            try:
                digest = wire.decode_prompt_digest(msg)
            except ValueError as exc:
                self._fail(reservation, TransferError(INVALID_FRAME, str(exc), transfer_id), reply_to)
                return
            reservation.claim(session_id)
            with self._lock:
                reservation.begin_seen, reservation.prompt_digest = True, digest
            if reservation.complete:  # every frame overtook this BEGIN (frames use every stream, BEGIN the first)
                self._complete(reservation)
        elif kind == wire.FINISH:
            self._on_finish(reservation, msg)
        else:
            self._fail(reservation, TransferError(ABORTED, f"the sender aborted: {msg.get('message', '')}",
                                                  transfer_id), None)

    def _reply_unknown(self, identity: bytes, transfer_id: str, finishing: bool) -> None:
        with self._lock:
            known = transfer_id in self._outcomes
            outcome = self._outcomes.get(transfer_id)
        if known and outcome is None:
            if finishing:
                self._send(identity, wire.encode_control(wire.DONE, {"transfer_id": transfer_id}))
            return
        error = outcome or TransferError(UNKNOWN_TRANSFER, "the receiver expects no such transfer", transfer_id)
        self._send(identity, self._failed_msg(transfer_id, error))

    def _on_data(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        raw_id = parts[3].bytes
        transfer_id = raw_id.decode(errors="replace")
        session_id = self._identity_session.get(identity)
        if session_id is None:
            self._unknown_session(identity, transfer_id)
            return
        with self._lock:
            reservation = self._reservations.get(transfer_id)
            if reservation is not None and reservation.session not in (None, session_id):
                self._send(self._control_identity(identity), self._failed_msg(transfer_id, TransferError(
                    INVALID_FRAME, "another sender already began this transfer", transfer_id)))
                return
            if reservation is not None:
                reservation.claim(session_id)  # frames may overtake BEGIN (it travels on stream 0)
                try:
                    header = wire.unpack_header(parts[2].buffer)
                    if header.kind != wire.KV:
                        raise TransferError(INVALID_FRAME, f"a tcp frame carries K and V (kind {wire.KV}), "
                                            f"not kind {header.kind}", transfer_id)
                    k_part, v_part = parts[5].buffer, parts[6].buffer
                    opener = self._sessions[session_id].opener if session_id in self._sessions else None
                    if opener is not None:
                        dst_ids = check_data_frame(self.layout, header, raw_id, parts[4].buffer, k_part, v_part,
                                                   tag_bytes=TAG_BYTES)
                        k_part, v_part = self._open_frame(opener, header, parts, raw_id)
                    else:
                        dst_ids = check_data_frame(self.layout, header, raw_id, parts[4].buffer, k_part, v_part)
                    positions = reservation.positions(header.layer, header.kind, dst_ids)
                except ValueError as exc:
                    error: TransferError | None = TransferError(INVALID_FRAME, str(exc), transfer_id)
                except TransferError as exc:
                    error = exc
                else:
                    error = None
                    write_blocks(self.kv_cache, header.layer, wire.K, dst_ids, k_part)
                    write_blocks(self.kv_cache, header.layer, wire.V, dst_ids, v_part)
                    reservation.mark(header.layer, header.kind, positions, len(k_part) + len(v_part))
        if reservation is None:
            self._reply_unknown(self._control_identity(identity), transfer_id, finishing=False)
            return
        if error is not None:
            log.warning("KV receiver rejected a frame, nothing written: %s", error)
            self._fail(reservation, error, None)
            return
        if header.flags & wire.ACK_ME:
            self._send(self._control_identity(identity), [wire.ACK, raw_id, _SEQ.pack(header.seq)])
        if reservation.complete and reservation.begin_seen:  # else its BEGIN (with the prompt digest) completes it
            self._complete(reservation)

    def _open_frame(self, opener: SessionCipher, header: wire.FrameHeader, parts: list[zmq.Frame],
                    raw_id: bytes) -> tuple[memoryview, memoryview]:
        """Decrypt a sealed frame's K and V into the scratch buffer (the I/O thread's alone); raises
        TransferError(CORRUPT_FRAME) when either does not authenticate."""
        size = len(parts[5].buffer) - TAG_BYTES
        if len(self._scratch) < 2 * size:
            self._scratch = bytearray(2 * size)
        view = memoryview(self._scratch)
        k_out, v_out = view[:size], view[size:2 * size]
        aad = wire.sealed_aad(parts[2].buffer, raw_id, parts[4].buffer)
        counter = header.digest[0]
        try:
            opener.open_into(counter, K_PART, parts[5].buffer, aad, k_out)
            opener.open_into(counter, V_PART, parts[6].buffer, aad, v_out)
            opener.replay.accept(counter)  # only once both parts authenticated
        except SealError as exc:
            raise TransferError(CORRUPT_FRAME, f"frame {header.seq} (layer {header.layer}): {exc}",
                                raw_id.decode(errors="replace")) from None
        return k_out, v_out

    def _control_identity(self, identity: bytes) -> bytes:
        """Where replies to a message from `identity` go: its session's control socket. A sender names
        its sockets SESSION/control and SESSION/N (tcp_sender.py), which finds that socket even for
        a session this receiver does not know."""
        session = self._sessions.get(self._identity_session.get(identity, ""))
        if session is not None:
            return session.control
        prefix, slash, _ = identity.rpartition(b"/")
        return prefix + b"/control" if slash else identity

    def _unknown_session(self, identity: bytes, transfer_id: str) -> None:
        """A message from a sender this receiver has no session for (never said HELLO, or its session
        was ended while its connection stayed up): tell it to connect again, on the socket it reads."""
        error = TransferError(PEER_LOST, "the receiver has no session for this sender (no handshake, or its "
                              "connection was taken for closed): connect again", transfer_id)
        self._send(self._control_identity(identity), wire.encode_control(wire.FAILED, {
            "transfer_id": transfer_id, **error.to_wire(), "reconnect": True}))

    # --- outcomes --------------------------------------------------------------------------

    def _complete(self, reservation: Reservation) -> None:
        with self._lock:
            if self._reservations.pop(reservation.transfer_id, None) is None:
                return
            self._remember(reservation.transfer_id, None)
            self._digests[reservation.transfer_id] = reservation.prompt_digest  # for prompt_digest() in on_done
            while len(self._digests) > _RECENT_OUTCOMES:
                self._digests.popitem(last=False)
        seconds = time.monotonic() - (reservation.begun_at or time.monotonic())
        session = self._sessions.get(reservation.session or "")
        if session is not None and reservation.finish_requested:  # first: the sender is waiting for it
            self._send(session.control, wire.encode_control(wire.DONE, {"transfer_id": reservation.transfer_id}))
        self.telemetry.transferred(self.transport, "recv", reservation.bytes_received, seconds)
        self._notify(reservation, None)

    def _fail(self, reservation: Reservation, error: TransferError, reply_to: bytes | None) -> None:
        with self._lock:
            if self._reservations.pop(reservation.transfer_id, None) is None:
                return
            self._remember(reservation.transfer_id, error)
        self._reservation_ended(reservation, error)
        log.warning("KV transfer %s failed on the receiver: %s", reservation.transfer_id, error)
        self.telemetry.failed(self.transport, error.reason)
        session = self._sessions.get(reservation.session or "")
        target = reply_to or (session.control if session else None)
        if target is not None:
            self._send(target, self._failed_msg(reservation.transfer_id, error))
        self._notify(reservation, error)

    def _notify(self, reservation: Reservation, error: TransferError | None) -> None:
        try:
            reservation.on_done(reservation.transfer_id, error)
        except Exception:
            log.exception("KV receiver: on_done callback for %s raised", reservation.transfer_id)

    def _remember(self, transfer_id: str, outcome: TransferError | None) -> None:
        self._outcomes[transfer_id] = outcome
        while len(self._outcomes) > _RECENT_OUTCOMES:
            self._outcomes.popitem(last=False)

    @staticmethod
    def _failed_msg(transfer_id: str, error: TransferError) -> list[bytes]:
        return wire.encode_control(wire.FAILED, {"transfer_id": transfer_id, **error.to_wire()})

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [r for r in self._reservations.values() if r.expired(now)]
        for reservation in expired:
            total = len(reservation.block_ids) * 2 * self.layout.num_layers
            what = f"{reservation.missing} of {total} (layer, K/V, block) pieces missing"
            if not reservation.begin_seen:  # the BEGIN names the blocks and the prompt the KV was computed from
                what = (f"{what}, and no BEGIN" if reservation.missing else
                        f"all {total} (layer, K/V, block) pieces received but no BEGIN")
            self._fail(reservation, TransferError(TIMEOUT, f"deadline passed with {what}", reservation.transfer_id),
                       None)

    def _peer_closed(self, fd: int, epoch: int) -> None:
        """The connection of `epoch` on `fd` closed: end the sessions bound to it (not a newer one's)."""
        bound = self._fd_sessions.get(fd, {})
        for session_id in [s for s, bound_in in bound.items() if bound_in <= epoch]:
            self._end_session(session_id)

    def _end_session(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return
        for fd in session.fds:
            bound = self._fd_sessions.get(fd, {})
            bound.pop(session_id, None)
            if not bound:
                self._fd_sessions.pop(fd, None)
        for identity in session.identities:
            self._identity_session.pop(identity, None)
        self._session_closed(session.session_id)
        with self._lock:
            orphans = [r for r in self._reservations.values() if r.session == session.session_id]
        for reservation in orphans:
            self._fail(reservation, TransferError(PEER_LOST, "the sender's connection closed mid-transfer",
                                                  reservation.transfer_id), None)

    def _fail_all(self, error: TransferError) -> None:
        with self._lock:
            everything = list(self._reservations.values())
        for reservation in everything:
            self._fail(reservation, TransferError(error.reason, error.message, reservation.transfer_id), None)
