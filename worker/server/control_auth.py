"""Refuses control calls without the model's control token (control_token.py) before any route runs.

A pure ASGI middleware: the refusal happens before the body is read or parsed, so a refused
/kv/reserve sets no block aside, a refused /generate queues nothing, and a refused /abort aborts
nothing. Every refusal is a 401 with a JSON error, counted in tandem_control_auth_failures_total
(by reason) and logged without the token, at most once per LOG_EVERY_S with the count in between
(a flood of bad calls must not flood the log too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.worker.refusal_log import LOG_EVERY_S, ThrottledLog
from tandem.worker.server.control_token import HEADER, OPEN_PATHS, ControlTokens

log = logging.getLogger(__name__)

_HEADER_KEY = HEADER.lower().encode("latin-1")


def presented_token(scope: Scope) -> str | None:
    """The control header's value in an ASGI request, if any."""
    for key, value in scope.get("headers") or ():
        if key == _HEADER_KEY:
            return bytes(value).decode("latin-1")
    return None


def refusal(reason: str) -> JSONResponse:
    message = ("this route needs the model's worker control token in the " + HEADER + " header"
               if reason == "missing" else "the " + HEADER + " header does not hold this model's control token")
    return JSONResponse({"error": {"message": message, "type": "authentication_error", "code": f"control_token_{reason}"}},
                        status_code=401, headers={"WWW-Authenticate": f'{HEADER} realm="tandem worker control"'})


class RefusalLog:
    """Logs refused calls (never the token presented), at most one line per `every_s` (refusal_log.py)."""

    def __init__(self, what: str, every_s: float = LOG_EVERY_S) -> None:
        self.what = what
        self._log = ThrottledLog(log, every_s)

    def refused(self, reason: str, method: str, path: str, peer: str) -> None:
        self._log.warning("refused %s %s %s from %s: %s control token", self.what, method, path, peer or "?", reason)


class ControlAuth:
    """Wraps the worker's app: every path but OPEN_PATHS needs one of `tokens`."""

    def __init__(self, app: ASGIApp, tokens: ControlTokens, count: Callable[[str], None], what: str = "worker call") -> None:
        self.app, self.tokens, self.count = app, tokens, count
        self.log = RefusalLog(what)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        reason = self.tokens.check(presented_token(scope))
        if reason is None:
            await self.app(scope, receive, send)
            return
        self.count(reason)
        client = scope.get("client")
        self.log.refused(reason, str(scope.get("method", ""))[:16], str(scope.get("path", ""))[:200],
                        client[0] if client else "")
        await refusal(reason)(scope, receive, send)
