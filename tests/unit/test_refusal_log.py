"""The one throttle for refusal logs (tandem.worker.refusal_log), used by the router's API-key edge and the
worker control API: the first refusal at once, then at most one line per interval with the count held back."""

from __future__ import annotations

import logging

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tandem.worker import refusal_log
from tandem.worker.refusal_log import ThrottledLog
from tandem.worker.router import auth
from tandem.worker.server import control_auth


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_first_line_at_once_then_one_per_interval_with_the_count(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    logger = logging.getLogger("tests.refusals")
    throttle = ThrottledLog(logger, every_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tests.refusals"):
        assert throttle.warning("refused %s", "a")
        clock.now += 3
        assert not throttle.warning("refused %s", "b")
        clock.now += 6.9
        assert not throttle.warning("refused %s", "c")
        clock.now += 0.1  # 10 s after the first line
        assert throttle.warning("refused %s", "d")
        clock.now += 60
        assert throttle.warning("refused %s", "e")  # nothing held back since: no count
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("tests.refusals", logging.WARNING, "refused a"),
        ("tests.refusals", logging.WARNING, "refused d (2 more refused since the last line)"),
        ("tests.refusals", logging.WARNING, "refused e"),
    ]


def test_the_default_interval_is_ten_seconds() -> None:
    assert refusal_log.LOG_EVERY_S == 10.0
    assert ThrottledLog(logging.getLogger("x")).every_s == 10.0


def _flood(app: Starlette, headers: dict[str, str], times: int) -> None:
    client = TestClient(app)
    for _ in range(times):
        assert client.get("/v1/models", headers=headers).status_code == 401


def _inner() -> Starlette:
    return Starlette(routes=[Route("/v1/models", lambda request: PlainTextResponse("ok"))])


def test_the_router_edge_and_the_control_api_both_throttle_through_it(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    edge = auth.ApiKeyMiddleware(_inner(), auth.ApiKeys(["sesame"]), lambda reason: None)
    control = control_auth.ControlAuth(_inner(), control_auth.ControlTokens(("right-token-0123456789",)),
                                       lambda reason: None)
    edge._log.clock = control.log._log.clock = clock
    with caplog.at_level(logging.WARNING):
        _flood(edge, {"Authorization": "Bearer wrong"}, 3)  # type: ignore[arg-type]
        _flood(control, {control_auth.HEADER: "wrong-token-0123456789"}, 3)  # type: ignore[arg-type]
        clock.now += 10
        _flood(edge, {}, 1)  # type: ignore[arg-type]
        _flood(control, {}, 1)  # type: ignore[arg-type]
    lines = [(r.name, r.getMessage()) for r in caplog.records]
    assert lines == [
        (auth.__name__, "401 for GET /v1/models from testclient: invalid API key"),
        (control_auth.__name__, "refused worker call GET /v1/models from testclient: invalid control token"),
        (auth.__name__, "401 for GET /v1/models from testclient: missing API key (2 more refused since the last line)"),
        (control_auth.__name__, "refused worker call GET /v1/models from testclient: missing control token "
                                "(2 more refused since the last line)"),
    ], lines
    assert "wrong" not in repr(lines)  # never the credential presented
