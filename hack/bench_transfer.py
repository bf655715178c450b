#!/usr/bin/env python3
"""KV transfer benchmark: tandem's tcp transport against the raw loopback-socket ceiling.

For each batch size (bytes of KV moved by one transfer), it times transfers end to end
(begin -> every block verified into the receiver's cache -> finish() returns) and, in the
same run, plain-socket transfers of the same sizes (sendall / recv_into plus a 1-byte ack,
which is the most a TCP transport can reach on this machine). The receiver runs in a child
process in both cases, so the two sides do not share a GIL. It also reports the CPU time both
processes spent per GiB moved, which stays meaningful when other work shares the machine.

    .venv/bin/python hack/bench_transfer.py [--seconds 1.5] [--sizes 64K,256K,1M,4M,16M,64M] [--json out.json]
        [--variant LABEL:streams=N,frame=SIZE,alloc=keep|default,secure=0|1,seal=0|1,checks=on|off,floor=0|1,tls=0|1 ...]   # several: an A/B in one run
        [--rounds 4]   # raw and the variants take turns this many times per size (more: fairer under load)

A variant with `checks=off` is an ablation, not a configuration: it skips the payload digest on both
sides and the receiver's copy into its cache (every other check still runs), to show what those
two cost against the rest of the transport in the same run. The transport itself has no such switch.
A variant with `floor=1` is not the transport at all: pyzmq alone, sending the same multipart
frames (same frame size, same number of data streams, zero-copy) to a ROUTER that drops them and
answers a finish message once all arrived. No digest, no bookkeeping, no copy: the floor any
transport built on pyzmq stands on, on this machine.
A variant with `tls=1` is not the transport either: the raw socket above inside TLS 1.3 (Python's
ssl, a throwaway self-signed certificate, the cipher OpenSSL negotiates, printed), with a 1-byte ack
per transfer like raw. It is the reference for "what would TLS cost here", beside the sealed
transport (seal=1), which encrypts with the same AES-GCM TLS 1.3 uses.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import zmq

from tandem.worker.kv.keys import KVKeys
from tandem.worker.kv.layout import KVLayout
from tandem.worker.transfer import allocator, tcp_receiver, wire
from tandem.worker.transfer.limits import DEFAULT_FRAME_BYTES, ReceiverLimits
from tandem.worker.transfer.sealing import SealSecrets
from tandem.worker.transfer.tcp_receiver import TcpReceiver
from tandem.worker.transfer.tcp_sender import TcpSender

# One layer, fp16, 16-token blocks of 8 KV heads x 128: 32 KiB per (layer, K/V, block), a
# typical 7B-8B model's unit; a transfer of S bytes moves S / 64 KiB blocks, K and V.
LAYOUT = KVLayout(model="bench", dtype="float16", block_size=16, num_layers=1, num_kv_heads=8, head_dim=128)
UNIT = 2 * LAYOUT.bytes_per_block_layer_kv  # bytes per block (K + V)


@dataclass
class Stats:
    """One transport at one batch size."""

    gbps: float
    p50_ms: float
    p99_ms: float
    cpu_s_per_gib: float


@dataclass
class Row:
    size: int
    raw: Stats
    tcp: dict[str, Stats]  # by variant label, in the order given


@dataclass(frozen=True)
class Variant:
    """A tcp transport configuration to measure (several may run side by side: an A/B in one run)."""

    label: str
    streams: int
    frame_bytes: int
    keep_freed_buffers: bool = True  # the transport's allocator setting (allocator.py); the receiver's is what counts
    secure: bool = False  # kvTransfer.secure: CURVE on the zmq sockets (security.py)
    seal: bool = False  # sealed transfer: AES-256-GCM with keys from the control token (sealing.py)
    checks: bool = True  # False: the ablation described at the top (bench only)
    floor: bool = False  # True: pyzmq alone with this framing, not the transport (described at the top)
    tls: bool = False  # True: the raw socket inside TLS 1.3, not the transport (described at the top)


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


# --- TLS 1.3 reference ------------------------------------------------------------------------

def _self_signed(folder: str) -> tuple[str, str]:
    """A throwaway certificate for 127.0.0.1 (cryptography, the worker extra's dependency)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    with open(certfile, "wb") as out:
        out.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(keyfile, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return certfile, keyfile


def _recv_exact(conn: Any, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def tls_server(port_out: Any, max_size: int, certfile: str, keyfile: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(certfile, keyfile)
    listener = socket.create_server(("127.0.0.1", 0))
    port_out.send(listener.getsockname()[1])
    conn = context.wrap_socket(listener.accept()[0], server_side=True)
    view = memoryview(bytearray(max_size))
    head = memoryview(bytearray(8))
    while _recv_exact(conn, head):
        size = int.from_bytes(head, "little")
        if size == 0:
            conn.sendall(struct.pack("<d", time.process_time()))
        elif _recv_exact(conn, view[:size]):
            conn.sendall(b"k")
        else:
            return


class TlsClient(RawClient):
    """The raw socket's transfers inside TLS 1.3: what TLS costs on this machine (a reference, not the transport)."""

    def __init__(self, max_size: int) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="bench-tls-")
        certfile, keyfile = _self_signed(self._folder.name)
        parent, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=tls_server, args=(child, max_size, certfile, keyfile),
                                                    daemon=True)
        self.proc.start()
        context = ssl.create_default_context(cafile=certfile)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        self.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", parent.recv())),
                                        server_hostname="localhost")
        self.cipher = str(self.sock.cipher()[0])
        self.payload = memoryview(bytearray(os.urandom(1024)) * (max_size // 1024 + 1))

    def cpu_now(self) -> float:
        self.sock.sendall((0).to_bytes(8, "little"))
        reply = memoryview(bytearray(8))
        if not _recv_exact(self.sock, reply):
            raise RuntimeError("TLS receiver went away")
        return time.process_time() + float(struct.unpack("<d", reply)[0])

    def close(self) -> None:
        super().close()
        self._folder.cleanup()


# --- tandem tcp transport --------------------------------------------------------------------

_real_digest = wire.frame_digest
_unchecked = False  # set while an ablated (checks=off) variant's transfer runs in this process


def _digest_unless_ablated(*args: Any, **kwargs: Any) -> wire.Digest:
    return (0, 0) if _unchecked else _real_digest(*args, **kwargs)


wire.frame_digest = _digest_unless_ablated  # the senders all live in this process; clients take turns


def tcp_server(conn: Any, num_blocks: int, keep_freed_buffers: bool, keys: KVKeys | None = None,
               checks: bool = True, max_frame_bytes: int = DEFAULT_FRAME_BYTES, seal: SealSecrets | None = None) -> None:
    if not checks:  # this child serves one ablated variant: no payload digest, no copy into the cache
        global _unchecked
        _unchecked = True
        tcp_receiver.write_blocks = lambda *args: None
    cache = torch.zeros(LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
                        LAYOUT.head_dim, dtype=torch.float16)
    receiver = TcpReceiver(LAYOUT, cache, keep_freed_buffers=keep_freed_buffers, keys=keys, seal=seal,
                           limits=ReceiverLimits(max_frame_bytes=max_frame_bytes))  # its sender's frames fit
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

    def __init__(self, max_size: int, variant: Variant) -> None:
        num_blocks = max_size // UNIT
        self.pipe, child = mp.Pipe()
        keys = KVKeys.generate() if variant.secure else None
        seal = SealSecrets.from_tokens([secrets.token_hex(16)]) if variant.seal else None
        self.proc = mp.get_context("spawn").Process(target=tcp_server, args=(child, num_blocks,
                                                                             variant.keep_freed_buffers, keys,
                                                                             variant.checks, variant.frame_bytes, seal),
                                                    daemon=True)
        self.proc.start()
        address = self.pipe.recv()
        cache = torch.randn(LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads,
                            LAYOUT.head_dim).to(torch.float16)
        # The allocator setting is per process: this one's (the senders') is whatever the first variant chose.
        self.sender = TcpSender(LAYOUT, cache, streams=variant.streams, frame_bytes=variant.frame_bytes,
                                keep_freed_buffers=variant.keep_freed_buffers, keys=keys, seal=seal)
        self.conn = self.sender.connect(address)
        self.counter = 0
        self.checks = variant.checks

    def cpu_now(self) -> float:
        self.pipe.send("cpu")
        return time.process_time() + float(self.pipe.recv())

    def transfer(self, size: int) -> float:
        blocks = list(range(size // UNIT))
        self.counter += 1
        transfer_id = f"bench-{self.counter}"
        self.pipe.send((transfer_id, blocks))
        self.pipe.recv()
        global _unchecked
        _unchecked = not self.checks
        try:
            start = time.perf_counter()
            transfer = self.conn.begin(transfer_id, blocks, 30.0)
            transfer.send_layer(0, blocks)
            transfer.finish()
            return time.perf_counter() - start
        finally:
            _unchecked = False

    def close(self) -> None:
        self.sender.close()
        self.pipe.send(None)
        self.proc.join(timeout=10)


# --- pyzmq alone: the floor under any zmq transport ------------------------------------------

def zmq_floor_server(conn: Any) -> None:
    """Drop data frames; answer FINISH(count) with DONE once that many frames arrived."""
    allocator.keep_freed_buffers()  # as the transport's receiver does
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 0)
    conn.send(router.bind_to_random_port("tcp://127.0.0.1"))
    frames, waiting, want = 0, b"", 0
    while True:
        parts = router.recv_multipart(copy=False)
        kind = parts[1].bytes
        if kind == wire.DATA:
            frames += 1
        elif kind == wire.FINISH:
            waiting, want = parts[0].bytes, int(parts[2].bytes)
        elif kind == b"cpu":
            router.send_multipart([parts[0].bytes, struct.pack("<d", time.process_time())])
            continue
        elif kind == b"quit":
            return
        if waiting and frames >= want:
            router.send_multipart([waiting, wire.DONE])
            frames, waiting = frames - want, b""


class ZmqFloorClient:
    """The transport's framing on bare pyzmq DEALER sockets, zero-copy, nothing else."""

    def __init__(self, max_size: int, variant: Variant) -> None:
        pipe, child = mp.Pipe()
        self.proc = mp.get_context("spawn").Process(target=zmq_floor_server, args=(child,), daemon=True)
        self.proc.start()
        address = f"tcp://127.0.0.1:{pipe.recv()}"
        self.ctx = zmq.Context()
        self.sockets = []
        for _ in range(variant.streams + 1):  # a control socket, then the data streams
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.sockets.append(sock)
        self.control, self.data = self.sockets[0], self.sockets[1:]
        cache = torch.randn(max_size // 2).to(torch.float16)
        self.cache = memoryview(cache.numpy()).cast("B")
        self.frame_bytes = max(UNIT, variant.frame_bytes // UNIT * UNIT)
        self.header = bytes(wire.HEADER_SIZE)

    def cpu_now(self) -> float:
        self.control.send_multipart([b"cpu", b""])
        return time.process_time() + float(struct.unpack("<d", self.control.recv())[0])

    def transfer(self, size: int) -> float:
        start, frames = time.perf_counter(), 0
        for offset in range(0, size, self.frame_bytes):
            frame = self.cache[offset:min(size, offset + self.frame_bytes)]
            half = len(frame) // 2  # K and V parts, as the transport sends them
            ids = bytes(4 * (len(frame) // UNIT))
            self.data[frames % len(self.data)].send_multipart(
                [wire.DATA, self.header, b"bench", ids, frame[:half], frame[half:]], copy=False)
            frames += 1
        self.control.send_multipart([wire.FINISH, str(frames).encode()])
        if self.control.recv() != wire.DONE:
            raise RuntimeError("zmq floor receiver answered something else")
        return time.perf_counter() - start

    def close(self) -> None:
        self.control.send_multipart([b"quit", b""])
        self.proc.join(timeout=5)
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


Client = RawClient | TlsClient | TcpClient | ZmqFloorClient


def measure(clients: dict[str, Client], sizes: list[int], seconds: float,
            rounds: int = 4) -> dict[str, dict[int, Stats]]:
    """Alternate the clients in short rounds per size, so load from elsewhere hits them alike."""
    times: dict[str, dict[int, list[float]]] = {name: {size: [] for size in sizes} for name in clients}
    cpu: dict[str, dict[int, float]] = {name: {size: 0.0 for size in sizes} for name in clients}
    for size in sizes:
        for _ in range(rounds):
            for name, client in clients.items():
                cpu_start, count = client.cpu_now(), 0
                stop = time.monotonic() + seconds / rounds
                while time.monotonic() < stop or count < 2:
                    times[name][size].append(client.transfer(size))
                    count += 1
                cpu[name][size] += client.cpu_now() - cpu_start
    return {name: {size: Stats(size / statistics.median(times[name][size]) / 1e9,
                               percentile(times[name][size], 0.5) * 1e3, percentile(times[name][size], 0.99) * 1e3,
                               cpu[name][size] / (size * len(times[name][size]) / 2**30))
                   for size in sizes} for name in clients}


def table(rows: list[Row]) -> str:
    labels = list(rows[0].tcp) if rows else []
    head = ["batch", "raw socket GB/s"]
    for label in labels:
        head += [f"{label} GB/s", f"{label} / raw"]
    head += ["raw p50 / p99 ms", *(f"{label} p50 / p99 ms" for label in labels),
             "CPU s per GiB raw / " + " / ".join(labels)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in rows:
        cells = [human(row.size), f"{row.raw.gbps:.2f}"]
        for label in labels:
            cells += [f"{row.tcp[label].gbps:.2f}", f"{row.tcp[label].gbps / row.raw.gbps:.0%}"]
        cells.append(f"{row.raw.p50_ms:.2f} / {row.raw.p99_ms:.2f}")
        cells += [f"{row.tcp[label].p50_ms:.2f} / {row.tcp[label].p99_ms:.2f}" for label in labels]
        cells.append(" / ".join(f"{stats.cpu_s_per_gib:.2f}" for stats in (row.raw, *row.tcp.values())))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_variant(text: str, streams: int, frame_bytes: int) -> Variant:
    """`LABEL[:streams=N,frame=SIZE,alloc=keep|default,secure=0|1,seal=0|1,checks=on|off,floor=0|1]`, e.g. `f1m:frame=1M`; unset keys take
    --streams / --frame-bytes, and alloc=keep (the transport's allocator setting, allocator.py)."""
    label, _, options = text.partition(":")
    keep, secure, seal, checks, floor, tls = True, False, False, True, False, False
    for option in filter(None, options.split(",")):
        key, _, value = option.partition("=")
        if key == "streams":
            streams = int(value)
        elif key == "frame":
            frame_bytes = parse_size(value)
        elif key == "alloc" and value in ("keep", "default"):
            keep = value == "keep"
        elif key == "secure" and value in ("0", "1"):
            secure = value == "1"
        elif key == "seal" and value in ("0", "1"):
            seal = value == "1"
        elif key == "checks" and value in ("on", "off"):
            checks = value == "on"
        elif key == "floor" and value in ("0", "1"):
            floor = value == "1"
        elif key == "tls" and value in ("0", "1"):
            tls = value == "1"
        else:
            raise ValueError(f"unknown variant option {option!r} in {text!r} (streams=N, frame=SIZE, "
                             "alloc=keep|default, secure=0|1, seal=0|1, checks=on|off, floor=0|1, tls=0|1)")
    if not label or streams <= 0 or frame_bytes <= 0:
        raise ValueError(f"bad variant {text!r}: LABEL[:streams=N,frame=SIZE,alloc=keep|default,secure=0|1,seal=0|1,checks=on|off,floor=0|1,tls=0|1]")
    if secure and seal:
        raise ValueError(f"bad variant {text!r}: secure (CURVE) and seal both encrypt; choose one")
    if tls and (floor or secure or seal):
        raise ValueError(f"bad variant {text!r}: tls=1 is the TLS reference, not the transport: no other option")
    return Variant(label, streams, frame_bytes, keep, secure, seal, checks, floor, tls)


def tls_note(client: Client) -> str:
    return f" (REFERENCE: the raw socket inside TLS 1.3, {getattr(client, 'cipher', '?')}, not the transport)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M")
    parser.add_argument("--seconds", type=float, default=1.5, help="time spent per size and transport")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--frame-bytes", default="2M")
    parser.add_argument("--variant", action="append", default=[],
                        help="a tcp configuration to measure, LABEL[:streams=N,frame=SIZE,alloc=keep|default,secure=0|1,seal=0|1,checks=on|off,floor=0|1,tls=0|1]; repeat for an "
                             "A/B in one run (default: one, labelled tcp, from --streams and --frame-bytes)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="turns per size: raw and each variant alternate this many times within --seconds")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.rounds <= 0:
        parser.error("--rounds must be positive")
    if any(size < UNIT or size % UNIT for size in sizes):
        parser.error(f"every size must be a positive multiple of {UNIT} bytes (one block, K and V)")
    try:
        variants = [parse_variant(text, args.streams, parse_size(args.frame_bytes)) for text in args.variant or ["tcp"]]
    except ValueError as exc:
        parser.error(str(exc))
    if len({v.label for v in variants}) != len(variants):
        parser.error("variant labels must differ")
    clients: dict[str, Client] = {"raw": RawClient(max(sizes))}
    try:
        for v in variants:
            clients[v.label] = (TlsClient(max(sizes)) if v.tls else ZmqFloorClient(max(sizes), v) if v.floor
                                else TcpClient(max(sizes), v))
        results = measure(clients, sizes, args.seconds, args.rounds)
    finally:
        for client in clients.values():
            client.close()
    rows = [Row(size, results["raw"][size], {v.label: results[v.label][size] for v in variants}) for size in sizes]
    load = os.getloadavg()[0]
    described = ", ".join(f"{v.label} = {v.streams} streams, {human(v.frame_bytes)} frames"
                          f"{'' if v.keep_freed_buffers else ', default allocator'}"
                          f"{'' if v.checks else ', ABLATION: no payload digest, no copy into the cache'}"
                          f"{', FLOOR: pyzmq alone with this framing, not the transport' if v.floor else ''}"
                          f"{tls_note(clients[v.label]) if v.tls else ''}"
                          for v in variants)
    print(f"# {' '.join(sys.argv)}  (cpus: {os.cpu_count()}, load {load:.1f}; one run, raw and tcp "
          f"alternating per size; GB/s from the median transfer; {described})")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([{"size": row.size, "raw": asdict(row.raw),
                        "tcp": {label: {**asdict(stats), "ratio": stats.gbps / row.raw.gbps}
                                for label, stats in row.tcp.items()}} for row in rows], out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
