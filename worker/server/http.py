"""HTTP routes of a worker: probes, metrics, and the control API the router calls.

Errors are JSON {"error": {"message": ...}} with a status the router acts on: 400 (bad request,
do not retry), 409 (conflict), 422 (this request failed on its own and would anywhere: do not retry),
429 (this caller holds too many KV reservations), 503 (loading, draining or full: try another worker),
504 (deadline).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from tandem.worker import metrics as m
from tandem.worker.router.tokens import tokenizer_files
from tandem.worker.server.control_auth import ControlAuth
from tandem.worker.server.protocol import (
    AbortRequest,
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    ReserveRequest,
)
from tandem.worker.server.worker import Rejected, WorkerServer

NDJSON = "application/x-ndjson"
# Largest control-API body: a /decode carries the prompt's and the generated token ids, under 10 bytes
# each in JSON, so 32 MiB is millions of tokens; a bigger body is refused before it is read into memory.
MAX_BODY_BYTES = 32 << 20


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _too_large() -> Rejected:
    return Rejected(413, f"the request body is larger than this worker's limit of {MAX_BODY_BYTES} bytes")


async def _body(request: Request) -> bytes:
    """The request body, or 413 as soon as it is known to pass MAX_BODY_BYTES (by its length or while read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await _body(request)
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise Rejected(400, f"invalid {model.__name__}: {exc.errors()[0]['msg']} at "
                       f"{'.'.join(str(p) for p in exc.errors()[0]['loc'])}") from None


def create_app(server: WorkerServer) -> FastAPI:
    app = FastAPI(title="tandem worker")
    app.state.worker = server
    if server.cfg.control is not None:  # every route but /health, /ready and /metrics needs the control token
        app.add_middleware(ControlAuth, tokens=server.cfg.control,
                           count=lambda reason: server.telemetry.inc(m.CONTROL_AUTH_FAILURES, reason=reason))

    @app.exception_handler(Rejected)
    async def rejected(_: Request, exc: Rejected) -> JSONResponse:
        return _error(exc.status, str(exc))

    @app.get("/health")
    async def health() -> Response:
        if server.load_error is not None:
            return _error(500, f"loading failed: {server.load_error}")
        if server.fatal_error is not None:
            return _error(500, f"the engine failed: {server.fatal_error}")
        if server.loop is not None and not server.loop.alive:
            return _error(500, "the engine thread stopped")
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        body = {"ready": server.ready, "draining": server.draining, "load_progress": server.load_progress,
                "error": server.load_error}
        return JSONResponse(body, status_code=200 if server.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/info")
    async def info() -> dict[str, Any]:
        return server.info().model_dump()

    @app.get("/kv/events")
    async def kv_events(since: int = 0, epoch: str | None = None) -> dict[str, Any]:
        return (await server.kv_events(since, epoch)).model_dump()

    @app.get("/tokenizer")
    async def tokenizer() -> Response:
        if server.engine is None:
            return _error(503, "the model is still loading")
        return JSONResponse({"files": tokenizer_files(server.cfg.model_dir),
                             "eos_token_ids": sorted(server.engine.tokenizer.eos_token_ids)})

    def stream(handler: Callable[[Any], Awaitable[Any]], model: type[BaseModel]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            body = await _parse(request, model)
            return StreamingResponse(await handler(body), media_type=NDJSON)
        return route

    app.add_api_route("/generate", stream(server.generate, GenerateRequest), methods=["POST"])
    app.add_api_route("/decode", stream(server.decode, DecodeRequest), methods=["POST"])

    @app.post("/prefill")
    async def prefill(request: Request) -> dict[str, Any]:
        body = await _parse(request, PrefillRequest)
        return (await server.prefill(body, request.is_disconnected)).model_dump()

    @app.post("/kv/reserve")
    async def reserve(request: Request) -> dict[str, Any]:
        body = await _parse(request, ReserveRequest)
        peer = request.client.host if request.client is not None else ""
        return (await server.reserve(body, request.is_disconnected, peer)).model_dump()

    @app.post("/kv/cancel")
    async def cancel(request: Request) -> dict[str, Any]:
        body = await _parse(request, AbortRequest)
        return {"cancelled": await server.cancel(body.request_id)}

    @app.post("/abort")
    async def abort(request: Request) -> dict[str, Any]:
        body = await _parse(request, AbortRequest)
        await server.abort(body.request_id)
        return {"aborted": body.request_id}

    return app
