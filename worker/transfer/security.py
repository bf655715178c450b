"""Optional CURVE security for the KV transfer's zmq sockets (`kvTransfer.secure`).

One keypair per model, shared by all its workers (a Kubernetes Secret made by the operator, or
files written by `tandem kv-keys`). The receiver is a CURVE server holding the secret key and,
through a ZAP handler, admits only clients that present the model's public key; senders are CURVE
clients with the same pair. So only holders of the model's key can talk to a KV port, and tcp
frames travel encrypted. rdma payloads do not (RC traffic is not encrypted by the NIC), but the
memory key and QP only go to authenticated peers, over the encrypted control channel.
"""

from __future__ import annotations

import zmq
import zmq.auth.thread

from tandem.worker.kv.keys import KVKeys

ZAP_DOMAIN = "tandem-kv"


class _SameKeyOnly:
    """ZAP credentials check: only the model's own public key gets in."""

    def __init__(self, keys: KVKeys) -> None:
        self._public = keys.public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._public


def serve_securely(context: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes],
                   keys: KVKeys) -> zmq.auth.thread.ThreadAuthenticator:
    """Make `sock` (not yet bound) a CURVE server that admits only this model's key.

    Returns the authenticator thread; stop() it when the socket is closed."""
    auth = zmq.auth.thread.ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_SameKeyOnly(keys))
    sock.curve_server = True
    sock.curve_secretkey = keys.secret
    sock.zap_domain = ZAP_DOMAIN.encode()
    return auth


def connect_securely(sock: zmq.Socket[bytes], keys: KVKeys) -> None:
    """Make `sock` (not yet connected) a CURVE client of a receiver holding the same keys."""
    sock.curve_serverkey = keys.public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret

