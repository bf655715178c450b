"""A real `tandem router` process against scripted workers: huge bodies and prompts, placement of
back-to-back requests, and the router's metrics when it learns the model's name from its workers.

The workers are small HTTP servers in this process that speak the control API (worker/server/
protocol.py) with canned answers, so a test can set what the router sees (a huge max_model_len,
a worker still loading) and count where requests went, without loading a model.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import free_port


class ScriptedHandler(BaseHTTPRequestHandler):
    """A scripted worker's HTTP side: quiet, answering JSON or ndjson of a known length."""

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, data: Any, status: int = 200) -> None:
        self._send(json.dumps(data).encode(), "application/json", status)

    def _info_or_404(self, info: dict[str, Any]) -> None:
        """GET: a worker's /info, anything else a 404."""
        self._json(info if self.path == "/info" else {"error": {"message": "no"}}, 200 if self.path == "/info" else 404)

    def _body(self) -> Any:
        """A POST's JSON body ({} when empty)."""
        return json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")

    def _send(self, payload: bytes, ctype: str, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def serve_scripted(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """Serve `handler` on a free 127.0.0.1 port in a daemon thread; the server and its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"

pytestmark = pytest.mark.integration

FIRST_TOKEN = 65


class FakeWorker:
    """Answers /info, /kv/reserve, /prefill, /decode, /generate like a worker of `role` would."""

    def __init__(self, role: str, max_model_len: int = 2048, loaded: bool = True,
                 pause: dict[str, Any] | None = None) -> None:
        """`pause` (shared between workers): the first /generate stream sends one token, then stays
        quiet for pause["seconds"], with a heartbeat line every second if pause["heartbeats"]."""
        self.role, self.max_model_len, self.loaded, self.pause = role, max_model_len, loaded, pause
        self.calls: Counter[str] = Counter()
        self.prompt_tokens: list[int] = []
        worker = self

        class Handler(ScriptedHandler):
            def do_GET(self) -> None:
                if self.path == "/info":
                    self._json(worker.info())
                else:
                    self._json({"error": {"message": "no"}}, 404)

            def do_POST(self) -> None:
                body = self._body()
                worker.calls[self.path] += 1
                if self.path == "/kv/reserve":
                    self._json({"transfer_id": body["request_id"], "kv_address": "tcp://127.0.0.1:9",
                                "block_ids": [0], "layout_hash": "fake"})
                elif self.path == "/prefill":
                    worker.prompt_tokens.append(len(body["prompt_token_ids"]))
                    self._json({"first_token_id": FIRST_TOKEN, "num_prompt_tokens": len(body["prompt_token_ids"]),
                                "kv_sent": True})
                elif self.path == "/generate" and worker.pause is not None and not worker.pause.get("used"):
                    worker.pause["used"] = True
                    self._pausing_stream(body["sampling"]["max_tokens"], worker.pause)
                elif self.path in ("/decode", "/generate"):
                    left = body["sampling"]["max_tokens"] - (1 if self.path == "/decode" else 0)
                    lines = [{"token_ids": [FIRST_TOKEN] * left, "finished": True, "finish_reason": "length"}]
                    self._send(("".join(json.dumps(x) + "\n" for x in lines)).encode(), "application/x-ndjson")
                else:
                    self._json({})

            def _pausing_stream(self, tokens: int, pause: dict[str, Any]) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/x-ndjson")
                self.end_headers()  # no length: the body ends when the connection closes (HTTP/1.0)
                self.wfile.write(json.dumps({"token_ids": [FIRST_TOKEN]}).encode() + b"\n")
                self.wfile.flush()
                until = time.monotonic() + pause["seconds"]
                while time.monotonic() < until:
                    time.sleep(1.0)
                    if pause["heartbeats"]:
                        self.wfile.write(b"\n")
                        self.wfile.flush()
                last = {"token_ids": [FIRST_TOKEN] * (tokens - 1), "finished": True, "finish_reason": "length"}
                self.wfile.write(json.dumps(last).encode() + b"\n")

        self.server, self.url = serve_scripted(Handler)

    def info(self) -> dict[str, Any]:
        return {"model": "tiny", "role": self.role, "pool": "local", "layout_hash": "fake", "kv_address": None,
                "transport": "tcp", "max_model_len": self.max_model_len if self.loaded else 0, "block_size": 16,
                "ready": self.loaded, "draining": False, "load_progress": 1.0 if self.loaded else 0.5,
                "stats": {"num_free_blocks": 1000, "queued_prompt_tokens": 0}}


@pytest.fixture
def router_procs() -> dict[str, subprocess.Popen[bytes]]:
    """URL -> process of each router start_router started (for tests that signal it)."""
    return {}


@pytest.fixture
def start_router(tiny_model: Path, tmp_path: Path,
                 router_procs: dict[str, subprocess.Popen[bytes]]) -> Iterator[Callable[..., str]]:
    started: list[tuple[subprocess.Popen[bytes], FakeWorker | None]] = []
    workers: list[FakeWorker] = []

    def start(prefill: list[FakeWorker], decode: list[FakeWorker], *args: str, wait_ready: bool = True,
              verify: Any = True) -> str:
        """The router's URL: https with --ssl-certfile in `args` (`verify`: what trusts its certificate)."""
        port = free_port()
        argv = [sys.executable, "-m", "tandem.worker.cli", "router", "--port", str(port), "--model", str(tiny_model),
                *(x for w in prefill for x in ("--prefill", w.url)), *(x for w in decode for x in ("--decode", w.url)),
                *args]
        log = (tmp_path / f"router-{port}.log").open("wb")
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        started.append((popen, None))
        workers.extend(prefill + decode)
        url = f"{'https' if '--ssl-certfile' in args else 'http'}://127.0.0.1:{port}"
        router_procs[url] = popen
        limit = time.monotonic() + 60
        while time.monotonic() < limit:
            assert popen.poll() is None, (tmp_path / f"router-{port}.log").read_text()
            try:
                if httpx.get(f"{url}/{'ready' if wait_ready else 'health'}", timeout=2, verify=verify).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail("the router did not come up")

    yield start
    for popen, _ in started:
        popen.terminate()
        try:
            popen.wait(15)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(5)
    for w in workers:
        w.server.shutdown()
        w.server.server_close()


def completion(url: str, prompt: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, **kw},
                      timeout=120)


def test_health_answers_while_a_long_prompt_is_tokenized(start_router: Callable[..., str]) -> None:
    # A context long enough that the characters-per-token bound (17 for the tiny tokenizer) lets the
    # prompt through to the tokenizer, which then takes seconds; the exact count refuses it.
    words = 2_500_000
    url = start_router([], [FakeWorker("both", max_model_len=words // 4)])
    done: dict[str, float] = {}
    answer: dict[str, httpx.Response] = {}

    def big() -> None:
        answer["big"] = completion(url, "a " * words)
        done["big"] = time.monotonic()

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.5)  # the body is in and being tokenized by now
    health = httpx.get(f"{url}/health", timeout=120)
    done["health"] = time.monotonic()
    thread.join(120)
    assert health.status_code == 200
    assert answer["big"].status_code == 400 and answer["big"].json()["error"]["code"] == "context_length_exceeded"
    assert done["health"] < done["big"], "GET /health waited for the tokenizer"


def test_prompt_that_cannot_fit_is_refused_without_tokenizing(start_router: Callable[..., str]) -> None:
    url = start_router([], [FakeWorker("both", max_model_len=64)])
    resp = completion(url, "a " * 1_000_000)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
    assert "characters" in err["message"]  # the bound answered, not the tokenizer
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "b " * 500_000}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    assert completion(url, "a " * 10).status_code == 200


def test_request_body_over_the_limit_is_a_413(start_router: Callable[..., str]) -> None:
    url = start_router([], [FakeWorker("both")], "--max-request-bytes", "4096")
    body = json.dumps({"model": "tiny", "prompt": "x" * 8000}).encode()
    for content in (body, iter([body[:3000], body[3000:]])):  # with a content-length, and chunked
        resp = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"},
                          timeout=30)
        assert resp.status_code == 413, resp.text
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
        assert "4096" in err["message"]
    assert completion(url, "x" * 1000).status_code == 200


def test_back_to_back_requests_keep_their_prefill_worker(start_router: Callable[..., str]) -> None:
    # 800-token prompts sharing their first block: the affinity slack is 2048 tokens, so before
    # prefills were tracked while in flight, the 4th request inside one 0.5 s poll went elsewhere.
    # The first-block policy is the one with a slack (the prefix policy's bound spreads these on purpose).
    a, b = FakeWorker("prefill"), FakeWorker("prefill")
    url = start_router([a, b], [FakeWorker("decode")], "--placement", "first-block")
    for i in range(12):
        resp = completion(url, "a " * 800 + f"request {i}")
        assert resp.status_code == 200, resp.text
    assert min(a.prompt_tokens + b.prompt_tokens) >= 800
    assert sorted([a.calls["/prefill"], b.calls["/prefill"]]) == [0, 12]


def metric_samples(url: str) -> list[Any]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("tandem_")]


def test_metrics_carry_the_model_learned_from_workers(start_router: Callable[..., str]) -> None:
    worker = FakeWorker("both", loaded=False)
    url = start_router([], [worker], wait_ready=False)  # no --model-name: learned from the workers
    assert metric_samples(url) == []  # the name is not known yet: no series with model=""
    early = completion(url, "hello")
    assert early.status_code == 503, early.text
    worker.loaded = True
    limit = time.monotonic() + 20
    while httpx.get(f"{url}/ready", timeout=5).status_code != 200:
        assert time.monotonic() < limit, "the router never saw the worker load"
        time.sleep(0.1)
    assert completion(url, "hello").status_code == 200
    assert completion(url, "hello", max_tokens="two").status_code == 400
    samples = metric_samples(url)
    assert samples and {s.labels["model"] for s in samples} == {"tiny"}
    requests = {s.labels["reason"]: s.value for s in samples if s.name == "tandem_requests_total"}
    assert requests == {"error": 2.0, "length": 1.0, "stop": 0.0}  # the 503 before the name was known counts
    assert [s.value for s in samples if s.name == "tandem_migrations_total"] == [0.0]


@pytest.mark.slow
@pytest.mark.parametrize("heartbeats", [True, False], ids=["heartbeats", "silent"])
def test_a_quiet_stream_is_kept_while_the_worker_sends_heartbeats(start_router: Callable[..., str],
                                                                     heartbeats: bool) -> None:
    """A worker stream that pauses 7 s after its first token (the router's stall timeout is 60 s):
    with a heartbeat every second it is a live worker that is slow, and the stream is kept; without
    any, after 5 s the router takes the worker for frozen and continues the request on the other one.
    The client gets all its tokens either way."""
    pause = {"seconds": 7.0, "heartbeats": heartbeats}
    workers = [FakeWorker("both", pause=pause), FakeWorker("both", pause=pause)]
    url = start_router([], workers)
    started = time.monotonic()
    resp = completion(url, "hello", max_tokens=6)
    took = time.monotonic() - started
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 6
    streams = sum(w.calls["/generate"] for w in workers)
    if heartbeats:
        assert (streams, took >= 7.0) == (1, True), (streams, took)
    else:
        assert streams == 2 and took < 7.0, (streams, took)


@pytest.mark.parametrize("roles", [("decode",), ("prefill",)], ids=["decode-only", "prefill-only"])
def test_ready_needs_a_usable_prefill_and_a_usable_decode_worker(start_router: Callable[..., str],
                                                                 roles: tuple[str, ...]) -> None:
    """Kubernetes routes to a router only once /ready says 200: with one kind of worker missing it must not."""
    prefill = [FakeWorker("prefill")] if "prefill" in roles else []
    decode = [FakeWorker("decode")] if "decode" in roles else []
    url = start_router(prefill, decode, wait_ready=False)
    limit = time.monotonic() + 20
    while httpx.get(f"{url}/health", timeout=5).json()["workers"].get(f"{roles[0]}_ready", 0) < 1:
        assert time.monotonic() < limit, "the router never saw its worker"
        time.sleep(0.1)
    ready = httpx.get(f"{url}/ready", timeout=5)
    assert ready.status_code == 503 and ready.json()["ready"] is False, ready.text
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # alive all the same


def test_ready_with_a_usable_prefill_and_decode_worker(start_router: Callable[..., str]) -> None:
    url = start_router([FakeWorker("prefill")], [FakeWorker("decode")], wait_ready=False)
    limit = time.monotonic() + 20
    while httpx.get(f"{url}/ready", timeout=5).status_code != 200:
        assert time.monotonic() < limit, "the router never became ready"
        time.sleep(0.1)


def test_sigterm_drains_open_streams_and_refuses_new_connections(
        start_router: Callable[..., str], router_procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """A stream open at SIGTERM gets every token; new connections are refused; the router then exits."""
    # Paused for longer than the 5 s uvicorn gave open connections before --drain-timeout existed.
    worker = FakeWorker("both", pause={"seconds": 7.0, "heartbeats": True})
    url = start_router([], [worker], "--drain-timeout", "20")
    proc = router_procs[url]
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                events.append(line)
                break  # the first token is out: the stream is open and paused on the worker
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
        events += [line for line in lines if line.startswith("data:")]
    assert events[-1] == "data: [DONE]", events
    text = "".join(json.loads(e[5:])["choices"][0]["text"] for e in events[:-1] if json.loads(e[5:])["choices"])
    assert len(events) >= 3 and text, events
    assert proc.wait(20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
