"""kvTransfer.secure: the keypair Secret, read or created once (tandem.operator.kv_keys), against a fake API."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.operator import builders, kv_keys
from tandem.operator.kube import KubeError
from tandem.worker.kv import keys as keys_module
from tandem.worker.kv.keys import KVKeys

OWNER = builders.Owner(name="tiny", namespace="serving", uid="uid-1")


class FakeKube:
    """Secrets only: get and create, as the operator's RBAC allows."""

    def __init__(self, secrets: dict[str, dict[str, Any]] | None = None, refuse: int = 0,
                 appears_on_create: dict[str, Any] | None = None) -> None:
        self.secrets = dict(secrets or {})
        self.refuse, self.appears_on_create = refuse, appears_on_create
        self.created: list[dict[str, Any]] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert (api_version, kind, namespace) == ("v1", "Secret", "serving")
        if self.refuse:
            raise KubeError(self.refuse, f'secrets "{name}" is forbidden')
        return self.secrets.get(name)

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        name = manifest["metadata"]["name"]
        if self.appears_on_create is not None:  # someone else won the race
            self.secrets[name] = self.appears_on_create
            raise KubeError(409, f'secrets "{name}" already exists')
        self.created.append(manifest)
        self.secrets[name] = manifest
        return manifest


def secret(data: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "tiny-kv-keys"}, "data": data}


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_a_missing_secret_is_created_with_fresh_keys() -> None:
    kube = FakeKube()
    keys, created = kv_keys.ensure(kube, OWNER)  # type: ignore[arg-type]
    assert created
    assert kube.created == [builders.kv_keys_secret(OWNER, keys)]
    again, created_again = kv_keys.ensure(kube, OWNER)  # type: ignore[arg-type]
    assert (again, created_again) == (keys, False)
    assert len(kube.created) == 1  # never written again


def test_an_existing_secret_is_used_as_it_is() -> None:
    theirs = KVKeys.generate()
    # As `kubectl create secret generic --from-file` of `tandem kv-keys` output: trailing newlines.
    kube = FakeKube({"tiny-kv-keys": secret({"public": b64(theirs.public + b"\n"), "secret": b64(theirs.secret + b"\n")})})
    assert kv_keys.ensure(kube, OWNER) == (theirs, False)  # type: ignore[arg-type]
    assert kube.created == []


def test_losing_the_create_race_uses_the_winners_keys() -> None:
    winner = KVKeys.generate()
    kube = FakeKube(appears_on_create=builders.kv_keys_secret(OWNER, winner))
    assert kv_keys.ensure(kube, OWNER) == (winner, False)  # type: ignore[arg-type]


def test_a_refused_read_is_raised_for_the_reconcile_to_report() -> None:
    with pytest.raises(KubeError, match="forbidden"):
        kv_keys.ensure(FakeKube(refuse=403), OWNER)  # type: ignore[arg-type]


OTHER = KVKeys.generate()
KEYS = KVKeys.generate()


@pytest.mark.parametrize(("data", "why"), [
    ({}, "no key 'public' or 'secret'"),
    ({"public": b64(KEYS.public)}, "no key 'secret'"),
    ({"public": "!!not base64!!", "secret": b64(KEYS.secret)}, "not base64"),
    ({"public": b64(b"short"), "secret": b64(KEYS.secret)}, "the public key must be 40 Z85 characters, got 5"),
    ({"public": b64(KEYS.public), "secret": b64(b"\x01" * 40)}, "the secret key is not valid Z85"),
    ({"public": b64(OTHER.public), "secret": b64(KEYS.secret)}, "the public key does not belong to the secret key"),
])
def test_a_secret_without_a_usable_pair_is_refused_naming_it(data: dict[str, str], why: str) -> None:
    kube = FakeKube({"tiny-kv-keys": secret(data)})
    with pytest.raises(kv_keys.InvalidKeys) as caught:
        kv_keys.ensure(kube, OWNER)  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith("Secret tiny-kv-keys does not hold a usable KV transfer keypair"), message
    assert why in message and "delete it" in message
    assert KEYS.secret.decode() not in message
    assert kube.created == []  # reported, never replaced


def test_the_secret_the_operator_writes_loads_in_the_worker(tmp_path: Path) -> None:
    """The Secret's data, written out as the kubelet mounts it, is what `tandem worker --kv-keys` loads."""
    assert (builders.KV_PUBLIC_KEY, builders.KV_SECRET_KEY) == (keys_module.PUBLIC_FILE, keys_module.SECRET_FILE)
    ours = KVKeys.generate()
    for key, value in builders.kv_keys_secret(OWNER, ours)["data"].items():
        (tmp_path / key).write_bytes(base64.b64decode(value))
    assert KVKeys.load(tmp_path) == ours
    assert ours.secret.decode() not in repr(ours)


def test_the_operator_does_not_import_torch() -> None:
    """The operator image installs .[operator] (no torch): nothing it imports may pull in the worker's engine."""
    probe = "import sys, tandem.operator.main; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
