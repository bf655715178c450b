"""A sender that connects on the file descriptor a closed sender just gave up keeps its session.

The receiver learns that a connection closed from a zmq monitor event that names the connection's
file descriptor. The kernel hands a closed descriptor's number to the next connection it accepts,
so by the time the receiver's thread reads "fd 12 closed", fd 12 may already carry a new sender
whose handshake sits in the queue next to the event. Before the fix the receiver bound the new
sender to fd 12 and then applied the old event to it: the new sender's handshake succeeded, and
every transfer it began was then refused ("message before a successful handshake").

To make the race certain rather than likely, the test holds the receiver's lock (its I/O thread
stops at its next turn while zmq's own I/O thread keeps accepting connections) across the close
of the first sender and the connect of the second. The senders run in a child process, so that
the receiver's process allocates no descriptor in between and the new connection does get the
old one's number. Sockets, processes and the receiver are real.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import pytest

from tandem.worker.transfer.conformance import TINY_LAYOUT, DoneWaiter, RawTcpPeer, make_cache
from tandem.worker.transfer.tcp_receiver import TcpReceiver
from tandem.worker.transfer.tcp_sender import TcpSender

pytestmark = pytest.mark.timeout(90)


def _senders(address: str, pipe: Connection) -> None:
    """Connect, close, connect again (the new control connection gets the closed one's descriptor
    in the receiver's process), then transfer."""
    src = make_cache(TINY_LAYOUT, 8, random=True, seed=3)
    first = RawTcpPeer(address, TINY_LAYOUT)  # one connection, handshake done: one descriptor to reuse
    pipe.send("first connected")
    assert pipe.recv() == "close it"
    first.close()
    second = TcpSender(TINY_LAYOUT, src, streams=1)
    connection = second.connect(address)  # waits here until the receiver's thread runs again
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
    second.close()


def _recv(pipe: Connection, timeout: float) -> object:
    assert pipe.poll(timeout), "the sender process did not answer"
    return pipe.recv()


def test_a_sender_on_a_reused_descriptor_is_not_taken_for_the_one_that_closed() -> None:
    dst = make_cache(TINY_LAYOUT, 8, random=False)
    receiver = TcpReceiver(TINY_LAYOUT, dst)
    ctx = mp.get_context("spawn")
    pipe, child_end = ctx.Pipe()
    child = ctx.Process(target=_senders, args=(receiver.address, child_end), daemon=True)
    child.start()
    try:
        assert _recv(pipe, 30) == "first connected"
        with receiver._lock:  # the I/O thread parks at its next turn; zmq keeps accepting meanwhile
            receiver._wakeup.set()
            time.sleep(0.2)
            pipe.send("close it")
            time.sleep(1.0)  # the first sender closes, the second connects and sends its HELLO
        assert _recv(pipe, 30) == "second connected"

        done = DoneWaiter()
        block_ids = [5, 2, 7, 0]
        receiver.expect("after-reuse", block_ids, 20.0, done)
        pipe.send(("after-reuse", block_ids))
        assert _recv(pipe, 30) == "ok"
        assert done.wait(10) is None
        src = make_cache(TINY_LAYOUT, 8, random=True, seed=3)
        for position, block in enumerate(block_ids):
            assert dst[:, :, block].equal(src[:, :, position])
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
        receiver.close()

