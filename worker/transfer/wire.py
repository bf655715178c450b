"""Wire format of the KV transfer: message kinds, the handshake, and data-frame headers.

Every zmq message starts with a one-byte kind. Control messages carry one JSON part.
A data frame (tcp) is six parts: kind, header, transfer id, destination block ids
(little-endian int32), K payload, V payload (K and V of the same blocks of one layer travel
together: half the frames, and each part still goes out zero-copy). The header holds sequence number, layer, K/V, block
count, byte count and a digest: a CRC32 over the header fields, transfer id and block ids,
plus two 64-bit sums over the payload (plain, and position-weighted per 4 KiB row). Any
flipped bit, truncation or reordered row is caught before anything touches the cache.
The payload sums run at memory speed, where CRC32 of the payload would cost about as much
CPU as the TCP copy itself (see docs/transfer.md).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tandem.worker.kv.layout import KVLayout

from .errors import LAYOUT_MISMATCH, VERSION_MISMATCH, TransferError

PROTOCOL_VERSION = 1

# Message kinds (first part of every message).
HELLO = b"H"  # sender -> receiver: versions, layout hash, session id
WELCOME = b"W"  # receiver -> sender: accepted (with the receiver's pool size)
REFUSE = b"R"  # receiver -> sender: refused, with the reason
ATTACH = b"A"  # sender -> receiver, on every extra stream: which session it belongs to
BEGIN = b"B"  # sender -> receiver: start transfer_id into these destination blocks
DATA = b"D"  # sender -> receiver: one frame of blocks
ACK = b"K"  # receiver -> sender: a frame was verified and written
FINISH = b"F"  # sender -> receiver: everything was sent
DONE = b"d"  # receiver -> sender: every expected block arrived and verified
ABORT = b"X"  # sender -> receiver: the sender gave up
FAILED = b"E"  # receiver -> sender: the transfer failed on the receiving side

K, V, KV = 0, 1, 2  # a tcp frame carries K and V of the same blocks (KV); rdma pieces are K or V

_HEADER = struct.Struct("<QIBIQQQI")  # seq, layer, kind, block_count, byte_count, digest (sum, wsum, crc)
HEADER_SIZE = _HEADER.size
_UNCHECKED = struct.Struct("<QIBIQ")  # the header fields the crc covers
_ROW_BYTES = 4096  # payload rows of the position-weighted sum
_MASK64 = (1 << 64) - 1
_CHUNK_BYTES = 1 << 17  # 16384 int64 words: under torch's grain size (32768), so it stays on one thread


def encode_control(kind: bytes, payload: dict[str, Any]) -> list[bytes]:
    return [kind, json.dumps(payload, separators=(",", ":")).encode()]


def decode_control(part: bytes | memoryview) -> dict[str, Any]:
    """Parse a control message body; a malformed one raises ValueError."""
    try:
        value = json.loads(bytes(part))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed control message: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("malformed control message: not a JSON object")
    return value


# --- handshake -----------------------------------------------------------------------------

def hello(layout: KVLayout, layout_tag: str | None, session: str, transport: str,
          extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"protocol": PROTOCOL_VERSION, "layout_hash": layout.layout_hash(), "layout_tag": layout_tag,
            "layout": asdict(layout), "session": session, "transport": transport, **(extra or {})}


def check_hello(layout: KVLayout, layout_tag: str | None, transport: str,
                peer: dict[str, Any]) -> TransferError | None:
    """Return why the receiver must refuse this peer's HELLO, or None to accept it."""
    version = peer.get("protocol")
    if version != PROTOCOL_VERSION:
        return TransferError(VERSION_MISMATCH, f"KV transfer protocol mismatch: this receiver speaks "
                             f"version {PROTOCOL_VERSION}, the sender speaks version {version}")
    if peer.get("transport") != transport:
        return TransferError(VERSION_MISMATCH, f"transport mismatch: this receiver is {transport}, "
                             f"the sender is {peer.get('transport')}")
    mine, theirs = layout.layout_hash(), peer.get("layout_hash")
    if theirs != mine:
        return TransferError(LAYOUT_MISMATCH, f"KV layout mismatch: receiver layout hash {mine} "
                             f"({describe(layout)}) != sender layout hash {theirs} "
                             f"({_describe_dict(peer.get('layout'))})")
    peer_tag = peer.get("layout_tag")
    if layout_tag is not None and peer_tag is not None and peer_tag != layout_tag:
        return TransferError(LAYOUT_MISMATCH, f"KV layout tag mismatch: receiver layout tag {layout_tag!r} "
                             f"!= sender layout tag {peer_tag!r} (both have layout hash {mine})")
    return None


def describe(layout: KVLayout) -> str:
    return _describe_dict(asdict(layout))


def _describe_dict(fields: object) -> str:
    if not isinstance(fields, dict):
        return "layout not sent"
    return ", ".join(f"{key}={value}" for key, value in sorted(fields.items()))


# --- data frames ---------------------------------------------------------------------------

Digest = tuple[int, int, int]  # (payload sum, payload weighted sum, crc32 of header fields + ids + tail)


@dataclass(frozen=True)
class FrameHeader:
    seq: int
    layer: int
    kind: int  # K or V
    block_count: int
    byte_count: int
    digest: Digest


def payload_sums(payload: bytes | bytearray | memoryview) -> tuple[int, int, memoryview]:
    """Two wrapping 64-bit sums over the payload's whole 4 KiB rows; also returns the leftover tail."""
    view = memoryview(payload).cast("B")
    body = len(view) - len(view) % _ROW_BYTES
    if body == 0:
        return 0, 0, view
    source = view if not view.readonly else memoryview(bytearray(view[:body]))
    rows = torch.empty(body // _ROW_BYTES, dtype=torch.int64)
    words = torch.frombuffer(source, dtype=torch.int64, count=body // 8).view(-1, _ROW_BYTES // 8)
    # Chunks small enough that torch stays on this thread: its intra-op pool busy-waits, and
    # on a small machine those spinning threads starve the sockets (measured: 10x slower).
    step = _CHUNK_BYTES // _ROW_BYTES
    for first in range(0, rows.numel(), step):
        torch.sum(words[first:first + step], 1, out=rows[first:first + step])
    weights = torch.arange(1, 2 * rows.numel(), 2, dtype=torch.int64)
    return int(rows.sum()) & _MASK64, int((rows * weights).sum()) & _MASK64, view[body:]


def frame_digest(seq: int, layer: int, kind: int, block_count: int, byte_count: int, transfer_id: bytes,
                 block_ids: bytes | memoryview, *payloads: bytes | bytearray | memoryview) -> Digest:
    """Digest of a frame; several payload parts (K then V) are weighted by their order."""
    crc = zlib.crc32(_UNCHECKED.pack(seq, layer, kind, block_count, byte_count))
    crc = zlib.crc32(transfer_id, crc)
    crc = zlib.crc32(block_ids, crc)
    plain = weighted = 0
    for index, payload in enumerate(payloads):
        part_plain, part_weighted, tail = payload_sums(payload)
        plain = (plain + (2 * index + 1) * part_plain) & _MASK64
        weighted = (weighted + (2 * index + 1) * part_weighted) & _MASK64
        crc = zlib.crc32(tail, crc)
    return plain, weighted, crc


def pack_header(seq: int, layer: int, kind: int, block_count: int, byte_count: int, digest: Digest) -> bytes:
    return _HEADER.pack(seq, layer, kind, block_count, byte_count, *digest)


def unpack_header(part: bytes | memoryview) -> FrameHeader:
    """Parse a data-frame header; a header of the wrong size raises ValueError."""
    if len(part) != HEADER_SIZE:
        raise ValueError(f"frame header is {len(part)} bytes, expected {HEADER_SIZE}")
    seq, layer, kind, count, nbytes, plain, weighted, crc = _HEADER.unpack(part)
    return FrameHeader(seq, layer, kind, count, nbytes, (plain, weighted, crc))
