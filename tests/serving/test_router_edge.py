"""The router's edge (issue 18): API keys, TLS, read timeouts and admission, against a real `tandem router`
(scripted workers, see test_router_robustness) or a real `tandem serve`, seen as a client sees them: the
official openai client where one is involved, raw sockets for connections that stall.

Before: no key was asked for, HTTPS could not be served, a connection with half its headers was still
open after 90 s, a body could trickle for the whole request deadline (600 s), and no request was ever
refused for load.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from .conftest import Stack, metric_value
from .test_router_robustness import FakeWorker, router_procs, start_router  # noqa: F401

# ruff: noqa: F811 (the fixtures above are used by name, as parameters, which ruff reads as redefinitions)

pytestmark = pytest.mark.integration

KEYS = ("sk-tandem-first-0123456789", "sk-tandem-second-9876543210")


def client(url: str, key: str, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60, **kw)


def complete(c: openai.OpenAI) -> str:
    return c.completions.create(model="tiny", prompt="hello", max_tokens=3).choices[0].text


def router_log(url: str, tmp_path: Path) -> str:
    return (tmp_path / f"router-{url.rsplit(':', 1)[1]}.log").read_text()


# ---------------------------------------------------------------- API keys


def test_every_v1_route_needs_one_of_the_keys(start_router: Callable[..., str], monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", " ".join(KEYS))  # from the environment: not on the command line
    url = start_router([], [FakeWorker("both")])
    for key in KEYS:  # both valid at once (rotation)
        assert complete(client(url, key))
        assert [m.id for m in client(url, key).models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError) as wrong:
        complete(client(url, "sk-tandem-wrong-key-000000"))
    assert wrong.value.status_code == 401 and wrong.value.code == "invalid_api_key"
    err = wrong.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and "key" not in err["message"].split("API key")[0]
    missing = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=10)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert "Authorization: Bearer" in missing.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/nothing-here", timeout=10).status_code == 401  # no 404 to tell what exists
    for path in ("/health", "/ready", "/metrics"):  # probes and Prometheus carry no key
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 200, path
    assert metric_value(url, "tandem_router_auth_failures_total", reason="invalid") == 1
    assert metric_value(url, "tandem_router_auth_failures_total", reason="missing") == 2
    log = router_log(url, tmp_path)
    assert "401 for POST /v1/completions" in log and "invalid API key" in log
    assert "wrong-key" not in log and KEYS[0] not in log  # never a key, wrong or right


def test_a_key_file_rotates_without_a_restart(start_router: Callable[..., str], tmp_path: Path) -> None:
    keys = tmp_path / "api-keys"
    keys.write_text(f"# the router's keys\n{KEYS[0]}\n")
    url = start_router([], [FakeWorker("both")], "--api-key-file", str(keys))
    assert complete(client(url, KEYS[0]))
    keys.write_text(f"{KEYS[0]}\n{KEYS[1]}\n")  # step 1: add the new key; clients move to it
    limit = time.monotonic() + 10
    while httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEYS[1]}"}, timeout=10).status_code != 200:
        assert time.monotonic() < limit, "the new key was not taken up"
        time.sleep(0.2)
    keys.write_text(f"{KEYS[1]}\n")  # step 2: drop the old one
    limit = time.monotonic() + 10
    while httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {KEYS[0]}"}, timeout=10).status_code != 401:
        assert time.monotonic() < limit, "the old key stayed valid"
        time.sleep(0.2)
    assert complete(client(url, KEYS[1]))


def test_tandem_serve_passes_its_key_to_the_router_off_the_command_line(start_stack: Callable[..., Stack]) -> None:
    stack = start_stack("--mode", "monolithic", "--decode-workers", "1", "--api-key", KEYS[0])
    router = next(p for p in stack.state["processes"] if p["role"] == "router")
    argv = Path(f"/proc/{router['pid']}/cmdline").read_bytes().split(b"\0")
    assert KEYS[0].encode() not in b" ".join(argv), argv  # `ps` shows every argv to every user
    chat = client(stack.url, KEYS[0]).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        client(stack.url, "sk-not-the-key").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    # `tandem bench` against the keyed router: with the key it completes, without it fails clearly.
    bench = [sys.executable, "-m", "tandem.worker.cli", "bench", "--url", stack.url, "-n", "2", "--rate", "0",
             "--prompt-tokens", "8", "--output-tokens", "2"]
    keyed = subprocess.run(bench, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "OPENAI_API_KEY": KEYS[0]})
    assert keyed.returncode == 0 and "2 completed" in keyed.stdout.replace("\n", " "), keyed.stdout[-2000:]
    keyless = subprocess.run(bench, capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"})
    assert keyless.returncode == 1 and "401" in keyless.stdout, keyless.stdout[-2000:]


def test_the_operator_s_api_key_secret_reaches_the_router(start_router: Callable[..., str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The router container the operator builds for spec.router.apiKeySecret, its env resolved as the kubelet
    would from the Secret: the real router asks for exactly the Secret's keys."""
    from tandem.operator import builders
    from tandem.operator.api import DisaggregatedModelSpec

    spec = DisaggregatedModelSpec.model_validate({"model": {"name": "tiny", "source": {"path": "/models/tiny"}},
                                                  "router": {"apiKeySecret": {"name": "tiny-api-keys"}}})
    secret = {"tiny-api-keys": {"api-key": f"{KEYS[0]}\n{KEYS[1]}\n"}}  # two keys, mid-rotation
    pod = builders.router_deployment(builders.Owner("tiny", "serving", "uid"), spec, 1)["spec"]["template"]["spec"]
    for var in pod["containers"][0]["env"]:
        if ref := var.get("valueFrom", {}).get("secretKeyRef"):
            monkeypatch.setenv(var["name"], secret[ref["name"]][ref["key"]])
    url = start_router([], [FakeWorker("both")])
    assert complete(client(url, KEYS[0])) and complete(client(url, KEYS[1]))
    with pytest.raises(openai.AuthenticationError):
        complete(client(url, "sk-anyone"))


# ---------------------------------------------------------------- TLS


def self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem test router")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = folder / "router.crt", folder / "router.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return certfile, keyfile


def test_the_router_serves_https_with_the_given_certificate(start_router: Callable[..., str], tmp_path: Path) -> None:
    certfile, keyfile = self_signed(tmp_path)
    url = start_router([], [FakeWorker("both")], "--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile),
                       "--api-key", KEYS[0], verify=ssl.create_default_context(cafile=str(certfile)))
    assert url.startswith("https://")
    with httpx.Client(verify=ssl.create_default_context(cafile=str(certfile))) as trusting:
        assert complete(client(url, KEYS[0], http_client=trusting))
    with pytest.raises(openai.APIConnectionError):  # an unknown certificate is refused by a default client
        complete(client(url, KEYS[0]))
    with pytest.raises(httpx.HTTPError):  # and nothing is served in the clear on that port
        httpx.get(url.replace("https://", "http://") + "/health", timeout=5).raise_for_status()


# ---------------------------------------------------------------- read timeouts


def read_all(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    sock.settimeout(limit_s)
    started, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - started


def read_response(sock: socket.socket) -> bytes:
    """One whole response with a content-length (the connection stays open)."""
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        if sep and length and len(body) >= int(length.group(1)):
            return data
        data += sock.recv(65536)


def assert_408(data: bytes) -> None:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_partial_headers_are_cut_off_at_the_header_timeout(start_router: Callable[..., str]) -> None:
    url = start_router([], [FakeWorker("both")], "--header-timeout", "2")
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as stalled, socket.create_connection(("127.0.0.1", port)) as mute:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: app")
        data, took = read_all(stalled, 30)
        assert_408(data)
        assert 1.5 < took < 6, took
        silent, took = read_all(mute, 30)  # connected and never sent a byte: closed as well
        assert took < 6
        assert silent == b"" or silent.startswith(b"HTTP/1.1 408")
    with socket.create_connection(("127.0.0.1", port)) as kept:  # a kept-alive connection's next request too
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
        kept.settimeout(10)
        assert read_response(kept).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        for piece in (b"GET /hea", b"lth HTTP/1.1\r\n", b"Host: ro"):  # trickling does not extend it
            kept.sendall(piece)
            time.sleep(0.6)
        data, _ = read_all(kept, 30)
        assert_408(data)
        assert time.monotonic() - started < 6
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_a_trickling_body_is_cut_off_at_the_body_timeout(start_router: Callable[..., str]) -> None:
    url = start_router([], [FakeWorker("both")], "--body-timeout", "3")
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"model": "tiny", "prompt": "x" * 200, "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        started = time.monotonic()
        sock.settimeout(0.5)
        data = b""
        for i in range(len(body)):  # a byte every 0.3 s: 70 s for the whole body
            try:
                sock.sendall(body[i:i + 1])
                data += sock.recv(65536)
                break  # the answer came (or the connection closed)
            except TimeoutError:
                continue
            except OSError:
                break
        rest, _ = read_all(sock, 30)
        took = time.monotonic() - started
    assert_408(data + rest)
    assert 2.5 < took < 8, took
    resp = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert resp.status_code == 200, resp.text  # a whole body in time is served as before


def test_a_malformed_request_head_is_a_400_in_openai_shape(start_router: Callable[..., str]) -> None:
    url = start_router([], [FakeWorker("both")])
    port = int(url.rsplit(":", 1)[1])
    for head in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: r\r\nno colon here\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(head)
            data, _ = read_all(sock, 10)
        status, _, body = data.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 400"), data[:200]
        assert json.loads(body)["error"]["code"] == "invalid_http_request"


# ---------------------------------------------------------------- admission


def test_past_the_running_and_queued_caps_a_request_gets_429_with_retry_after(
        start_router: Callable[..., str]) -> None:
    # The worker pauses the first stream for 3 s: it holds the one running slot meanwhile.
    worker = FakeWorker("both", pause={"seconds": 3.0, "heartbeats": True})
    url = start_router([], [worker], "--max-concurrent-requests", "1", "--max-queued-requests", "1",
                       "--queue-timeout", "20")
    c = client(url, "unused")
    first: list[str] = []
    stream = c.completions.create(model="tiny", prompt="hold", max_tokens=4, stream=True)
    first.append(next(iter(stream)).choices[0].text)  # running (paused on the worker)
    queued: dict[str, Any] = {}

    def wait_in_queue() -> None:
        started = time.monotonic()
        queued["text"] = complete(client(url, "unused"))
        queued["waited"] = time.monotonic() - started

    waiter = threading.Thread(target=wait_in_queue)
    waiter.start()
    time.sleep(0.5)  # the second request holds the one queue place
    with pytest.raises(openai.RateLimitError) as full:
        complete(c)
    assert full.value.status_code == 429 and full.value.response.headers["retry-after"] == "1"
    err = full.value.response.json()["error"]
    assert err["code"] == "too_many_requests" and "--max-queued-requests" in err["message"]
    first += [chunk.choices[0].text for chunk in stream]
    waiter.join(30)
    assert queued["text"] and queued["waited"] > 1.5  # it waited for the slot, then was served
    assert len(first) >= 2
    assert complete(c)  # places and slots are all back
    assert metric_value(url, "tandem_router_overloaded_requests_total", reason="queue_full") == 1
    assert metric_value(url, "tandem_router_active_requests") == 0
    assert metric_value(url, "tandem_router_queued_requests") == 0


def test_requests_under_the_caps_are_served_alongside(start_router: Callable[..., str]) -> None:
    url = start_router([], [FakeWorker("both")], "--max-concurrent-requests", "8", "--max-queued-requests", "0")
    results: list[int] = []

    def one() -> None:
        results.append(httpx.post(f"{url}/v1/completions", timeout=30,
                                  json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [200] * 6
