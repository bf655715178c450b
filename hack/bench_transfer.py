#!/usr/bin/env python3
"""KV transfer benchmark: tandem's tcp transport against the raw loopback-socket ceiling.

For each batch size (bytes of KV moved by one transfer), it times transfers end to end
(begin -> every block verified into the receiver's cache -> finish() returns) and, in the
same run, plain-socket transfers of the same sizes (sendall / recv_into plus a 1-byte ack,
which is the most a TCP transport can reach on this machine). The receiver runs in a child
process in both cases, so the two sides do not share a GIL. It also reports the CPU time both
processes spent per GiB moved, which stays meaningful when other work shares the machine.

    .venv/bin/python hack/bench_transfer.py [--seconds 1.5] [--sizes 64K,256K,1M,4M,16M,64M] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tandem.worker.kv.layout import KVLayout
from tandem.worker.transfer.tcp_receiver import TcpReceiver
from tandem.worker.transfer.tcp_sender import TcpSender

# One layer, fp16, 16-token blocks of 8 KV heads x 128: 32 KiB per (layer, K/V, block), a
# typical 7B-8B model's unit; a transfer of S bytes moves S / 64 KiB blocks, K and V.
LAYOUT = KVLayout(model="bench", dtype="float16", block_size=16, num_layers=1, num_kv_heads=8, head_dim=128)
UNIT = 2 * LAYOUT.bytes_per_block_layer_kv  # bytes per block (K + V)


@dataclass
class Row:
    size: int
    raw_gbps: float
    raw_p50_ms: float
    raw_p99_ms: float
    tcp_gbps: float
    tcp_p50_ms: float
    tcp_p99_ms: float
    raw_cpu_s_per_gib: float
    tcp_cpu_s_per_gib: float

    @property
    def ratio(self) -> float:
        return self.tcp_gbps / self.raw_gbps


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# --- raw socket ceiling ----------------------------------------------------------------------

def raw_server(port_out: Any, max_size: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_out.send(listener.getsockname()[1])
    conn, _ = listener.accept()
    buffer = bytearray(max_size)
    view = memoryview(buffer)
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        size, got = int.from_bytes(head, "little"), 0
        if size == 0:  # the client asks for this process's CPU time
            conn.sendall(struct.pack("<d", time.process_time()))
            continue
        while got < size:
            n = conn.recv_into(view[got:size])
            if n == 0:
                return
            got += n
        conn.sendall(b"k")


class RawClient:
    """Plain-socket transfers to a child process: the ceiling."""

    def __init__(self, max_size: int) -> None:
        parent, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=raw_server, args=(child, max_size), daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", parent.recv()))
        self.payload = memoryview(bytearray(os.urandom(1024)) * (max_size // 1024 + 1))

    def cpu_now(self) -> float:
        self.sock.sendall((0).to_bytes(8, "little"))
        return time.process_time() + float(struct.unpack("<d", self.sock.recv(8, socket.MSG_WAITALL))[0])

    def transfer(self, size: int) -> float:
        start = time.perf_counter()
        self.sock.sendall(size.to_bytes(8, "little"))
        self.sock.sendall(self.payload[:size])
        if self.sock.recv(1) != b"k":
            raise RuntimeError("raw receiver went away")
        return time.perf_counter() - start

    def close(self) -> None:
        self.sock.close()
        self.proc.join(timeout=5)


# --- tandem tcp transport --------------------------------------------------------------------

def tcp_server(conn: Any, num_blocks: int) -> None:
    cache = torch.zeros(LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
                        LAYOUT.head_dim, dtype=torch.float16)
    receiver = TcpReceiver(LAYOUT, cache)
    conn.send(receiver.address)
    done = threading.Event()
    errors: list[str] = []

    def on_done(transfer_id: str, error: Exception | None) -> None:
        if error is not None:
            errors.append(str(error))
        done.set()

    while True:
        message = conn.recv()
        if message is None:
            receiver.close()
            return
        if message == "cpu":
            conn.send(time.process_time())
            continue
        transfer_id, block_ids = message
        done.clear()
        receiver.expect(transfer_id, block_ids, 30.0, on_done)
        conn.send("ready")


class TcpClient:
    """tandem tcp transfers (begin, send_layer, finish) to a receiver in a child process."""

    def __init__(self, max_size: int, streams: int, frame_bytes: int) -> None:
        num_blocks = max_size // UNIT
        self.pipe, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=tcp_server, args=(child, num_blocks), daemon=True)
        self.proc.start()
        address = self.pipe.recv()
        cache = torch.randn(LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
                            LAYOUT.head_dim).to(torch.float16)
        self.sender = TcpSender(LAYOUT, cache, streams=streams, frame_bytes=frame_bytes)
        self.conn = self.sender.connect(address)
        self.counter = 0

    def cpu_now(self) -> float:
        self.pipe.send("cpu")
        return time.process_time() + float(self.pipe.recv())

    def transfer(self, size: int) -> float:
        blocks = list(range(size // UNIT))
        self.counter += 1
        transfer_id = f"bench-{self.counter}"
        self.pipe.send((transfer_id, blocks))
        self.pipe.recv()
        start = time.perf_counter()
        transfer = self.conn.begin(transfer_id, blocks, 30.0)
        transfer.send_layer(0, blocks)
        transfer.finish()
        return time.perf_counter() - start

    def close(self) -> None:
        self.sender.close()
        self.pipe.send(None)
        self.proc.join(timeout=10)


Client = RawClient | TcpClient


def measure(clients: dict[str, Client], sizes: list[int], seconds: float,
            rounds: int = 4) -> dict[str, tuple[dict[int, list[float]], dict[int, float]]]:
    """Alternate the clients in short rounds per size, so load from elsewhere hits both alike."""
    results: dict[str, tuple[dict[int, list[float]], dict[int, float]]] = {
        name: ({size: [] for size in sizes}, {size: 0.0 for size in sizes}) for name in clients}
    for size in sizes:
        for _ in range(rounds):
            for name, client in clients.items():
                times, cpu = results[name]
                cpu_start, count = client.cpu_now(), 0
                stop = time.monotonic() + seconds / rounds
                while time.monotonic() < stop or count < 2:
                    times[size].append(client.transfer(size))
                    count += 1
                cpu[size] += client.cpu_now() - cpu_start
        for name in clients:
            times, cpu = results[name]
            cpu[size] /= size * len(times[size]) / 2**30
    return results


def summarize(sizes: list[int], raw: tuple[dict[int, list[float]], dict[int, float]],
              tcp: tuple[dict[int, list[float]], dict[int, float]]) -> list[Row]:
    rows = []
    for size in sizes:
        r, t = raw[0][size], tcp[0][size]
        rows.append(Row(size, size / statistics.median(r) / 1e9, percentile(r, 0.5) * 1e3, percentile(r, 0.99) * 1e3,
                        size / statistics.median(t) / 1e9, percentile(t, 0.5) * 1e3, percentile(t, 0.99) * 1e3,
                        raw[1][size], tcp[1][size]))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| batch | raw socket GB/s | tandem tcp GB/s | tcp / raw | raw p50 / p99 ms | tcp p50 / p99 ms "
             "| CPU s per GiB raw / tcp |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {human(row.size)} | {row.raw_gbps:.2f} | {row.tcp_gbps:.2f} | {row.ratio:.0%} | "
                     f"{row.raw_p50_ms:.2f} / {row.raw_p99_ms:.2f} | {row.tcp_p50_ms:.2f} / {row.tcp_p99_ms:.2f} | "
                     f"{row.raw_cpu_s_per_gib:.2f} / {row.tcp_cpu_s_per_gib:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    parser.add_argument("--seconds", type=float, default=1.5, help="time spent per size and transport")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--frame-bytes", default="4M")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if any(size < UNIT or size % UNIT for size in sizes):
        parser.error(f"every size must be a positive multiple of {UNIT} bytes (one block, K and V)")
    clients: dict[str, Client] = {"raw": RawClient(max(sizes)),
                                  "tcp": TcpClient(max(sizes), args.streams, parse_size(args.frame_bytes))}
    try:
        results = measure(clients, sizes, args.seconds)
    finally:
        for client in clients.values():
            client.close()
    raw, tcp = results["raw"], results["tcp"]
    rows = summarize(sizes, raw, tcp)
    load = os.getloadavg()[0]
    print(f"# {' '.join(sys.argv)}  (cpus: {os.cpu_count()}, load {load:.1f}; one run, raw and tcp "
          "alternating per size; GB/s from the median transfer)")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([{**asdict(row), "ratio": row.ratio} for row in rows], out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
