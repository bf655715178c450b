"""A sender that connects on the file descriptor a closed sender just gave up keeps its session.

The receiver learns that a connection closed from a zmq monitor event that names the connection's
file descriptor. The kernel hands a closed descriptor's number to the next connection it accepts,
so by the time the receiver's thread reads "fd 12 closed", fd 12 may already carry a new sender
whose handshake sits in the queue next to the event. Before the fix the receiver bound the new
sender to fd 12 and then applied the old event to it: the new sender's handshake succeeded, and
every transfer it began got no answer (the receiver's refusal went to a data socket, which the
sender never reads) and failed at its deadline.

To make the race certain rather than likely, the test holds the receiver's lock (its I/O thread
stops at its next turn while zmq's own I/O thread keeps accepting connections) across the close
of the first sender and the connect of the second. The senders run in a child process, so that
the receiver's process allocates no descriptor in between and the new connection does get the
old one's number (the child is conformance.spawn_reconnecting_sender). Sockets, processes and the
receiver are real.
"""

from __future__ import annotations

import time

import pytest

from tandem.worker.transfer import TransferError
from tandem.worker.transfer.conformance import (
    TINY_LAYOUT,
    DoneWaiter,
    make_cache,
    spawn_reconnecting_sender,
    transport_pair,
)
from tandem.worker.transfer.tcp_receiver import TcpReceiver

pytestmark = pytest.mark.timeout(90)


def test_a_sender_on_a_reused_descriptor_is_not_taken_for_the_one_that_closed() -> None:
    dst = make_cache(TINY_LAYOUT, 8, random=False)
    receiver = TcpReceiver(TINY_LAYOUT, dst)
    # One hand-made connection, then (when told) a real sender whose control connection gets the
    # closed one's descriptor in this process.
    peer = spawn_reconnecting_sender(receiver.address)
    try:
        assert peer.recv(30) == "first connected"
        with receiver._lock:  # the I/O thread parks at its next turn; zmq keeps accepting meanwhile
            receiver._wakeup.set()
            time.sleep(0.2)
            peer.pipe.send("close it")
            time.sleep(1.0)  # the first connection closes, the sender connects and sends its HELLO
        assert peer.recv(30) == "second connected"

        done = DoneWaiter()
        block_ids = [5, 2, 7, 0]
        receiver.expect("after-reuse", block_ids, 20.0, done)
        peer.pipe.send(("after-reuse", block_ids))
        assert peer.recv(30) == "ok"
        assert done.wait(10) is None
        src = make_cache(TINY_LAYOUT, 8, random=True, seed=3)
        for position, block in enumerate(block_ids):
            assert dst[:, :, block].equal(src[:, :, position])
    finally:
        peer.process.join(timeout=10)
        peer.kill()
        receiver.close()


def test_a_sender_whose_session_the_receiver_ended_learns_it_at_once_and_connects_again() -> None:
    """The receiver ended a sender's session while the sender's connection stayed up: what the race
    above did. No other way to get there is known, so the test ends the session by hand, through
    the receiver's own method, while its I/O thread is idle. The sender's next transfer fails at once
    with peer_lost (before: the receiver's refusal went to a data socket nobody reads, and the
    transfer waited out its deadline), and connect() then opens a fresh connection that works."""
    with transport_pair("tcp", src_blocks=8, dst_blocks=8) as pair:
        receiver, sender = pair.receiver, pair.sender
        assert isinstance(receiver, TcpReceiver)
        stale = sender.connect(receiver.address)
        time.sleep(0.2)
        receiver._end_session(next(iter(receiver._sessions)))

        receiver.expect("after-end", [1, 2], 20.0, DoneWaiter())
        started = time.monotonic()
        with pytest.raises(TransferError) as failed:
            transfer = stale.begin("after-end", [1, 2], 20.0)
            for layer in range(TINY_LAYOUT.num_layers):
                transfer.send_layer(layer, [0, 1])
            transfer.finish()
        assert failed.value.reason == "peer_lost", failed.value
        assert time.monotonic() - started < 5
        assert receiver.cancel("after-end")

        fresh = sender.connect(receiver.address)
        assert fresh is not stale
        done = DoneWaiter()
        receiver.expect("reconnected", [3, 4], 20.0, done)
        transfer = fresh.begin("reconnected", [3, 4], 20.0)
        for layer in range(TINY_LAYOUT.num_layers):
            transfer.send_layer(layer, [0, 1])
        transfer.finish()
        assert done.wait(10) is None
        assert pair.dst[:, :, 3:5].equal(pair.src[:, :, 0:2])
