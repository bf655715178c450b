"""Hostile and broken input (issue 18): one bad request fails alone, never the stack.

Each test is a repro from the adversarial review, run against a real `tandem serve` stack:
- a temperature that underflows float32 (1e-50) used to make `multinomial` raise inside the engine
  step, which failed every request on the worker; the router then retried the poison on every
  worker and migrated the innocent streams, marking each worker down;
- a request whose logits are NaN (a model with a NaN embedding) must fail alone in the same way;
- a lone surrogate in a prompt and JSON nested 100,000 deep were 500s that leaked exception text;
- the worker control API took a reservation deadline of 1e6 s, any number of reservations, and a
  `sampled_before` of 300,000 (26 s of the engine thread).
The router's side of a request's own failure (not retried, not migrated, no worker marked down) is
tested against scripted workers and a real router: a real engine has no input left that fails that way.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from .conftest import Stack, control_headers, metric_value, wait_until_disaggregated
from .test_router_robustness import ScriptedHandler, router_procs, serve_scripted, start_router  # noqa: F401 (fixtures, used by name)

pytestmark = pytest.mark.integration

INNOCENT_TOKENS = 48


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack]) -> Stack:
    # Two decode workers: a poison that fails a worker's whole batch would show as migrations and a
    # worker marked down; one request's own failure must show as neither.
    s = start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "2")
    wait_until_disaggregated(s)
    return s


def stream_tokens(stack: Stack, prompt: str | list[int], max_tokens: int) -> tuple[int, str | None, list[str]]:
    """Stream a completion; returns (tokens received, finish_reason, error messages seen in the stream)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    count, reason, errors = 0, None, []
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: "):])
            if "error" in data:
                errors.append(data["error"]["message"])
                continue
            choice = data["choices"][0]
            count += len(choice.get("token_ids") or [])
            reason = choice.get("finish_reason") or reason
    return count, reason, errors


def test_an_underflowing_temperature_hurts_no_other_stream(stack: Stack) -> None:
    done = threading.Event()
    poison_answers: list[httpx.Response] = []

    def poison() -> None:
        # Sent again and again while the innocent streams run, so some land in their batches.
        while not done.is_set():
            poison_answers.append(httpx.post(f"{stack.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "poison", "max_tokens": 8, "temperature": 1e-50}))

    with ThreadPoolExecutor(4) as pool:
        sender = pool.submit(poison)
        innocents = [pool.submit(stream_tokens, stack, f"innocent request {i}", INNOCENT_TOKENS) for i in range(3)]
        results = [f.result() for f in innocents]
        done.set()
        sender.result()
    assert results == [(INNOCENT_TOKENS, "length", [])] * 3
    assert poison_answers
    for resp in poison_answers:
        # A normal (greedy) answer, or a clear refusal: never a server error.
        assert resp.status_code == 200 or 400 <= resp.status_code < 500, resp.text
        if resp.status_code == 200:
            assert resp.json()["usage"]["completion_tokens"] == 8 or resp.json()["choices"][0]["finish_reason"] == "stop"
    assert metric_value(stack.url, "tandem_migrations_total") == 0
    workers = httpx.get(f"{stack.url}/workers", headers=control_headers(), timeout=5).json()
    assert all(w["usable"] for w in workers), workers


POISON_TOKEN = 77  # its embedding is NaN in the model below: every prompt holding it has NaN logits


@pytest.fixture(scope="module")
def nan_stack(start_stack: Callable[..., Stack], tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """A stack serving the tiny model with one token's embedding set to NaN: a real engine whose output
    for some requests (those with that token) is not a number, and for every other request is fine."""
    from safetensors.torch import load_file, save_file

    from tandem.worker.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-nan")
    weights = load_file(str(model / "model.safetensors"))
    weights["model.embed_tokens.weight"][POISON_TOKEN] = float("nan")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    s = start_stack("--model", str(model), "--mode", "disaggregated", "--prefill-workers", "1",
                    "--decode-workers", "2")
    wait_until_disaggregated(s)
    return s


def test_nan_logits_fail_their_request_alone(nan_stack: Stack) -> None:
    done = threading.Event()
    poison_answers: list[httpx.Response] = []

    def poison() -> None:
        while not done.is_set():
            poison_answers.append(httpx.post(f"{nan_stack.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": [5, POISON_TOKEN, 7], "max_tokens": 8, "temperature": 0.7}))

    def innocent(i: int) -> tuple[int, str | None, list[str]]:
        return stream_tokens(nan_stack, [100 + i, *range(200, 220)], INNOCENT_TOKENS)

    with ThreadPoolExecutor(4) as pool:
        sender = pool.submit(poison)
        results = [f.result() for f in [pool.submit(innocent, i) for i in range(3)]]
        done.set()
        sender.result()
    assert results == [(INNOCENT_TOKENS, "length", [])] * 3
    assert poison_answers
    for resp in poison_answers:  # a clear message, once, and not an exception's text
        assert resp.status_code == 500, resp.text
        assert resp.json()["error"]["code"] == "request_failed"
        assert "not a number" in resp.json()["error"]["message"]
    assert metric_value(nan_stack.url, "tandem_migrations_total") == 0
    workers = httpx.get(f"{nan_stack.url}/workers", headers=control_headers(), timeout=5).json()
    assert all(w["usable"] for w in workers), workers


def test_a_tiny_temperature_is_greedy(stack: Stack) -> None:
    def complete(temperature: float) -> list[int]:
        resp = httpx.post(f"{stack.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "the same prompt", "max_tokens": 12, "ignore_eos": True,
            "temperature": temperature, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        return list(resp.json()["choices"][0]["token_ids"])

    assert complete(1e-50) == complete(0.0)


@pytest.mark.parametrize(("extra", "param"), [
    ({"temperature": float("nan")}, "temperature"), ({"top_p": float("inf")}, "top_p"),
    ({"seed": 2**70}, "seed"), ({"top_k": 2**70}, "top_k"), ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
], ids=["nan-temperature", "inf-top-p", "huge-seed", "huge-top-k", "negative-stop-token"])
def test_out_of_range_sampling_is_a_400(stack: Stack, extra: dict[str, object], param: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, **extra})  # NaN/Infinity as Python writes them
    resp = httpx.post(f"{stack.url}/v1/completions", content=body, headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] in (param, None), resp.text
    assert metric_value(stack.url, "tandem_migrations_total") == 0


@pytest.mark.parametrize("body", [
    b'{"model": "tiny", "prompt": "a lone \\ud800 surrogate", "max_tokens": 2}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b"[" * 100_000 + b"]" * 100_000,
], ids=["surrogate-prompt", "surrogate-message", "deep-prompt", "deep-body"])
def test_hostile_json_is_a_4xx_in_openai_shape(stack: Stack, body: bytes) -> None:
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    resp = httpx.post(f"{stack.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert 400 <= resp.status_code < 500, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert "Error" not in err["message"], err  # no exception class names (RecursionError, UnicodeEncodeError...)
    ok = httpx.post(f"{stack.url}/v1/completions", json={"model": "tiny", "prompt": "alive?", "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200


def test_a_surrogate_pair_is_still_fine(stack: Stack) -> None:
    body = b'{"model": "tiny", "prompt": "an emoji \\ud83d\\ude00", "max_tokens": 2}'
    resp = httpx.post(f"{stack.url}/v1/completions", content=body, headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code == 200, resp.text


def worker_url(stack: Stack, role: str) -> str:
    return str(stack.procs(role)[0]["url"])


def test_reservation_deadline_is_capped(stack: Stack) -> None:
    decode = worker_url(stack, "decode")
    resp = httpx.post(f"{decode}/kv/reserve", headers=control_headers(), timeout=10,
                      json={"request_id": "hostile-deadline", "num_tokens": 16, "deadline_s": 1e6})
    assert resp.status_code == 400, resp.text
    assert "deadline_s" in resp.json()["error"]["message"]


def test_one_peer_cannot_reserve_the_whole_kv_pool(stack: Stack) -> None:
    decode = worker_url(stack, "decode")
    total = httpx.get(f"{decode}/info", headers=control_headers(), timeout=5).json()["stats"]["num_total_blocks"]
    granted: list[str] = []
    refused: list[httpx.Response] = []
    try:
        for i in range(64):
            resp = httpx.post(f"{decode}/kv/reserve", headers=control_headers(), timeout=10,
                              json={"request_id": f"hostile-{i}", "num_tokens": 1000, "deadline_s": 60})
            (granted.append(f"hostile-{i}") if resp.status_code == 200 else refused.append(resp))
        assert refused and all(r.status_code in (429, 503) for r in refused), [r.text for r in refused[:3]]
        free = httpx.get(f"{decode}/info", headers=control_headers(), timeout=5).json()["stats"]["num_free_blocks"]
        assert free >= total // 3, f"{free} of {total} blocks left free"
        # Real traffic on that worker still runs.
        resp = httpx.post(f"{decode}/generate", headers=control_headers(), timeout=30, json={
            "request_id": "after-hostile", "prompt_token_ids": list(range(5, 300)),
            "sampling": {"max_tokens": 4, "temperature": 0}})
        assert resp.status_code == 200 and '"finished":true' in resp.text, resp.text
    finally:
        for rid in granted:
            httpx.post(f"{decode}/kv/cancel", json={"request_id": rid}, headers=control_headers(), timeout=10)


def test_sampled_before_is_capped(stack: Stack) -> None:
    decode = worker_url(stack, "decode")
    started = time.monotonic()
    resp = httpx.post(f"{decode}/generate", headers=control_headers(), timeout=60, json={
        "request_id": "hostile-skip", "prompt_token_ids": [5, 6, 7],
        "sampling": {"max_tokens": 2, "temperature": 1.0, "seed": 1}, "sampled_before": 300_000})
    assert resp.status_code == 400, resp.text
    assert "sampled_before" in resp.json()["error"]["message"]
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"request_id": "w1", "prompt_token_ids": [5, 6], "sampling": {"temperature": float("nan")}}),
    ("/generate", {"request_id": "w2", "prompt_token_ids": [5, 6], "sampling": {"seed": 2**70}}),
    ("/generate", {"request_id": "w3", "prompt_token_ids": [5, 6], "sampling": {}, "deadline_s": float("inf")}),
    ("/kv/reserve", {"request_id": "w4", "num_tokens": 10**9}),
], ids=["nan-temperature", "huge-seed", "infinite-deadline", "huge-reservation"])
def test_worker_refuses_out_of_range_input_with_a_400(stack: Stack, path: str, body: dict[str, object]) -> None:
    decode = worker_url(stack, "decode")
    resp = httpx.post(f"{decode}{path}", content=json.dumps(body),
                      headers={"content-type": "application/json", **control_headers()},
                      timeout=30)
    assert resp.status_code == 400, resp.text
    assert httpx.get(f"{decode}/health", timeout=5).status_code == 200


def test_worker_treats_an_underflowing_temperature_as_greedy(stack: Stack) -> None:
    decode = worker_url(stack, "decode")

    def generate(rid: str, temperature: float) -> list[int]:
        resp = httpx.post(f"{decode}/generate", headers=control_headers(), timeout=30, json={
            "request_id": rid, "prompt_token_ids": [5, 6, 7, 8],
            "sampling": {"max_tokens": 6, "temperature": temperature, "ignore_eos": True}})
        assert resp.status_code == 200, resp.text
        chunks = [json.loads(line) for line in resp.text.splitlines() if line.strip()]
        assert not any(c.get("error") for c in chunks), chunks
        return [t for c in chunks for t in c["token_ids"]]

    assert generate("tiny-t", 1e-50) == generate("zero-t", 0.0)


class FailingWorker:
    """A scripted worker whose engine fails every request on its own (the request's fault, not the
    worker's): /generate and /decode end with a request_error chunk, /prefill answers 422."""

    MESSAGE = "the model's output for this request is not a number (NaN or infinite logits)"

    def __init__(self, role: str) -> None:
        self.role = role
        self.calls: Counter[str] = Counter()
        worker = self

        class Handler(ScriptedHandler):
            def do_GET(self) -> None:
                self._info_or_404(worker.info())

            def do_POST(self) -> None:
                body = self._body()
                worker.calls[self.path] += 1
                if self.path == "/kv/reserve":
                    self._json({"transfer_id": body["request_id"], "kv_address": "tcp://127.0.0.1:9",
                                "block_ids": [0], "layout_hash": "fake"})
                elif self.path == "/prefill":
                    self._json({"error": {"message": FailingWorker.MESSAGE}}, 422)
                elif self.path in ("/decode", "/generate"):
                    chunk = {"finished": True, "finish_reason": "error", "error": FailingWorker.MESSAGE,
                             "request_error": True}
                    self._send(json.dumps(chunk).encode() + b"\n", "application/x-ndjson")
                else:
                    self._json({})

        self.server, self.url = serve_scripted(Handler)

    def info(self) -> dict[str, Any]:
        return {"api_version": 3, "model": "tiny", "role": self.role, "pool": "local", "layout_hash": "fake",
                "kv_address": None, "transport": "tcp", "max_model_len": 2048, "block_size": 16, "ready": True,
                "draining": False, "load_progress": 1.0, "stats": {"num_free_blocks": 1000, "queued_prompt_tokens": 0}}


def assert_failed_alone(router: str, workers: list[FailingWorker], path: str) -> None:
    resp = httpx.post(f"{router}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=60)
    assert resp.status_code == 500, resp.text
    err = resp.json()["error"]
    assert err["code"] == "request_failed" and err["message"] == FailingWorker.MESSAGE, err
    # Tried once, on one worker: not retried elsewhere, not migrated...
    assert sum(w.calls[path] for w in workers) == 1, [dict(w.calls) for w in workers]
    # ...and no worker was marked down for it.
    listed = httpx.get(f"{router}/workers", headers=control_headers(), timeout=5).json()
    assert all(w["up"] and w["usable"] for w in listed), listed


def test_router_neither_migrates_nor_marks_down_a_requests_own_failure(request: pytest.FixtureRequest) -> None:
    decode = [FailingWorker("both"), FailingWorker("both")]
    router = request.getfixturevalue("start_router")([], decode)
    assert_failed_alone(router, decode, "/generate")


def test_router_does_not_retry_a_prefill_that_failed_on_its_own(request: pytest.FixtureRequest) -> None:
    prefill = [FailingWorker("prefill"), FailingWorker("prefill")]
    decode = FailingWorker("decode")
    router = request.getfixturevalue("start_router")(prefill, [decode])
    assert_failed_alone(router, prefill, "/prefill")
    assert decode.calls["/kv/cancel"] == 1  # the reservation made for it was given back
