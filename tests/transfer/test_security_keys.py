"""KV transfer keys (kvTransfer.secure): files, validation, and that the secret never leaks."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tandem.worker.kv.keys import KVKeys, KVKeysError


def test_saved_keys_load_back_and_the_secret_file_is_private(tmp_path: Path) -> None:
    keys = KVKeys.generate()
    keys.save(tmp_path / "keys")
    assert KVKeys.load(tmp_path / "keys") == keys
    assert stat.S_IMODE((tmp_path / "keys" / "secret").stat().st_mode) == 0o600
    assert keys.secret.decode() not in repr(keys)


def test_missing_folder_says_which(tmp_path: Path) -> None:
    with pytest.raises(KVKeysError, match=rf"cannot read the KV transfer keys in {tmp_path}/nope"):
        KVKeys.load(tmp_path / "nope")


def test_a_public_key_from_another_pair_is_refused(tmp_path: Path) -> None:
    one, two = KVKeys.generate(), KVKeys.generate()
    (tmp_path / "public").write_bytes(two.public)
    (tmp_path / "secret").write_bytes(one.secret)
    with pytest.raises(KVKeysError, match="public key does not belong to the secret key"):
        KVKeys.load(tmp_path)


@pytest.mark.parametrize(("public", "secret", "error"), [
    (b"short", None, "public key must be 40 Z85 characters, got 5"),
    (None, b"x" * 39, "secret key must be 40 Z85 characters, got 39"),
    (None, b"\x00" * 40, "secret key is not valid Z85"),
])
def test_malformed_keys_are_refused(public: bytes | None, secret: bytes | None, error: str) -> None:
    good = KVKeys.generate()
    with pytest.raises(KVKeysError, match=error):
        KVKeys(public if public is not None else good.public, secret if secret is not None else good.secret)
