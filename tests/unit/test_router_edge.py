"""The pure parts of the router's edge (issue 18): API keys and their header, admission (the caps on
running and queued requests), and the raw error responses of the read timeouts."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tandem.worker.router import auth
from tandem.worker.router.auth import ApiKeyMiddleware, ApiKeys, bearer_token, parse_keys
from tandem.worker.router.errors import APIError
from tandem.worker.router.limits import Admission
from tandem.worker.router.read_timeouts import error_bytes


def test_keys_are_whitespace_separated_and_comments_skipped() -> None:
    assert parse_keys("# rotation\nnew-key\n  old-key  \n\nthird fourth\n") == ["new-key", "old-key", "third", "fourth"]


@pytest.mark.parametrize(("value", "token"), [
    (b"Bearer abc", "abc"), (b"bearer abc", "abc"), (b"BEARER  abc ", "abc"), (b"Basic abc", ""), (b"Bearer", ""),
])
def test_bearer_token(value: bytes, token: str) -> None:
    assert bearer_token([(b"content-type", b"x"), (b"authorization", value)]) == token


def test_no_authorization_header_is_none() -> None:
    assert bearer_token([(b"content-type", b"application/json")]) is None


def test_every_given_key_is_valid_and_nothing_else() -> None:
    keys = ApiKeys(["key-one", "key-two"])
    assert keys.enabled
    assert keys.valid("key-one") and keys.valid("key-two")
    assert not keys.valid("key-on") and not keys.valid("key-one ") and not keys.valid("")
    assert not ApiKeys([]).enabled


def test_a_key_file_is_re_read_when_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "FILE_CHECK_S", 0.0)
    path = tmp_path / "keys"
    path.write_text("old\n")
    keys = ApiKeys([], path)
    assert keys.valid("old") and not keys.valid("new")
    path.write_text("old\nnew\n")
    os.utime(path, (time.time() + 5, time.time() + 5))  # a new mtime even on a coarse clock
    assert keys.valid("new") and keys.valid("old")
    path.unlink()  # gone for a moment (a Secret's symlink swap): the keys it had stay
    assert keys.valid("new")


def test_an_empty_key_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no API key"):
        ApiKeys([], tmp_path / "keys")


def test_the_middleware_guards_all_but_the_open_paths() -> None:
    refused: list[str] = []
    inner = Starlette(routes=[Route(p, lambda _: PlainTextResponse("ok"), methods=["GET", "POST"])
                              for p in ("/health", "/metrics", "/v1/models")])
    app = ApiKeyMiddleware(inner, ApiKeys(["sesame"]), refused.append)

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            return [await client.get("/health"), await client.get("/metrics"), await client.get("/v1/models"),
                    await client.post("/v1/models", headers={"authorization": "Bearer wrong"}),
                    await client.get("/anything-else"),
                    await client.get("/v1/models", headers={"authorization": "Bearer sesame"})]

    health, metrics, missing, wrong, other, ok = asyncio.run(run())
    assert health.status_code == metrics.status_code == ok.status_code == 200
    for resp in (missing, wrong, other):
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
        assert resp.json()["error"]["code"] == "invalid_api_key"
        assert resp.json()["error"]["type"] == "invalid_request_error"
    assert "Authorization: Bearer" in missing.json()["error"]["message"]
    assert refused == ["missing", "invalid", "missing"]


def test_admission_refuses_past_running_plus_queued_with_retry_after() -> None:
    async def run() -> None:
        a = Admission(max_running=2, max_queued=1, queue_timeout=0.2)
        tickets = [a.enter() for _ in range(3)]
        with pytest.raises(APIError) as full:
            a.enter()
        assert full.value.status == 429 and full.value.headers == {"retry-after": "1"}
        await tickets[0].start(time.monotonic() + 60)
        await tickets[1].start(time.monotonic() + 60)
        assert (a.running, a.queued) == (2, 1)
        started = time.monotonic()
        with pytest.raises(APIError) as late:  # no slot frees within the queue timeout
            await tickets[2].start(time.monotonic() + 60)
        assert late.value.status == 429 and 0.15 < time.monotonic() - started < 2
        tickets[2].release()
        waiter = asyncio.ensure_future(a.enter().start(time.monotonic() + 60))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        tickets[0].release()
        tickets[0].release()  # twice is once
        await asyncio.wait_for(waiter, 1)
        assert (a.running, a.queued, a.admitted) == (2, 0, 2)

    asyncio.run(run())


def test_a_queued_request_never_waits_past_its_deadline() -> None:
    async def run() -> None:
        a = Admission(max_running=1, max_queued=1, queue_timeout=30)
        await a.enter().start(time.monotonic() + 60)
        started = time.monotonic()
        with pytest.raises(APIError):
            await a.enter().start(time.monotonic() + 0.1)
        assert time.monotonic() - started < 2

    asyncio.run(run())


def test_timeout_responses_are_whole_http_with_an_openai_error() -> None:
    raw = error_bytes(408, "Request Timeout", "too slow", "request_timeout")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and b"connection: close" in head
    assert f"content-length: {len(body)}".encode() in head
    assert json.loads(body)["error"] == {"message": "too slow", "type": "invalid_request_error", "param": None,
                                         "code": "request_timeout"}


def test_the_worker_refuses_a_body_over_its_limit_with_413(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.worker.server import http as worker_http
    from tandem.worker.server.config import WorkerConfig
    from tandem.worker.server.worker import WorkerServer

    monkeypatch.setattr(worker_http, "MAX_BODY_BYTES", 4096)
    app = worker_http.create_app(WorkerServer(WorkerConfig(model_dir=tmp_path, role="decode")))
    big = json.dumps({"request_id": "x" * 8000}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        yield big[:3000]
        yield big[3000:]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as client:
            return [await client.post("/abort", content=big),  # with a content-length
                    await client.post("/abort", content=chunks()),  # chunked
                    await client.post("/abort", content=json.dumps({"request_id": "small"}).encode())]

    declared, chunked, small = asyncio.run(run())
    for resp in (declared, chunked):
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["message"] == "the request body is larger than this worker's limit of 4096 bytes"
    assert small.status_code != 413
