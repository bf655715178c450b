"""Small pyzmq helpers shared by the receiver and sender I/O threads."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable

import zmq
from zmq.utils.monitor import parse_monitor_message

# Monitor events that mean "the security handshake failed": a peer with other keys, or one side
# secure (kvTransfer.secure) and the other not.
HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

# Transfer ids are request ids; bounded so a header never balloons.
MAX_TRANSFER_ID_BYTES = 256

IDLE_LOOK_MS = 1000  # an I/O thread with no deadline due sooner still looks around this often


def poll_timeout_ms(deadlines: Iterable[float], now: float) -> int:
    """How long an I/O thread may sleep in poll(): until just past the earliest of `deadlines`
    (time.monotonic() values), at most IDLE_LOOK_MS."""
    earliest = min(deadlines, default=None)
    if earliest is None:
        return IDLE_LOOK_MS
    return max(0, min(IDLE_LOOK_MS, int((earliest - now) * 1000) + 1))


def monitor_socket(sock: zmq.Socket[bytes], events: int) -> zmq.Socket[bytes]:
    """A PAIR socket receiving `sock`'s monitor events, on an inproc endpoint of its own.

    pyzmq's default endpoint is named after the socket's file descriptor, and a closed socket keeps
    its endpoint until zmq's reaper has finished with it (its linger): a new socket that got the same
    descriptor number meanwhile fails with "Address already in use" (seen in CI on a reconnect).
    """
    return sock.get_monitor_socket(events, addr=f"inproc://tandem-monitor-{uuid.uuid4().hex}")


class Wakeup:
    """Lets other threads wake an I/O thread that sleeps in zmq.Poller.poll (an eventfd)."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # True from set() until the I/O thread's clear(): further set()s skip the syscall (one
        # per queued message was measurable). Safe because clear() empties the eventfd before
        # it resets the flag, and the I/O thread looks at its queues only after clear(): what
        # was queued before a skipped set() is seen by that pass.
        self._pending = False

    def set(self) -> None:
        if self._pending:
            return
        self._pending = True
        with contextlib.suppress(OSError):  # closed during shutdown
            os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(self.fd)
        self._pending = False

    def close(self) -> None:
        os.close(self.fd)


def monitor_events(monitor: zmq.Socket[bytes]) -> list[tuple[int, int]]:
    """Drain a monitor socket: its pending (event, value) pairs, in order. The value of an accept,
    a disconnect or a failed handshake is the connection's file descriptor."""
    events: list[tuple[int, int]] = []
    while True:
        try:
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return events
        events.append((int(event["event"]), int(event["value"])))


def disconnected_fds(monitor: zmq.Socket[bytes]) -> list[int]:
    """Drain a monitor socket; return the file descriptors of connections that closed."""
    return [fd for event, fd in monitor_events(monitor) if event == zmq.EVENT_DISCONNECTED]


def failed_handshakes(monitor: zmq.Socket[bytes]) -> int:
    """Drain a monitor socket; return how many security handshakes failed."""
    return sum(1 for event, _ in monitor_events(monitor) if event & HANDSHAKE_FAILED_EVENTS)


def source_fd(frame: zmq.Frame) -> int | None:
    """The socket a received message came in on (lets a monitor event be tied to a peer)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None


def encode_transfer_id(transfer_id: str) -> bytes:
    if not isinstance(transfer_id, str) or not transfer_id:
        raise ValueError("transfer_id must be a non-empty string")
    raw = transfer_id.encode()
    if len(raw) > MAX_TRANSFER_ID_BYTES:
        raise ValueError(f"transfer_id is longer than {MAX_TRANSFER_ID_BYTES} bytes")
    return raw


def check_deadline(deadline_s: float) -> float:
    if not isinstance(deadline_s, int | float) or not deadline_s > 0:
        raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
    return float(deadline_s)
