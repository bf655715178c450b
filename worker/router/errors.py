"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with a matching status."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 429, WWW-Authenticate on a 401

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        from fastapi.responses import JSONResponse  # here: `tandem router --help` imports this module

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, param=param, code="model_not_found" if param == "model" else None)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                    "(tandem router --max-request-bytes)", code="request_too_large")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type_="service_unavailable", code="no_worker_available")


def timeout(message: str) -> APIError:
    return APIError(504, message, type_="timeout", code="deadline_exceeded")


def internal(message: str) -> APIError:
    """A 500. Its message is written for the client: never an exception's text (that goes to the log)."""
    return APIError(500, message, type_="server_error")


def request_failed(message: str) -> APIError:
    """The worker could not compute this request (NaN logits, a sampling failure...), and no other worker
    could either: the request failed alone. A 500 (the server failed it, not the client), whose message
    the engine writes for the client."""
    return APIError(500, message, type_="server_error", code="request_failed")
