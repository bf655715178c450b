"""Bounds on what peers can make a KV receiver hold: message size, queues, sessions, bytes in flight.

A receiver's port is reachable by anyone on the network (and with `kvTransfer.secure` off, anyone can
complete the handshake). Without bounds one junk message of 1 GiB raised a decode worker's peak RSS
by 768 MiB, and a message of endless tiny parts costs zmq about 64 bytes per 2 wire bytes (it keeps
every part of a message until the last one arrives). So the receiver sets:

- `ZMQ_MAXMSGSIZE` (per message part) to the largest part a legitimate sender can send for this
  layout and pool: a K or V payload of a frame of at most `max_frame_bytes` (whole blocks, never more
  than the pool), or a control message naming every block of the pool, plus header room. zmq drops
  the connection of a peer that announces a bigger part before it allocates anything.
- `ZMQ_RCVHWM` to `rcvhwm` messages per connection: zmq stops reading a connection whose queue is
  full, and TCP pushes back on the sender.
- A cap on sessions (handshakes) in all and per peer address: a HELLO over either is refused.
- A cap on connections per peer address: a connection over it is shut down at once.
- A cap on bytes in flight per connection and per peer address: the bytes zmq has read from the
  kernel and not delivered (`TCP_INFO` bytes received, less what is still in the kernel's queue,
  less the wire size of the messages delivered). A legitimate connection's undelivered bytes are at
  most its queued messages (`rcvhwm`) plus the one being read, and only that one once the receiver
  has read every complete message; a connection that holds more (a message of endless parts), or the largest of a peer's connections while that peer holds more than
  `max_inflight_bytes_per_peer`, is shut down.

Every refusal and disconnect is logged with the peer's address and counted in
tandem_kv_receiver_refusals_total by reason (REFUSAL_REASONS).
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import termios
from dataclasses import dataclass

from tandem.worker.kv.layout import KVLayout

log = logging.getLogger(__name__)

DEFAULT_FRAME_BYTES = 2 << 20  # the tcp sender's default frame_bytes (tcp_sender.TcpSender)

# Reasons of tandem_kv_receiver_refusals_total.
TOO_MANY_SESSIONS = "too_many_sessions"  # the receiver holds max_sessions sessions already
PEER_SESSIONS = "peer_sessions"  # this peer address holds max_sessions_per_peer already
PEER_CONNECTIONS = "peer_connections"  # this peer address holds max_connections_per_peer already
BYTES_IN_FLIGHT = "bytes_in_flight"  # a connection held more undelivered bytes than a sender can
DROPPED = "dropped"  # zmq closed a connection before it delivered any message (too large a part, bad framing)
REFUSAL_REASONS = (TOO_MANY_SESSIONS, PEER_SESSIONS, PEER_CONNECTIONS, BYTES_IN_FLIGHT, DROPPED)

HEADER_ROOM = 64 << 10  # zmq/CURVE framing, the frame header, the transfer id, and control fields
HANDSHAKE_ALLOWANCE = 64 << 10  # wire bytes of a connection's greeting and handshake (metadata included)
_CURVE_PART_OVERHEAD = 33  # "\x07MESSAGE", nonce, flags byte and MAC around every CURVE-boxed part
_TCPI_BYTES_RECEIVED = struct.Struct("=Q")
_TCPI_BYTES_RECEIVED_OFFSET = 128  # struct tcp_info (Linux >= 4.1)


@dataclass(frozen=True)
class ReceiverLimits:
    """A receiver's bounds (TcpReceiver(limits=...), make_receiver(..., limits=...)); docs/transfer.md."""

    max_frame_bytes: int = DEFAULT_FRAME_BYTES  # the largest frame_bytes any sender of this receiver uses
    rcvhwm: int = 4  # complete messages zmq queues per connection before it stops reading it
    max_sessions: int = 256  # sender sessions (handshakes) at once, all peers
    max_sessions_per_peer: int = 16  # sender sessions at once from one peer address
    max_connections_per_peer: int = 64  # TCP connections at once from one peer address (a session: 1 + streams)
    max_inflight_bytes_per_peer: int = 64 << 20  # undelivered bytes zmq may hold for one peer address
    check_interval_s: float = 0.02  # how often connections' bytes in flight are read while any is open

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "rcvhwm", "max_sessions", "max_sessions_per_peer",
                     "max_connections_per_peer", "max_inflight_bytes_per_peer"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.check_interval_s > 0:
            raise ValueError(f"check_interval_s must be positive, got {self.check_interval_s!r}")


def max_part_bytes(layout: KVLayout, num_blocks: int, max_frame_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE for a tcp receiver of this layout and pool: the largest legitimate message part.

    Data: the sender cuts frames of max(1, frame_bytes // (2 * bytes_per_block_layer_kv)) blocks
    (tcp_sender.OutgoingTransfer.send_layer), one part for K and one for V, never more blocks than the
    receiver's pool. Control: BEGIN lists every destination block as JSON (at most the pool).
    """
    unit = layout.bytes_per_block_layer_kv
    blocks_per_frame = min(num_blocks, max(1, max_frame_bytes // (2 * unit)))
    data = blocks_per_frame * unit
    control = num_blocks * (len(str(num_blocks)) + 2)  # "1234, " per block id, JSON
    return max(data, control) + HEADER_ROOM


def wire_bytes(sizes: list[int], curve: bool) -> int:
    """Bytes on the wire of message parts of these sizes (ZMTP 3 framing, CURVE boxing if on)."""
    total = 0
    for size in sizes:
        if curve:
            size += _CURVE_PART_OVERHEAD
        total += size + (2 if size < 256 else 9)
    return total


@dataclass
class Connection:
    """An accepted connection, as the receiver's I/O thread tracks it."""

    fd: int
    epoch: int
    local: object  # getsockname(), to tell this connection from a later one on the same fd number
    peer: object  # getpeername()
    host: str  # the peer's address (what the per-peer caps count)
    delivered: int = HANDSHAKE_ALLOWANCE  # wire bytes accounted for: the handshake, then every message
    messages: int = 0
    last_held: int = 0  # undelivered bytes at the last check
    messages_at_check: int = 0  # messages delivered as of the last check
    cut: bool = False  # shut down by the receiver (counted under its reason, not as dropped)


def _borrow(fd: int) -> socket.socket | None:
    """A socket object over zmq's descriptor, to be detach()ed (never closed) by the caller."""
    try:
        return socket.socket(fileno=fd)
    except OSError:  # closed, or its number now names something that is not a socket
        return None


def describe_fd(fd: int) -> tuple[object, object] | None:
    """(local address, peer address) of a TCP socket descriptor; None if it is not one (any more)."""
    sock = _borrow(fd)
    if sock is None:
        return None
    try:
        return sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    finally:
        sock.detach()  # the descriptor stays zmq's: never closed here


def undelivered_bytes(conn: Connection) -> int | None:
    """Bytes zmq has read from this connection and not delivered yet; None if it cannot be told (closed,
    its descriptor reused, or no TCP_INFO bytes counter on this kernel)."""
    sock = _borrow(conn.fd)
    if sock is None:
        return None
    try:
        if (sock.getsockname(), sock.getpeername()) != (conn.local, conn.peer):
            return None
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        queued = bytearray(4)
        fcntl.ioctl(conn.fd, termios.FIONREAD, queued)
    except OSError:
        return None
    finally:
        sock.detach()
    if len(info) < _TCPI_BYTES_RECEIVED_OFFSET + 8:
        return None
    received: int = _TCPI_BYTES_RECEIVED.unpack_from(info, _TCPI_BYTES_RECEIVED_OFFSET)[0]
    in_kernel: int = struct.unpack("=i", queued)[0]
    return received - in_kernel - conn.delivered


def shut_down(conn: Connection) -> bool:
    """End this connection (zmq sees it close and drops what it held); False if it is already gone."""
    sock = _borrow(conn.fd)
    if sock is None:
        return False
    try:
        if (sock.getsockname(), sock.getpeername()) != (conn.local, conn.peer):
            return False
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.detach()
