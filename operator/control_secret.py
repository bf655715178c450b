"""The model's worker control token, kept in the Secret `<name>-control-token` (every model has one).

Its router and workers mount it and send or check it on every control call (docs/security.md,
"Worker control"). Handled like the KV keys Secret (kv_keys.py): the reconcile reads it and, only
when it is missing, creates it with a fresh token; it is never applied or patched afterwards, or
every reconcile would hand out a new token. Deleting the Secret rotates the token (the next
reconcile creates a new one, whose fingerprint on the pod templates rolls the pools and the router).
A Secret that exists but holds no usable token (say, written by hand) is reported, not replaced.

The token rules (tandem.worker.server.control_token) are the ones the worker applies to the file.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from tandem.operator import builders
from tandem.operator.kube import Kube, KubeError
from tandem.worker.server import control_token


class InvalidToken(ValueError):
    """The Secret exists but holds no usable token (the message names it and says what to do, never the token)."""


def from_secret(secret: Mapping[str, Any]) -> tuple[str, ...]:
    """The tokens in a Secret as read from the API (base64 `data`); InvalidToken naming the Secret otherwise."""
    name = (secret.get("metadata") or {}).get("name", "?")
    raw = (secret.get("data") or {}).get(builders.CONTROL_TOKEN_KEY)
    try:
        if not raw:
            raise ValueError(f"no key {builders.CONTROL_TOKEN_KEY!r}")
        try:
            text = base64.b64decode(raw, validate=True).decode()
        except (binascii.Error, TypeError, UnicodeDecodeError) as exc:
            raise ValueError(f"data is not base64 of UTF-8 text: {exc}") from None
        return control_token.parse(text, f"key {builders.CONTROL_TOKEN_KEY!r}")
    except ValueError as exc:
        raise InvalidToken(f"Secret {name} does not hold a usable worker control token ({exc}); fix it, or delete "
                           "it and the operator creates a new one") from None


def ensure(kube: Kube, owner: builders.Owner) -> tuple[tuple[str, ...], bool]:
    """The model's tokens, and whether the Secret was created just now.

    Raises InvalidToken for a Secret that holds no usable token, KubeError when the API refuses.
    """
    name = builders.control_token_secret_name(owner)
    found = kube.get("v1", "Secret", owner.namespace, name)
    if found is not None:
        return from_secret(found), False
    token = control_token.generate()
    try:
        kube.create(builders.control_token_secret(owner, token))
    except KubeError as exc:
        if exc.status != 409:
            raise
        found = kube.get("v1", "Secret", owner.namespace, name)  # created meanwhile by someone else: theirs stands
        if found is None:
            raise
        return from_secret(found), False
    return (token,), True
