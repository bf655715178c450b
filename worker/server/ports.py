"""Free TCP ports for processes started on this machine (`tandem serve`, tests, hack scripts).

The kernel may hand out the same ephemeral port to two `bind(0)` calls in a row once the first socket
is closed, so a process that asks for several ports (a worker's HTTP and KV ports, the operator's
health and metrics ports) could get one twice: the second server then fails to bind, or worse, a
different server answers on it. Ports handed out here are remembered and never handed out again by
this process.
"""

from __future__ import annotations

import socket
import threading

_handed_out: set[int] = set()
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and that this process has not been given before."""
    with _lock:
        for _ in range(64):
            with socket.socket() as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no fresh free port on {host} after 64 tries")
