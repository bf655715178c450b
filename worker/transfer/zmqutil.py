"""Small pyzmq helpers shared by the receiver and sender I/O threads."""

from __future__ import annotations

import contextlib
import os
import uuid

import zmq
from zmq.utils.monitor import parse_monitor_message

# Monitor events that mean "the security handshake failed": a peer with other keys, or one side
# secure (kvTransfer.secure) and the other not.
HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

# Transfer ids are request ids; bounded so a header never balloons.
MAX_TRANSFER_ID_BYTES = 256


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


def disconnected_fds(monitor: zmq.Socket[bytes]) -> list[int]:
    """Drain a monitor socket; return the file descriptors of connections that closed."""
    return monitor_events(monitor)[0]


def monitor_events(monitor: zmq.Socket[bytes]) -> tuple[list[int], int]:
    """Drain a monitor socket: (file descriptors of closed connections, failed security handshakes)."""
    closed: list[int] = []
    failed_handshakes = 0
    while True:
        try:
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return closed, failed_handshakes
        if event["event"] == zmq.EVENT_DISCONNECTED:
            closed.append(int(event["value"]))
        elif event["event"] & HANDSHAKE_FAILED_EVENTS:
            failed_handshakes += 1


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
