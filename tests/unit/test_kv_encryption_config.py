"""`--kv-encryption` resolution (WorkerConfig): sealed by default whenever the worker has a control token."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.worker.kv.keys import KVKeys
from tandem.worker.server.config import WorkerConfig
from tandem.worker.server.control_token import ControlTokens
from tandem.worker.transfer.sealing import SealSecrets

TOKENS = ControlTokens(("k" * 32, "n" * 32), "test")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def kv_keys(tmp_path: Path) -> Path:
    folder = tmp_path / "keys"
    KVKeys.generate().save(folder)
    return folder


def test_auto_seals_with_the_control_tokens_every_one_accepted(model_dir: Path) -> None:
    cfg = WorkerConfig(model_dir=model_dir, role="decode", control=TOKENS)
    assert cfg.kv_encryption == "aes-gcm"
    assert cfg.seal == SealSecrets.from_tokens(TOKENS.tokens) and len(cfg.seal.secrets) == 2


def test_auto_without_a_token_is_plain_and_with_kv_keys_is_curve(model_dir: Path, kv_keys: Path) -> None:
    plain = WorkerConfig(model_dir=model_dir, role="decode")
    assert plain.kv_encryption == "none" and plain.seal is None
    curve = WorkerConfig(model_dir=model_dir, role="decode", control=TOKENS, kv_keys=kv_keys)
    assert curve.kv_encryption == "curve" and curve.seal is None and curve.keys is not None


@pytest.mark.parametrize(("asked", "with_keys", "with_token", "says"), [
    ("aes-gcm", False, False, "has none"),
    ("aes-gcm", True, True, "cannot go with --kv-encryption aes-gcm"),
    ("none", True, True, "cannot go with --kv-encryption none"),
    ("curve", False, True, "needs --kv-keys"),
    ("tls", False, True, "must be one of"),
])
def test_contradictions_stop_the_worker_at_start(model_dir: Path, kv_keys: Path, asked: str, with_keys: bool,
                                                 with_token: bool, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        WorkerConfig(model_dir=model_dir, role="decode", kv_encryption=asked,
                     kv_keys=kv_keys if with_keys else None, control=TOKENS if with_token else None)


def test_none_turns_sealing_off_on_purpose(model_dir: Path) -> None:
    cfg = WorkerConfig(model_dir=model_dir, role="decode", kv_encryption="none", control=TOKENS)
    assert cfg.kv_encryption == "none" and cfg.seal is None
