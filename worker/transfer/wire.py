"""Wire format of the KV transfer: message kinds, the handshake, data-frame headers, prompt digests.

Every zmq message starts with a one-byte kind. Control messages carry one JSON part.
A data frame (tcp) is six parts: kind, header, transfer id, destination block ids
(little-endian int32), K payload, V payload (K and V of the same blocks of one layer travel
together: half the frames, and each part still goes out zero-copy). The header holds sequence
number, layer, K/V, flags (ACK_ME: the sender wants this frame acknowledged), block count, byte
count and a digest: XXH3-128 over the header fields,
transfer id, block ids and every payload part, each length-prefixed. Any flipped bit,
truncation or reordered row is caught before anything touches the cache. XXH3 runs at about
30 GB/s per core here (native, and it releases the GIL), where CRC32 of the payload costs about
as much CPU as the TCP copy itself (see docs/transfer.md).

BEGIN carries the prompt digest (`prompt_digest()`: BLAKE2b-256 of the token ids the sender's KV was
computed from). The receiver only records it; the decode worker compares it with its request's prompt
before it uses the blocks or registers them in its prefix cache (issue 18: the caller of /decode names
the prompt, and must not be able to file one prompt's KV under another's tokens).
"""

from __future__ import annotations

import array
import hashlib
import json
import struct
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, NamedTuple

import xxhash

from tandem.worker.kv.layout import KVLayout

from .errors import LAYOUT_MISMATCH, VERSION_MISMATCH, TransferError

# 5: BEGIN carries the prompt digest, and a transfer completes only once its BEGIN arrived; 4: rdma receivers
# answer BEGIN with a "begun" ACK (seq 2**64-1) before WRITEs; 3: acknowledgements only on request (header
# flags); 2: XXH3-128 digest; 1: CRC32
PROTOCOL_VERSION = 5
PROMPT_DIGEST_SINCE = 5  # senders older than this bind no prompt to their KV: refused at the handshake

# Message kinds (first part of every message).
HELLO = b"H"  # sender -> receiver: versions, layout hash, session id
WELCOME = b"W"  # receiver -> sender: accepted (with the receiver's pool size)
REFUSE = b"R"  # receiver -> sender: refused, with the reason
ATTACH = b"A"  # sender -> receiver, on every extra stream: which session it belongs to
BEGIN = b"B"  # sender -> receiver: start transfer_id into these destination blocks
DATA = b"D"  # sender -> receiver: one frame of blocks
ACK = b"K"  # receiver -> sender: a frame flagged ACK_ME was verified and written (backpressure credit)
FINISH = b"F"  # sender -> receiver: everything was sent
DONE = b"d"  # receiver -> sender: every expected block arrived and verified
ABORT = b"X"  # sender -> receiver: the sender gave up
FAILED = b"E"  # receiver -> sender: the transfer failed on the receiving side

K, V, KV = 0, 1, 2  # a tcp frame carries K and V of the same blocks (KV); rdma pieces are K or V
ACK_ME = 1  # header flag: acknowledge this frame once written (the sender's window is filling up)

# seq, layer, kind, flags, block_count, byte_count, digest (high, low 64 bits)
_HEADER = struct.Struct("<QIBBIQQQ")
HEADER_SIZE = _HEADER.size
_FIELDS = struct.Struct("<QIBBIQ")  # the header fields the digest covers
_LENGTH = struct.Struct("<Q")  # length prefix of each digested part: part boundaries are unambiguous
_MASK64 = (1 << 64) - 1


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
        older = isinstance(version, int) and not isinstance(version, bool) and version < PROMPT_DIGEST_SINCE
        why = (f" (a sender before version {PROMPT_DIGEST_SINCE} does not say which prompt its KV was computed "
               "from, so this receiver neither uses nor caches KV from it: decode prefills locally until both "
               "sides are upgraded)") if older else ""
        return TransferError(VERSION_MISMATCH, f"KV transfer protocol mismatch: this receiver speaks "
                             f"version {PROTOCOL_VERSION}, the sender speaks version {version}{why}")
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


# --- prompt digests ------------------------------------------------------------------------

PROMPT_DIGEST_BYTES = 32
_PROMPT_PERSON = b"tandem-kv-prompt"  # BLAKE2b personalisation: these digests mean nothing elsewhere


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """BLAKE2b-256 of a prompt's token ids: the count (8 bytes) then each id as a little-endian int64.

    Cryptographic on purpose: the tokens are chosen by callers, and with a weak hash one could pick a
    prompt B whose digest equals prompt A's and so have A's KV filed under B's tokens. Raises ValueError
    for ids that are not integers within int64 (no valid prompt has them).
    """
    try:
        ids = array.array("q", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"prompt token ids must be integers within int64: {exc}") from None
    if sys.byteorder != "little":
        ids.byteswap()
    state = hashlib.blake2b(digest_size=PROMPT_DIGEST_BYTES, person=_PROMPT_PERSON)
    state.update(struct.pack("<Q", len(ids)))
    state.update(ids.tobytes())
    return state.digest()


def encode_prompt_digest(digest: bytes | None) -> dict[str, Any]:
    """BEGIN's prompt_digest field (hex), or nothing when the sender binds no prompt."""
    if digest is None:
        return {}
    if not isinstance(digest, bytes) or len(digest) != PROMPT_DIGEST_BYTES:
        raise ValueError(f"prompt_digest must be {PROMPT_DIGEST_BYTES} bytes (wire.prompt_digest()), got {digest!r}")
    return {"prompt_digest": digest.hex()}


def decode_prompt_digest(msg: dict[str, Any]) -> bytes | None:
    """The prompt digest a BEGIN carries (None when it carries none); a malformed one raises ValueError."""
    value = msg.get("prompt_digest")
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 2 * PROMPT_DIGEST_BYTES:
        raise ValueError(f"malformed prompt digest in BEGIN: expected {2 * PROMPT_DIGEST_BYTES} hex digits")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError("malformed prompt digest in BEGIN: not hex") from None


# --- data frames ---------------------------------------------------------------------------

Digest = tuple[int, int]  # XXH3-128 of the frame: (high 64 bits, low 64 bits)


class FrameHeader(NamedTuple):  # a NamedTuple: built per frame, and cheaper than a dataclass
    seq: int
    layer: int
    kind: int  # K, V or KV
    block_count: int
    byte_count: int
    digest: Digest
    flags: int = 0  # ACK_ME


def frame_digest(seq: int, layer: int, kind: int, block_count: int, byte_count: int, transfer_id: bytes,
                 block_ids: bytes | memoryview, *payloads: bytes | bytearray | memoryview, flags: int = 0) -> Digest:
    """Digest of a frame: header fields, transfer id, block ids, then each payload part (K then V)."""
    state = xxhash.xxh3_128(_FIELDS.pack(seq, layer, kind, flags, block_count, byte_count))
    for part in (transfer_id, block_ids, *payloads):
        view = memoryview(part).cast("B")
        state.update(_LENGTH.pack(len(view)))
        state.update(view)  # native, GIL released for large parts: the other I/O threads keep going
    value = state.intdigest()
    return value >> 64, value & _MASK64


def sealed_aad(header: bytes | memoryview, transfer_id: bytes, block_ids: bytes | memoryview) -> bytes:
    """What a sealed frame's K and V tags also cover (sealing.py): its header, transfer id and block ids."""
    return b"".join(_LENGTH.pack(len(part)) + bytes(part) for part in (header, transfer_id, block_ids))


def pack_header(seq: int, layer: int, kind: int, block_count: int, byte_count: int, digest: Digest,
                flags: int = 0) -> bytes:
    return _HEADER.pack(seq, layer, kind, flags, block_count, byte_count, *digest)


def unpack_header(part: bytes | memoryview) -> FrameHeader:
    """Parse a data-frame header; a header of the wrong size raises ValueError."""
    if len(part) != HEADER_SIZE:
        raise ValueError(f"frame header is {len(part)} bytes, expected {HEADER_SIZE}")
    seq, layer, kind, flags, count, nbytes, high, low = _HEADER.unpack(part)
    return FrameHeader(seq, layer, kind, count, nbytes, (high, low), flags)
