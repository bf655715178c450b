"""Receiver-side give-ups count as failures once; the allocator setting stays out of the operator's way.

Real receiver and sender on 127.0.0.1; the allocator checks run in fresh interpreters, because
the setting is once per process.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading

import pytest

from tandem.worker.transfer import TransferTelemetry
from tandem.worker.transfer.conformance import TINY_LAYOUT, make_cache
from tandem.worker.transfer.tcp_receiver import TcpReceiver
from tandem.worker.transfer.tcp_sender import TcpSender


def test_cancel_with_a_reason_counts_a_pending_transfer_once_and_a_finished_one_never() -> None:
    telemetry = TransferTelemetry(role="decode")
    with TcpReceiver(TINY_LAYOUT, make_cache(TINY_LAYOUT, 8, random=False), telemetry=telemetry) as receiver:
        receiver.expect("never-started", [1, 2], 30.0, lambda *_: None)
        assert receiver.cancel("never-started", reason="abandoned") is True
        assert receiver.cancel("never-started", reason="abandoned") is False  # already gone: not counted again
        assert telemetry.failures("tcp", "abandoned") == 1

        done = threading.Event()
        receiver.expect("delivered", [3], 30.0, lambda *_: done.set())
        with TcpSender(TINY_LAYOUT, make_cache(TINY_LAYOUT, 8, random=True)) as sender:
            transfer = sender.connect(receiver.address).begin("delivered", [3], 30.0)
            for layer in range(TINY_LAYOUT.num_layers):
                transfer.send_layer(layer, [5])
            transfer.finish()
        assert done.wait(10)
        assert receiver.cancel("delivered", reason="timeout") is False
        assert telemetry.failures("tcp", "timeout") == 0

        receiver.expect("plain-cancel", [4], 30.0, lambda *_: None)
        assert receiver.cancel("plain-cancel") is True  # no reason: the caller's own choice, not a failure
        assert sum(telemetry.failures("tcp", r) for r in ("abandoned", "timeout", "aborted")) == 1


def test_cancel_refuses_an_unknown_reason() -> None:
    with TcpReceiver(TINY_LAYOUT, make_cache(TINY_LAYOUT, 4, random=False)) as receiver:
        receiver.expect("t", [1], 30.0, lambda *_: None)
        with pytest.raises(ValueError, match="unknown transfer failure reason"):
            receiver.cancel("t", reason="gave-up")
        assert receiver.pending() == ["t"]


def _allocator_outcome(env: dict[str, str]) -> str:
    code = "from tandem.worker.transfer import allocator; print(allocator.keep_freed_buffers())"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                            timeout=60, check=True)
    return result.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                    reason="the allocator setting is glibc's mallopt; this is not a glibc system")
def test_allocator_setting_applies_on_glibc_unless_the_environment_sets_its_own() -> None:
    assert "stay in the heap" in _allocator_outcome({})
    assert _allocator_outcome({"MALLOC_TOP_PAD_": "1"}) == "left as configured by the environment (MALLOC_TOP_PAD_)"
