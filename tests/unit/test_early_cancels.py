"""KVIntake remembers cancels that came before their reservation, for a while and up to a count.

A plain unit test: the receiver is a stand-in that records cancels (KVIntake only calls
receiver.cancel), and nothing here needs an event loop.
"""

from __future__ import annotations

import pytest

from tandem.worker.server import kv_link
from tandem.worker.server.kv_link import KVIntake


class _Receiver:
    def cancel(self, transfer_id: str) -> bool:
        return False


def test_an_early_cancel_is_remembered_and_the_oldest_go_first_past_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_link, "EARLY_CANCEL_LIMIT", 5)
    intake = KVIntake(_Receiver(), lambda request_id: None)
    for n in range(8):
        assert intake.cancel(f"r{n}") is False  # nothing reserved yet
    remembered = [f"r{n}" for n in range(8) if intake.cancelled_early(f"r{n}")]
    assert remembered == ["r3", "r4", "r5", "r6", "r7"]


def test_an_early_cancel_is_forgotten_after_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(kv_link.time, "monotonic", lambda: now[0])
    intake = KVIntake(_Receiver(), lambda request_id: None)
    intake.cancel("early")
    now[0] += kv_link.EARLY_CANCEL_MEMORY_S - 1
    assert intake.cancelled_early("early")
    now[0] += 2
    assert not intake.cancelled_early("early")
