"""The model's KV transfer keypair (`kvTransfer.secure`), kept in the Secret `<name>-kv-keys`.

The reconcile reads the Secret and, only when it is missing, creates it with a fresh keypair.
It is never applied or patched afterwards: that would hand the workers new keys at every
reconcile. Deleting the Secret rotates the keys (the next reconcile creates a new pair, whose
fingerprint on the pod template rolls the pools). A Secret that exists but holds no usable pair
(say, written by hand) is reported, not replaced: replacing it would silently cut off whoever
else holds the old keys.

The keypair type and its rules (40 Z85 characters each, the public key derived from the secret
one) are tandem.worker.kv.keys.KVKeys, the same the worker loads (torch-free, like the layout hash).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from tandem.operator import builders
from tandem.operator.kube import Kube, KubeError
from tandem.worker.kv.keys import KVKeys


class InvalidKeys(ValueError):
    """The Secret exists but does not hold a usable keypair (the message names it and says what to do)."""


def from_secret(secret: Mapping[str, Any]) -> KVKeys:
    """The pair in a Secret as read from the API (base64 `data`); InvalidKeys naming the Secret otherwise."""
    name = (secret.get("metadata") or {}).get("name", "?")
    data = secret.get("data") or {}
    try:
        missing = [key for key in (builders.KV_PUBLIC_KEY, builders.KV_SECRET_KEY) if not data.get(key)]
        if missing:
            raise ValueError(f"no key {' or '.join(repr(k) for k in missing)}")
        try:
            public, private = (base64.b64decode(data[key], validate=True).strip()
                               for key in (builders.KV_PUBLIC_KEY, builders.KV_SECRET_KEY))
        except (binascii.Error, TypeError) as exc:
            raise ValueError(f"data is not base64: {exc}") from None
        return KVKeys(public, private)
    except ValueError as exc:
        raise InvalidKeys(f"Secret {name} does not hold a usable KV transfer keypair ({exc}); fix it, or delete "
                          "it and the operator creates a new one") from None


def ensure(kube: Kube, owner: builders.Owner) -> tuple[KVKeys, bool]:
    """The model's keypair, and whether it was created just now.

    Raises InvalidKeys for a Secret that holds no usable pair, KubeError when the API refuses.
    """
    name = builders.kv_keys_secret_name(owner)
    found = kube.get("v1", "Secret", owner.namespace, name)
    if found is not None:
        return from_secret(found), False
    keys = KVKeys.generate()
    try:
        kube.create(builders.kv_keys_secret(owner, keys))
    except KubeError as exc:
        if exc.status != 409:
            raise
        # Created meanwhile by someone else: theirs stands.
        found = kube.get("v1", "Secret", owner.namespace, name)
        if found is None:
            raise
        return from_secret(found), False
    return keys, True
