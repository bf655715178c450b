"""spec.router.apiKeySecret: a fingerprint of the router's API keys on its pod template, so new keys roll it.

The router reads its keys from $TANDEM_API_KEY (a secretKeyRef to the Secret), and a container's environment
is fixed when it starts: without a change to the pod template, an edited Secret reached no router until
something restarted it. The reconcile reads the Secret (it already holds `get` on Secrets for the control
token, control_secret.py) and puts a fingerprint of the key's value on the router pod template as
`tandem.dev/api-key-fingerprint` (builders.API_KEY_FINGERPRINT_ANNOTATION): a new value changes the
template, and the Deployment rolls the routers onto it, one surge pod at a time, as it does for a new
control token. The operator never writes this Secret.

The fingerprint is an HMAC-SHA256 of the value keyed with the Secret's uid, not a plain hash: API keys are
chosen by people and may be guessable, and the pod template is readable by more people than the Secret is; a
plain hash there would let any of them check guesses offline. A uid is no secret by design, but the API
shows a Secret's uid only to those allowed to read the Secret (whose value they can read anyway), and
nothing this operator writes carries it. A Secret deleted and created again gets a new uid, so that rolls
the routers too.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from tandem.operator.api import SecretKeyRef
from tandem.operator.kube import Kube

ABSENT = "absent"  # the Secret, or its key, does not exist (yet): the router pods cannot start until it does


def fingerprint(value: bytes, secret_uid: str) -> str:
    """12 hex digits that change with the value and reveal nothing checkable about it without the uid."""
    return hmac.new(secret_uid.encode(), b"tandem api-key fingerprint\0" + value, hashlib.sha256).hexdigest()[:12]


def read_fingerprint(kube: Kube, namespace: str, ref: SecretKeyRef) -> str:
    """The fingerprint of the referenced key as the API holds it now, or ABSENT.

    Raises KubeError when the API refuses (the caller applies nothing then, so a failed read never rolls the
    routers by dropping the annotation)."""
    secret = kube.get("v1", "Secret", namespace, ref.name)
    if secret is None:
        return ABSENT
    raw = (secret.get("data") or {}).get(ref.key)
    if raw is None:
        return ABSENT
    try:
        value = base64.b64decode(raw, validate=True)
    except (binascii.Error, TypeError):  # the API server always sends base64; be safe with a fake one
        value = str(raw).encode()
    return fingerprint(value, str((secret.get("metadata") or {}).get("uid", "")))
