"""`tandem bench`'s exit status and pacing, against a tiny local HTTP server on 127.0.0.1.

The server is a stand-in for an OpenAI endpoint: it lists one model, answers the calibration
request, and streams a short completion, or refuses with HTTP 400 every streamed request (all of
them, or every second one), like a server that rejects what the benchmark sends. The real-server
versions of these runs are in tests/serving/test_cli.py.
"""

from __future__ import annotations

import http.server
import json
import math
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from click.testing import CliRunner

from tandem.worker.bench import workload
from tandem.worker.bench.client import RequestResult
from tandem.worker.bench.report import overall_failure
from tandem.worker.commands.bench import command as bench

REFUSAL = {"error": {"message": "the prompt is too long", "type": "invalid_request_error", "param": "prompt",
                     "code": "context_length_exceeded"}}


@dataclass
class Stub:
    url: str
    refuse_every: int  # refuse streamed request k when k % refuse_every == 0 (1: all of them)
    streamed: int = 0


@pytest.fixture
def stub() -> Iterator[Stub]:
    state = Stub("", refuse_every=1)
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self.reply(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            if not body.get("stream"):  # the calibration request
                self.reply(200, {"choices": [{"text": "x"}], "usage": {"prompt_tokens": 64, "completion_tokens": 1}})
                return
            with lock:
                state.streamed += 1
                refuse = state.streamed % state.refuse_every == 0
            if refuse:
                self.reply(400, REFUSAL)
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            for chunk in ({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                          {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 2}}):
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


def run_bench(*args: str) -> Any:
    return CliRunner().invoke(bench, list(args), catch_exceptions=False)


def test_every_request_refused_exits_1_with_the_count_and_first_error(stub: Stub) -> None:
    res = run_bench("--url", stub.url, "-n", "4", "--rate", "0", "--output-tokens", "2")
    assert res.exit_code == 1, res.output
    assert "0 completed, 4 failed" in res.output
    assert "bench failed: all 4 requests failed; the first error: HTTP 400" in res.output
    assert "context_length_exceeded" in res.output


def test_some_requests_refused_still_exits_0_and_counts_them(stub: Stub) -> None:
    stub.refuse_every = 2
    res = run_bench("--url", stub.url, "-n", "4", "--rate", "0", "--output-tokens", "2")
    assert res.exit_code == 0, res.output
    assert "2 completed, 2 failed" in res.output
    assert "bench failed" not in res.output


def test_rate_0_is_all_at_once_and_says_so(stub: Stub) -> None:
    stub.refuse_every = 10**9
    res = run_bench("--url", stub.url, "-n", "3", "--rate", "0")
    assert res.exit_code == 0, res.output
    assert "all 3 requests at once (--rate 0)" in res.output
    assert "req/s, " not in res.output.split("note: synthetic:")[1].splitlines()[0]


@pytest.mark.parametrize("rate", ["-1", "-0.5", "nan"])
def test_a_negative_rate_is_a_usage_error(rate: str) -> None:
    res = CliRunner().invoke(bench, ["--url", "http://127.0.0.1:1", "--rate", rate])
    assert res.exit_code == 2
    assert "is not a request rate" in res.output and "0 to send every request at once" in res.output


def test_overall_failure() -> None:
    ok = RequestResult("t", True, 0.0, ttft=0.1)
    bad = RequestResult("t", False, 0.0, error="HTTP 400: first")
    worse = RequestResult("t", False, 0.0, error="HTTP 500: second")
    assert overall_failure([bad, ok], 2) is None
    assert overall_failure([bad, worse], 2) == "all 2 requests failed; the first error: HTTP 400: first"
    assert "none of the 5 requests was sent" in str(overall_failure([], 5))


def test_arrivals_all_at_once_and_paced() -> None:
    rng = random.Random(0)
    assert workload.arrivals(3, 0.0, "poisson", rng) == [0.0, 0.0, 0.0]
    assert workload.arrivals(2, math.inf, "constant", rng) == [0.0, 0.0]
    assert workload.arrivals(3, 2.0, "constant", rng) == [0.0, 0.5, 1.0]
    assert workload.all_at_once(0.0) and not workload.all_at_once(0.1)


def test_a_trace_scaled_by_0_is_sent_all_at_once() -> None:
    rows = [workload.TraceRow(float(t), 100, 10, []) for t in (0, 1, 2)]
    specs, scaling = workload.scale_trace(rows, rate=None, time_scale=0.0, target_median_prompt=50,
                                          length_scale=None, max_prompt_tokens=1024, max_output_tokens=128)
    assert [s.send_at for s in specs] == [0.0, 0.0, 0.0]
    assert "all at once" in scaling.description
