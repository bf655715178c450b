"""Header and body read timeouts for the router's HTTP server (uvicorn's h11 protocol).

uvicorn bounds only the idle time between requests on a kept-alive connection (timeout_keep_alive),
and any byte that arrives cancels that timer: a client that sends half a request line and stalls, or
a body one byte at a time, holds a connection (and a file descriptor, and the request's place) for as
long as it likes. This protocol adds:
- a header timeout: the request line and headers must be complete within `header_timeout` seconds of
  the connection opening, or of the first byte of a later request on a kept-alive connection;
- a body timeout: the whole body must arrive within `body_timeout` seconds of the headers, whether or
  not the route reads it.
Either way the client gets a 408 in OpenAI's error shape (if no answer has started) and the connection
is closed. A malformed request line or headers get uvicorn's 400, in the same shape.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.worker.router.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S

log = logging.getLogger(__name__)


def error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-shaped error body, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body


class ReadTimeoutProtocol(H11Protocol):
    """Set the two timeouts on a subclass (`with_timeouts`): uvicorn builds the protocol itself."""

    header_timeout = DEFAULT_HEADER_TIMEOUT_S
    body_timeout = DEFAULT_BODY_TIMEOUT_S

    @classmethod
    def with_timeouts(cls, header_timeout: float, body_timeout: float) -> type[ReadTimeoutProtocol]:
        return type("ReadTimeoutProtocol", (cls,), {"header_timeout": header_timeout, "body_timeout": body_timeout})

    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout, self._timed_out, "header")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        self._cancel_body()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # part of a request's head is here: it has header_timeout to complete
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.header_timeout, self._timed_out, "header")
        else:
            self._cancel_head()
        if state is h11.SEND_BODY:
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(self.body_timeout, self._timed_out, "body")
        else:
            self._cancel_body()

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _timed_out(self, part: str) -> None:
        self._head_timer = self._body_timer = None
        if self.transport.is_closing():
            return
        limit = self.header_timeout if part == "header" else self.body_timeout
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        log.warning("closing the connection from %s: the request's %s did not arrive within %g s", client, part, limit)
        cycle = self.cycle if part == "body" else None
        if cycle is None or not cycle.response_started:
            what = "headers" if part == "header" else "body"
            self.transport.write(error_bytes(408, "Request Timeout", f"the request's {what} did not arrive within "
                                             f"{limit:g} s", "request_timeout"))
        if cycle is not None:
            # The route sees a client that went away (and whatever it answers goes nowhere).
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(error_bytes(400, "Bad Request", f"invalid HTTP request: {msg}", "invalid_http_request"))
        self.transport.close()
