"""Sealed KV transfer: every session authenticated, tcp frames encrypted with AES-256-GCM.

Used by the tcp transport (sessions and frames) and the rdma transport (sessions only: RC WRITEs carry
the payload unencrypted); the default whenever a worker holds a control token (server/config.py).
Measured against plain tcp and CURVE in hack/bench_transfer.py (docs/benchmarks.md, "KV transfer").

Why not CURVE (security.py): libzmq's CURVE boxes every message with XSalsa20-Poly1305 in its own
I/O thread and costs 2.5-3x in throughput here. AES-GCM runs on the CPU's AES instructions (about
5 GB/s per core here, with the GIL released), and it replaces the XXH3 frame digest, whose job the
GCM tag does.

The credential is the model's worker control token (server/control_token.py), which only the router
and the model's workers hold, so sealing needs no key of its own and rotates with the token.

Handshake (one per connection, inside HELLO and WELCOME; suite SUITE):
- the sender makes an ephemeral X25519 key and sends its public half with
  HMAC-SHA256(secret, "hello" | session | eph_s): the receiver checks it against each token it
  accepts before it allocates anything or sends anything back but a refusal;
- the receiver answers with its own ephemeral public key, HMAC(secret, "welcome" | session | eph_s |
  eph_r), and the transport's WELCOME fields encrypted;
- both derive two keys, HKDF-SHA256(X25519(eph_s, eph_r), salt=secret, info=transcript): one for
  what the sender sends, one for what the receiver sends back. Fresh keys per connection (forward
  secrecy: a token leaked later does not open recorded sessions), and only token holders can derive
  them.
After the handshake every message the sender sends is sealed under the first key with a nonce that
is never reused (an 8-byte counter per connection, carried in the message): control bodies, ATTACH,
and a tcp frame's K and V parts, whose header, transfer id and block ids are the associated data.
Replies (ACK, DONE, FAILED) are not sealed: they carry no secrets, and only the receiver the sender
connected to can send on that connection.

Replay: the opener accepts each counter once (ReplayWindow), so a sealed message copied off the wire
and sent again inside its session is refused; another session has other keys, where it does not open.
The window is wide (WINDOW counters) because a session's streams are separate connections and their
messages reach the receiver interleaved, not in counter order.

A peer that does not seal at all is told apart from one that seals with a wrong token (SealMismatch,
counted version_mismatch, not auth_failed): the first is a rollout from a release before sealing or a
worker started with another --kv-encryption; the second is someone without the model's token.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SUITE = "x25519-hkdf-sha256-aes256gcm"
TAG_BYTES = 16  # AES-GCM tag, appended to every sealed part
COUNTER = struct.Struct("<Q")
K_PART, V_PART, CONTROL_PART = 0, 1, 2  # the nonce's part byte
_FORGED = "a sealed part failed authentication (damaged, forged, or sealed with another key)"
_KEY_LABEL = b"tandem-kv-seal-v1"


class SealError(ValueError):
    """A handshake field or sealed message that does not check out (wrong key, damaged, forged, replayed)."""


class SealMismatch(SealError):
    """The peer does not seal at all (a release before sealing, or --kv-encryption none): a configuration
    or rollout mismatch, not a failed authentication."""


WINDOW = 1 << 16  # counters a message may lag the newest one opened (interleaved streams) and still open
_WINDOW_MASK = (1 << WINDOW) - 1


class ReplayWindow:
    """Which counters were already opened: each is accepted once (the sliding window of RFC 4303, 3.4.3).

    `newest` is the highest counter accepted; bit i of `_seen` says whether newest - i was. A counter
    more than WINDOW behind the newest is refused too: it can no longer be told from a replay.
    """

    def __init__(self) -> None:
        self.newest = -1
        self._seen = 0
        self._lock = threading.Lock()

    def accept(self, counter: int) -> None:
        """Record `counter` (of a message that authenticated); SealError when it was seen or is too old."""
        with self._lock:
            if counter > self.newest:
                shift = counter - self.newest
                self._seen = ((self._seen << shift) | 1) & _WINDOW_MASK if shift < WINDOW else 1
                self.newest = counter
                return
            lag = self.newest - counter
            if lag >= WINDOW:
                raise SealError(f"a sealed message with counter {counter} arrived {lag} behind the newest "
                                f"(window {WINDOW}): refused as a possible replay")
            if self._seen >> lag & 1:
                raise SealError(f"a sealed message with counter {counter} was already received: a replay")
            self._seen |= 1 << lag


@dataclass(frozen=True)
class SealSecrets:
    """The model's sealing secrets: one per control token; the first is presented, all are accepted."""

    secrets: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not self.secrets:
            raise ValueError("sealing needs at least one secret")

    def __repr__(self) -> str:  # never print a secret
        return f"SealSecrets({len(self.secrets)} secret(s))"

    @staticmethod
    def from_tokens(tokens: Sequence[str]) -> SealSecrets:
        """Derived, not the tokens themselves: a sealing secret opens no control route, and back."""
        return SealSecrets(tuple(hmac.new(_KEY_LABEL, token.encode("utf-8", "surrogateescape"),
                                          hashlib.sha256).digest() for token in tokens))


def _mac(secret: bytes, *parts: bytes) -> bytes:
    state = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        state.update(COUNTER.pack(len(part)))
        state.update(part)
    return state.digest()


def _public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def _hex_field(fields: object, name: str, size: int) -> bytes:
    value = fields.get(name) if isinstance(fields, dict) else None
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise SealError(f"sealed handshake field {name!r} is missing or malformed")
    return raw


def _derive(secret: bytes, shared: bytes, session: bytes, eph_s: bytes, eph_r: bytes) -> tuple[bytes, bytes]:
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=secret,
               info=b"tandem-kv keys|" + session + b"|" + eph_s + eph_r).derive(shared)
    return okm[:32], okm[32:]


class SessionCipher:
    """One direction of a session: AES-256-GCM under a key of its own, with nonces that never repeat.

    nonce = direction (3 bytes) | part (1 byte: K, V or control) | counter (8 bytes). The counter is
    per session and direction; a tcp frame takes one value for both its parts, which the part byte
    tells apart.
    """

    def __init__(self, key: bytes, direction: bytes) -> None:
        self._aead = AESGCM(key)
        self._direction = direction
        self._counter = itertools.count()  # next() on a count is atomic under the GIL: any thread may call
        self.replay = ReplayWindow()  # what the other side sent under this key: each counter opens once

    def next_counter(self) -> int:
        return next(self._counter)

    def _nonce(self, counter: int, part: int) -> bytes:
        return self._direction + bytes((part,)) + COUNTER.pack(counter)

    def seal(self, counter: int, part: int, data: bytes | memoryview, aad: bytes) -> bytes:
        return self._aead.encrypt(self._nonce(counter, part), data, aad)

    def open_into(self, counter: int, part: int, data: bytes | memoryview, aad: bytes, out: memoryview) -> None:
        """Decrypt one part of a frame. A frame's K and V share a counter: the caller accepts it in
        `replay` once both opened (a forged part must not move the window)."""
        try:
            self._aead.decrypt_into(self._nonce(counter, part), data, aad, out)
        except InvalidTag:
            raise SealError(_FORGED) from None

    # Control bodies travel as counter (8 bytes) | ciphertext | tag; the message kind is associated data.
    def seal_body(self, kind: bytes, body: bytes) -> bytes:
        counter = next(self._counter)
        return COUNTER.pack(counter) + self.seal(counter, CONTROL_PART, body, b"control|" + kind)

    def open_body(self, kind: bytes, sealed: bytes | memoryview) -> bytes:
        if len(sealed) < COUNTER.size + TAG_BYTES:
            raise SealError("sealed control message too short")
        (counter,) = COUNTER.unpack_from(sealed)
        try:
            plain = self._aead.decrypt(self._nonce(counter, CONTROL_PART), memoryview(sealed)[COUNTER.size:],
                                       b"control|" + kind)
        except InvalidTag:
            raise SealError(_FORGED) from None
        self.replay.accept(counter)
        return plain


_SENDER, _RECEIVER = b"kv>", b"kv<"  # nonce prefixes of the two directions


@dataclass
class SenderHandshake:
    """The sender's half: HELLO fields now, keys from the WELCOME."""

    secrets: SealSecrets
    session: str
    _key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)

    def hello_fields(self) -> dict[str, object]:
        eph = _public(self._key)
        mac = _mac(self.secrets.secrets[0], b"hello", self.session.encode(), eph)
        return {"seal": {"suite": SUITE, "eph": eph.hex(), "mac": mac.hex()}}

    def complete(self, welcome: dict[str, object]) -> tuple[SessionCipher, SessionCipher, dict[str, object]]:
        """Check the receiver's WELCOME; return (cipher for what this side sends, opener for the replies,
        the transport's sealed WELCOME fields). SealError when the receiver does not hold the token."""
        fields = welcome.get("seal")
        if not isinstance(fields, dict):
            raise SealMismatch("the receiver's WELCOME is not sealed (it runs with --kv-encryption none, or is "
                               "a release before sealing): this sender seals KV")
        eph_s, eph_r = _public(self._key), _hex_field(fields, "eph", 32)
        secret, session = self.secrets.secrets[0], self.session.encode()
        if not hmac.compare_digest(_hex_field(fields, "mac", 32), _mac(secret, b"welcome", session, eph_s, eph_r)):
            raise SealError("the receiver's WELCOME is not signed with this model's control token")
        shared = self._key.exchange(X25519PublicKey.from_public_bytes(eph_r))
        send_key, reply_key = _derive(secret, shared, session, eph_s, eph_r)
        sender, opener = SessionCipher(send_key, _SENDER), SessionCipher(reply_key, _RECEIVER)
        extra = _decode_box(opener, fields.get("box"))
        return sender, opener, extra


def _decode_box(opener: SessionCipher, box: object) -> dict[str, object]:
    if not isinstance(box, str):
        raise SealError("the sealed WELCOME carries no box")
    try:
        plain = opener.open_body(b"welcome", bytes.fromhex(box))
        value = json.loads(plain)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SealError(f"the sealed WELCOME box does not open: {exc}") from None
    if not isinstance(value, dict):
        raise SealError("the sealed WELCOME box is not a JSON object")
    return value


@dataclass
class ReceiverSession:
    """The receiver's half for one accepted HELLO: its WELCOME fields and the opener for the session."""

    opener: SessionCipher  # opens what the sender sends
    replier: SessionCipher  # seals the WELCOME box
    fields: dict[str, object]


def accept_hello(secrets: SealSecrets, session: str, hello: dict[str, object]) -> ReceiverSession:
    """Check a HELLO's seal against every accepted secret; SealError when none matches (or it has none)."""
    fields = hello.get("seal")
    if not isinstance(fields, dict):
        raise SealMismatch("the sender does not seal KV (it runs with --kv-encryption none, without a control "
                           "token, or is a release before sealing): this receiver accepts sealed transfers only")
    if fields.get("suite") != SUITE:
        raise SealError(f"unknown sealing suite {fields.get('suite')!r}; this receiver speaks {SUITE}")
    eph_s, mac = _hex_field(fields, "eph", 32), _hex_field(fields, "mac", 32)
    session_bytes = session.encode()
    matched = None
    for secret in secrets.secrets:  # every one compared: which token matched does not show in the timing
        if hmac.compare_digest(mac, _mac(secret, b"hello", session_bytes, eph_s)) and matched is None:
            matched = secret
    if matched is None:
        raise SealError("the sender's HELLO is not signed with this model's control token")
    key = X25519PrivateKey.generate()
    eph_r = _public(key)
    shared = key.exchange(X25519PublicKey.from_public_bytes(eph_s))
    send_key, reply_key = _derive(matched, shared, session_bytes, eph_s, eph_r)
    welcome: dict[str, object] = {"suite": SUITE, "eph": eph_r.hex(), "mac": _mac(matched, b"welcome", session_bytes, eph_s, eph_r).hex()}
    return ReceiverSession(SessionCipher(send_key, _SENDER), SessionCipher(reply_key, _RECEIVER), welcome)


def seal_welcome(session: ReceiverSession, extra: dict[str, object]) -> dict[str, object]:
    """WELCOME's `seal` field: the handshake answer plus the transport's fields, encrypted."""
    box = session.replier.seal_body(b"welcome", json.dumps(extra, separators=(",", ":")).encode())
    return {"seal": {**session.fields, "box": box.hex()}}
