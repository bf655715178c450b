"""A short loopback measurement of the tcp transport (used by `tandem doctor`).

Both ends run in this process on 127.0.0.1, so the figure is a lower bound of what two
processes reach (they share one interpreter lock); hack/bench_transfer.py is the benchmark.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import torch

from tandem.worker.kv.layout import KVLayout

from .tcp_receiver import TcpReceiver
from .tcp_sender import TcpSender
from .tracking import DoneCallback

_LAYOUT = KVLayout(model="loopback", dtype="float16", block_size=16, num_layers=1, num_kv_heads=8, head_dim=128)


@dataclass(frozen=True)
class LoopbackResult:
    transfer_bytes: int
    transfers: int
    tcp_gbps: float  # tandem's tcp transport, verified into a cache
    socket_gbps: float  # plain socket sendall / recv_into, same sizes: the ceiling


def measure_loopback(seconds: float = 0.5, transfer_bytes: int = 16 << 20) -> LoopbackResult:
    unit = 2 * _LAYOUT.bytes_per_block_layer_kv
    blocks = max(1, transfer_bytes // unit)
    shape = (1, 2, blocks, _LAYOUT.block_size, _LAYOUT.num_kv_heads, _LAYOUT.head_dim)
    src, dst = torch.ones(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16)
    ids = list(range(blocks))
    done = threading.Event()
    on_done: DoneCallback = lambda _tid, _err: done.set()  # noqa: E731
    count, moved, elapsed = 0, 0, 0.0
    with TcpReceiver(_LAYOUT, dst) as receiver, TcpSender(_LAYOUT, src) as sender:
        conn = sender.connect(receiver.address)
        stop = time.monotonic() + seconds
        while time.monotonic() < stop or count == 0:
            count += 1
            done.clear()
            receiver.expect(f"loopback-{count}", ids, 10.0, on_done)
            start = time.perf_counter()
            transfer = conn.begin(f"loopback-{count}", ids, 10.0)
            transfer.send_layer(0, ids)
            moved += transfer.finish().bytes_sent
            elapsed += time.perf_counter() - start
    return LoopbackResult(blocks * unit, count, moved / elapsed / 1e9, _socket_gbps(blocks * unit, seconds))


def _socket_gbps(size: int, seconds: float) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    payload = memoryview(bytearray(size))
    sink = memoryview(bytearray(size))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while True:
                got = 0
                while got < size:
                    n = conn.recv_into(sink[got:])
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"k")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    moved, elapsed = 0, 0.0
    with socket.create_connection(listener.getsockname()) as client:
        stop = time.monotonic() + seconds
        while time.monotonic() < stop or moved == 0:
            start = time.perf_counter()
            client.sendall(payload)
            client.recv(1)
            elapsed += time.perf_counter() - start
            moved += size
    thread.join(timeout=5)
    listener.close()
    return moved / elapsed / 1e9
