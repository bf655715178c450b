"""The model's KV transfer keypair (`kvTransfer.secure`, `tandem worker --kv-keys`).

A CURVE keypair, Z85-encoded, kept as two files `public` and `secret` (the keys of the operator's
Secret `<name>-kv-keys`). Shared by the worker (worker/transfer/security.py puts it on the zmq
sockets) and the operator (operator/kv_keys.py creates and checks the Secret), so it needs only
pyzmq: no torch here.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq

PUBLIC_FILE, SECRET_FILE = "public", "secret"  # also the keys of the operator's Secret


class KVKeysError(ValueError):
    """A key folder is missing, unreadable or inconsistent."""


@dataclass(frozen=True)
class KVKeys:
    """A CURVE keypair, Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes

    def __post_init__(self) -> None:
        for name, key in (("public", self.public), ("secret", self.secret)):
            if len(key) != 40:
                raise KVKeysError(f"the {name} key must be 40 Z85 characters, got {len(key)}")
        try:
            derived = zmq.curve_public(self.secret)
        except (ValueError, zmq.ZMQError) as exc:
            raise KVKeysError(f"the secret key is not valid Z85: {exc}") from exc
        if derived != self.public:
            raise KVKeysError("the public key does not belong to the secret key")

    def __repr__(self) -> str:  # never print the secret
        return f"KVKeys(public={self.public.decode()!r})"

    @staticmethod
    def generate() -> KVKeys:
        public, secret = zmq.curve_keypair()
        return KVKeys(public, secret)

    @staticmethod
    def load(folder: str | Path) -> KVKeys:
        """Read `public` and `secret` from a folder (a mounted Secret, or `tandem kv-keys` output)."""
        folder = Path(folder)
        try:
            public = (folder / PUBLIC_FILE).read_bytes().strip()
            secret = (folder / SECRET_FILE).read_bytes().strip()
        except OSError as exc:
            raise KVKeysError(f"cannot read the KV transfer keys in {folder}: {exc}") from exc
        try:
            return KVKeys(public, secret)
        except KVKeysError as exc:
            raise KVKeysError(f"bad KV transfer keys in {folder}: {exc}") from exc

    def save(self, folder: str | Path) -> None:
        """Write the pair; the secret file is created 0600."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / PUBLIC_FILE).write_bytes(self.public + b"\n")
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".secret-")
        with os.fdopen(fd, "wb") as out:  # mkstemp creates it 0600
            out.write(self.secret + b"\n")
        os.replace(tmp, folder / SECRET_FILE)
