"""free_port never hands the same port out twice in one process, even when the kernel offers it again."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from tandem.worker.server import ports


def test_a_port_the_kernel_offers_again_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    offers = iter([41001, 41001, 41001, 41002])

    class Socket:
        def __enter__(self) -> Socket:
            return self

        def __exit__(self, *_: Any) -> None:
            pass

        def bind(self, _: tuple[str, int]) -> None:
            self.port = next(offers)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(ports, "_handed_out", set())
    monkeypatch.setattr(ports.socket, "socket", Socket)  # the kernel's choice is what this test controls
    assert [ports.free_port(), ports.free_port()] == [41001, 41002]


def test_ports_are_bindable_and_distinct() -> None:
    handed = [ports.free_port() for _ in range(50)]
    assert len(set(handed)) == 50
    with socket.socket() as s:
        s.bind(("127.0.0.1", handed[-1]))
