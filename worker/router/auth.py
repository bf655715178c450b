"""API keys for the router (`tandem router --api-key`, as vLLM's `--api-key`): `Authorization: Bearer <key>`.

Every route needs a valid key except the probes and metrics (OPEN_PATHS), so an unknown path answers
401, not 404, to a caller without a key. Several keys are valid at once (rotation: add the new key,
move clients, remove the old one). Keys come from --api-key, the TANDEM_API_KEY environment variable
(keys separated by whitespace) and --api-key-file (one key a line, re-read when the file changes, so a
mounted Secret rotates without a restart). Keys are compared as SHA-256 digests with
hmac.compare_digest against every key: the time taken says nothing about how much of a key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.worker.refusal_log import ThrottledLog
from tandem.worker.router.errors import APIError

log = logging.getLogger(__name__)

# The kubelet's probes and Prometheus carry no key. /workers belongs to the worker-control credential.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/workers"})
FILE_CHECK_S = 1.0  # how often --api-key-file's modification time is looked at (on requests)


def parse_keys(text: str) -> list[str]:
    """Keys in a file or variable: separated by whitespace (so one a line); lines starting with # are comments."""
    return [key for line in text.splitlines() if not line.lstrip().startswith("#") for key in line.split()]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


class ApiKeys:
    """The set of valid keys. Enabled when any key or a key file was given; then it stays enabled (a key
    file that becomes empty refuses everyone rather than opening the router)."""

    def __init__(self, keys: Iterable[str] = (), file: Path | None = None) -> None:
        self._given = [_digest(k) for k in keys if k]
        self.file = file
        self.enabled = bool(self._given) or file is not None
        self._from_file: list[bytes] = []
        self._file_mtime: float | None = None
        self._checked = 0.0
        if file is not None:
            self._load_file(os.stat(file).st_mtime)  # OSError (unreadable) is the caller's to report
            if not self._from_file and not self._given:
                raise ValueError(f"{file} holds no API key")

    def _load_file(self, mtime: float) -> None:
        assert self.file is not None
        self._from_file = [_digest(k) for k in parse_keys(self.file.read_text())]
        self._file_mtime = mtime
        log.info("loaded %d API key(s) from %s", len(self._from_file), self.file)

    def _refresh(self) -> None:
        now = time.monotonic()
        if self.file is None or now - self._checked < FILE_CHECK_S:
            return
        self._checked = now
        try:
            mtime = os.stat(self.file).st_mtime
            if mtime != self._file_mtime:
                self._load_file(mtime)
        except OSError as exc:  # a Secret's files are swapped by a symlink: a moment without one keeps the old keys
            log.warning("could not re-read the API key file %s (keeping its previous keys): %s", self.file, exc)

    def valid(self, presented: str) -> bool:
        self._refresh()
        digest = _digest(presented)
        ok = False
        for key in (*self._given, *self._from_file):  # every key, matched or not
            ok |= hmac.compare_digest(digest, key)
        return ok


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of `Authorization: Bearer <token>` (the scheme in any case), None when there is none."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def unauthorized(reason: str) -> APIError:
    message = ("no API key: send it as the header `Authorization: Bearer <key>`" if reason == "missing"
               else "the API key is not valid")
    return APIError(401, message, code="invalid_api_key", headers={"www-authenticate": "Bearer"})


class ApiKeyMiddleware:
    """Refuses with 401 (OpenAI's error shape) every HTTP request outside OPEN_PATHS without a valid key,
    before the route reads its body. `refused(reason)` counts it (reason missing|invalid)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, refused: Callable[[str], None]) -> None:
        self.app, self.keys, self.refused = app, keys, refused
        self._log = ThrottledLog(log)  # a flood of refusals logs one line per 10 s, with the count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        if token and self.keys.valid(token):
            await self.app(scope, receive, send)
            return
        reason = "missing" if token is None else "invalid"
        client = scope.get("client") or ("?", 0)
        self.refused(reason)
        # Never the key itself: a near-miss in the log is half a secret.
        self._log.warning("401 for %s %s from %s: %s API key", scope["method"], scope["path"], client[0], reason)
        await unauthorized(reason).response()(scope, receive, send)
