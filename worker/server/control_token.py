"""The worker control credential: a secret shared by a model's router and its workers.

Every worker route but /health, /ready and /metrics wants it (control_auth.py), and so does the
router's /workers listing. It travels in its own header, X-Tandem-Control-Token, not in
`Authorization`: that header belongs to the router's public edge (client API keys), and a
dedicated name can never be confused with, or forwarded as, a client's credential.

Why a bearer secret and not an HMAC over each request: the control port speaks plain HTTP, so
whoever can read its traffic reads the prompts and tokens too, and signing would not change
that; what the credential has to stop is anyone who can merely *reach* the port (a pod in the
cluster, a client that learnt a worker's address). A 256-bit random token compared in constant
time does that, costs nothing per call, and needs neither clock agreement nor buffering of
streamed bodies. Keeping the port's traffic from prying eyes is the network's job (the model's
NetworkPolicies; docs/security.md).

A token file holds one or more tokens, one per line (blank lines and `#` comments ignored): the
first is the one a router sends, any of them is accepted. Two lines let a credential be rotated
without a moment where the router and a worker disagree (docs/security.md, "Worker control").

Pure standard library: the operator (which creates the Secret) imports it without fastapi or torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

HEADER = "X-Tandem-Control-Token"
ENV_TOKEN = "TANDEM_CONTROL_TOKEN"  # the token itself (never on a command line: `ps` would show it)
ENV_TOKEN_FILE = "TANDEM_CONTROL_TOKEN_FILE"  # --control-token-file
# Routes anyone who reaches the port may call: probes and Prometheus, nothing that acts or tells secrets.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
MIN_LENGTH = 16  # a token shorter than this is a typo or a placeholder, not a secret
MAX_LENGTH = 4096


class ControlTokenError(ValueError):
    """A token file or value that cannot be used (the message never contains the token)."""


def generate() -> str:
    """A fresh token: 32 random bytes, URL-safe base64 (43 characters, fits any header)."""
    return secrets.token_urlsafe(32)


def parse(text: str, source: str) -> tuple[str, ...]:
    """The tokens in a token file's text (first = the one to send); ControlTokenError naming `source`."""
    tokens = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))
    if not tokens:
        raise ControlTokenError(f"{source} holds no control token")
    for i, token in enumerate(tokens, 1):
        if not MIN_LENGTH <= len(token) <= MAX_LENGTH:
            raise ControlTokenError(f"{source}: token {i} has {len(token)} characters; a control token has "
                                    f"{MIN_LENGTH} to {MAX_LENGTH} (generate one with `python -c 'import secrets; "
                                    f"print(secrets.token_urlsafe(32))'`)")
        if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
            raise ControlTokenError(f"{source}: token {i} is not printable ASCII without spaces (it goes in an "
                                    "HTTP header)")
    return tokens


def fingerprint(tokens: tuple[str, ...] | str) -> str:
    """A short public name for a set of tokens (on pod templates: a new Secret rolls the pods)."""
    text = tokens if isinstance(tokens, str) else "\n".join(tokens)
    return hashlib.sha256(b"tandem-control-token\0" + text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class ControlTokens:
    """The credential of one process: what it sends (the first token) and what it accepts (all)."""

    tokens: tuple[str, ...]
    source: str = ""  # where they came from, for the log
    _digests: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ControlTokenError("no control token")
        object.__setattr__(self, "_digests", tuple(_digest(t) for t in self.tokens))

    def __repr__(self) -> str:  # never print a token
        return f"ControlTokens({len(self.tokens)} token(s) from {self.source or '?'}, {fingerprint(self.tokens)})"

    @property
    def headers(self) -> dict[str, str]:
        """What a caller sends."""
        return {HEADER: self.tokens[0]}

    def check(self, presented: str | None) -> str | None:
        """None when `presented` is one of the tokens; else why not ("missing" or "invalid").

        Constant time in the token's content: both sides are hashed to the same length first and
        every accepted token is compared, so neither a matching prefix nor which token matched shows
        in the timing."""
        if not presented:
            return "missing"
        candidate = _digest(presented)
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(candidate, digest)
        return None if ok else "invalid"

    @staticmethod
    def from_file(path: str | Path) -> ControlTokens:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ControlTokenError(f"cannot read the control token file {path}: {exc}") from None
        return ControlTokens(parse(text, f"the control token file {path}"), str(path))


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def load(token_file: str | Path | None, environ: dict[str, str] | None = None) -> ControlTokens | None:
    """The process's credential: --control-token-file (or TANDEM_CONTROL_TOKEN_FILE, which click maps to it),
    else TANDEM_CONTROL_TOKEN; None when neither is set. ControlTokenError for an unusable one."""
    env = os.environ if environ is None else environ
    if token_file:
        return ControlTokens.from_file(token_file)
    value = env.get(ENV_TOKEN, "")
    if value.strip():
        return ControlTokens(parse(value, f"${ENV_TOKEN}"), f"${ENV_TOKEN}")
    return None


def write_private(path: Path, token: str) -> Path:
    """Write a token file readable by this user alone (0600, also when the file already existed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return path
