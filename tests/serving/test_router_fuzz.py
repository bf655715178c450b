"""A bounded fuzz run of the router's OpenAPI schema (schemathesis) against a real `tandem serve` stack.

schemathesis reads the router's own /openapi.json (the request bodies are the pydantic models that
parse_body validates with) and sends generated requests, valid and invalid ones (its examples,
coverage and fuzzing phases; positive and negative data), to every route it lists: /v1/completions,
/v1/chat/completions, /v1/models, /health, /ready, /metrics and /workers. Asserted for each answer:
no 5xx; every 4xx body in OpenAI's error shape ({"error": {"message": str, "type": str, ...}}); a
streamed answer is well-formed SSE with no server error in it. Afterwards the stack is alive, ready,
and its greedy completion is still transformers' (and the one it gave before the run).

Bounded twice: hypothesis' max_examples per route, and a wall-clock budget per route after which the
remaining examples are skipped without a request. Generated `max_tokens` are capped, so that a valid
request generates a few tokens, not the model's whole context.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tandem.worker.server.control_token import ENV_TOKEN, HEADER

from .conftest import Stack, wait_until_disaggregated

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis runs the fuzz (test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

API_KEY = "fuzz-run-key"
MAX_EXAMPLES = 60  # per route; GET routes without parameters have one or two distinct cases anyway
ROUTE_BUDGET_S = 30.0  # per route: after this, the rest of its examples are skipped (no request)
MAX_TOKENS_CAP = 4  # generated max_tokens above this are lowered to it: each valid request generates little
REQUEST_TIMEOUT_S = 30.0
PROMPT = [1, 2, 3, 4, 5, 6, 7]  # token ids of the health check completion
CHECK_TOKENS = 8


def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}", HEADER: os.environ[ENV_TOKEN]}


def greedy_ids(stack: Stack) -> list[int]:
    r = httpx.post(f"{stack.url}/v1/completions", headers=auth_headers(), timeout=60, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": CHECK_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return list(choice["token_ids"])


@pytest.fixture(scope="module")
def fuzz_stack(start_stack: Callable[..., Stack]) -> Iterator[tuple[Stack, list[int]]]:
    """A disaggregated stack of its own (the run must not disturb the shared ones), with an API key, and its
    greedy answer before the run."""
    stack = start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1",
                        "--api-key", API_KEY)
    wait_until_disaggregated(stack)
    yield stack, greedy_ids(stack)


@pytest.fixture(scope="module")
def router_schema(fuzz_stack: tuple[Stack, list[int]]) -> Any:
    stack, _ = fuzz_stack
    raw = httpx.get(f"{stack.url}/openapi.json", headers=auth_headers(), timeout=10).json()
    # The schema says `model` is a string: almost every generated one names no served model and ends at the
    # 404. Here it is the served one, so that valid requests reach the tokenizer, the sampling checks and the
    # workers; the negative phase still sends other names (and other types) for it.
    for name in ("CompletionRequest", "ChatRequest"):
        raw["components"]["schemas"][name]["properties"]["model"] = {"const": "tiny"}
    config = schemathesis.Config.from_dict({"base-url": stack.url})
    return schemathesis.openapi.from_dict(raw, config=config)


# (method, path, generation modes). The GET routes take no parameters: there is nothing to make invalid.
ROUTES = [
    ("POST", "/v1/completions", ("positive", "negative")),
    ("POST", "/v1/chat/completions", ("positive", "negative")),
    ("GET", "/v1/models", ("positive",)),
    ("GET", "/health", ("positive",)),
    ("GET", "/ready", ("positive",)),
    ("GET", "/metrics", ("positive",)),
    ("GET", "/workers", ("positive",)),
]
counts: dict[str, dict[int, int]] = {}


def cap_max_tokens(body: Any) -> None:
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS_CAP:
                body[key] = MAX_TOKENS_CAP


def openai_error_shape(_ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis check: a 4xx body is OpenAI's {"error": {"message": str, "type": str, ...}}."""
    if 400 <= response.status_code < 500:
        try:
            body = json.loads(response.content)
        except ValueError:
            raise AssertionError(f"{case.operation.label}: {response.status_code} without a JSON body: "
                                 f"{response.content[:300]!r}") from None
        error = body.get("error") if isinstance(body, dict) else None
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and \
            isinstance(error.get("type"), str), \
            f"{case.operation.label}: {response.status_code} not in OpenAI's error shape: {body!r}"
    return None


def well_formed_stream(_ctx: Any, response: Any, case: Any) -> bool | None:
    """schemathesis check: an SSE answer's events are JSON (or [DONE], last), and none is a server error."""
    types = [v for k, vs in response.headers.items() if k.lower() == "content-type" for v in vs]
    if response.status_code == 200 and types and types[0].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.content.decode().splitlines() if line.startswith("data: ")]
        # schemathesis reads at most 20 events of a stream (stream_cut_short): a longer one (n > 1, a batch of
        # prompts) cannot show its [DONE]
        assert events and (events[-1] == "[DONE]" or getattr(response, "stream_cut_short", False)), \
            f"{case.operation.label}: the stream did not end with [DONE]"
        for event in events[:-1]:
            data = json.loads(event)
            error = data.get("error")
            assert error is None or error.get("type") != "server_error", f"{case.operation.label}: {event}"
    return None


def not_5xx(_ctx: Any, response: Any, case: Any) -> bool | None:
    assert response.status_code < 500, (f"{case.operation.label}: {response.status_code} "
                                        f"{response.content[:500]!r}")
    return None


@pytest.mark.parametrize(("method", "path", "mode"), [(m, p, mode) for m, p, modes in ROUTES for mode in modes],
                         ids=[f"{m} {p} {mode}" for m, p, modes in ROUTES for mode in modes])
def test_fuzz_router_openapi(router_schema: Any, method: str, path: str, mode: str) -> None:
    """schemathesis' strategy for one route (its Python API: APIOperation.as_strategy), run by hypothesis."""
    operation = router_schema[path][method]
    label = f"{method} {path} {mode}"
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    start = time.monotonic()

    @given(case=strategy)
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    def run(case: Any) -> None:
        if time.monotonic() - start > ROUTE_BUDGET_S:
            return  # this route's time is spent: the remaining examples send nothing
        cap_max_tokens(case.body)
        response = case.call(headers=auth_headers(), timeout=REQUEST_TIMEOUT_S)
        per_status = counts.setdefault(label, {})
        per_status[response.status_code] = per_status.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_5xx, openai_error_shape, well_formed_stream])

    run()


def test_the_stack_is_alive_and_right_after_the_fuzz_run(fuzz_stack: tuple[Stack, list[int]],
                                                         hf_greedy: Callable[[list[int], int], list[int]]) -> None:
    stack, before = fuzz_stack
    print("fuzz run, answers per route and status:", json.dumps(counts, sort_keys=True))
    assert counts, "the fuzz run sent nothing (run this file whole: the fuzz test comes first)"
    assert stack.popen.poll() is None, stack.log.read_text()[-3000:]
    assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{stack.url}/ready", timeout=10).status_code == 200
    after = greedy_ids(stack)
    assert after == before == hf_greedy(PROMPT, CHECK_TOKENS)
