"""A connection that fails while it is being set up leaves nothing open behind it.

zmq's context.term() waits for every socket of the context to be closed: one socket leaked by a
half-made connection hung the sender's close() (a 60 s test timeout in CI, after a monitor socket
could not be made). The failure is injected here; the sockets, receiver and sender are real.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import zmq

from tandem.worker.transfer import tcp_sender
from tandem.worker.transfer.conformance import TINY_LAYOUT, DoneWaiter, transport_pair

pytestmark = pytest.mark.timeout(60)


def test_a_connection_that_fails_half_way_closes_its_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    real = tcp_sender.monitor_socket
    calls = {"n": 0}

    def fail_the_second(sock: Any, events: int) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the control socket is made; the first data socket's monitor fails
            raise zmq.ZMQError(zmq.EADDRINUSE)
        return real(sock, events)

    with transport_pair("tcp") as pair:
        monkeypatch.setattr(tcp_sender, "monitor_socket", fail_the_second)
        # Held on to, as a caller's traceback would be (pytest's kept the failed connection alive in CI):
        # garbage collection must not be what closes its sockets.
        with pytest.raises(zmq.ZMQError) as failed:
            pair.sender.connect(pair.receiver.address)
        monkeypatch.setattr(tcp_sender, "monitor_socket", real)
        # The next connect works, and a transfer over it lands.
        done = DoneWaiter()
        pair.receiver.expect("after-failure", [4, 5], 10.0, done)
        transfer = pair.sender.connect(pair.receiver.address).begin("after-failure", [4, 5], 10.0)
        for layer in range(TINY_LAYOUT.num_layers):
            transfer.send_layer(layer, [0, 1])
        transfer.finish()
        assert done.wait(5) is None
        closed = threading.Event()
        closer = threading.Thread(target=lambda: (pair.sender.close(), closed.set()), daemon=True)
        closer.start()
        assert closed.wait(10), "the sender's close() hung: a socket of the failed connection was left open"
        assert failed.value.errno == zmq.EADDRINUSE
