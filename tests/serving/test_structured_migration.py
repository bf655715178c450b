"""A grammar-constrained stream survives its decode worker (issue 20): killed mid-stream, the request
migrates to another decode worker, which rebuilds the grammar state from the tokens so far, and the
client gets the answer it gets undisturbed, still valid against its schema.

A real `tandem serve` stack (1 prefill, 2 decode workers; tests/serving/conftest.py) and the official
openai client, greedy and seeded-sampled (the seeded generator skips the draws already made).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema_rs
import pytest
from openai import OpenAI

from .conftest import Stack, control_headers, metric_value

pytestmark = pytest.mark.integration

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "story", "stars"],
          "properties": {"title": {"type": "string", "maxLength": 10},
                         "story": {"type": "string", "minLength": 80, "maxLength": 100},
                         "stars": {"type": "integer", "minimum": 1, "maximum": 5}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA, "strict": True}}
MESSAGES: list[Any] = [{"role": "user", "content": "Review a film."}]


@pytest.fixture(scope="module")
def stack(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "2")


def stream(stack: Stack, on_chunk: Callable[[int], None] | None = None, **kw: Any) -> tuple[str, str | None]:
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    text, finish, chunks = "", None, 0
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                                response_format=FORMAT, stream=True, **kw):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            chunks += 1
            if on_chunk:
                on_chunk(chunks)
    return text, finish


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_a_constrained_stream_migrates_with_its_grammar(stack: Stack, sampling: dict[str, Any]) -> None:
    undisturbed, finish = stream(stack, **sampling)
    assert finish == "stop"
    jsonschema_rs.validate(SCHEMA, json.loads(undisturbed))
    migrations = metric_value(stack.url, "tandem_migrations_total")
    # The state file as tandem serve keeps it: the decode worker the first case killed is restarted (a new
    # pid, written once it is started again: 1 s after it exited, longer on a busy machine).
    limit = time.monotonic() + 60
    while True:
        state = json.loads((stack.log.parent / "state.json").read_text())
        alive = [p for p in state["processes"] if p["role"] == "decode" and _alive(p["pid"])]
        if len(alive) == 2 or time.monotonic() > limit:
            break
        time.sleep(0.5)
    assert len(alive) == 2, state
    _wait_usable(stack, {p["url"] for p in alive})
    killed: list[int] = []

    def kill_busy_decode(count: int) -> None:
        if count != 12 or killed:
            return
        for p in alive:
            if httpx.get(f"{p['url']}/info", headers=control_headers(), timeout=5).json()["stats"]["num_running"]:
                os.kill(p["pid"], signal.SIGKILL)
                killed.append(p["pid"])
                return

    disturbed, finish = stream(stack, kill_busy_decode, **sampling)
    assert killed, "no decode worker was running the request after 12 chunks"
    assert metric_value(stack.url, "tandem_migrations_total") == migrations + 1
    assert finish == "stop"
    assert disturbed == undisturbed
    jsonschema_rs.validate(SCHEMA, json.loads(disturbed))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_usable(stack: Stack, decode_urls: set[str], timeout: float = 60) -> None:
    """Until the router routes to every one of `decode_urls` (a restarted worker is back once it has loaded)."""
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        workers = httpx.get(f"{stack.url}/workers", headers=control_headers(), timeout=5).json()
        if decode_urls <= {w["url"] for w in workers if w["usable"]}:
            return
        time.sleep(0.3)
    pytest.fail(f"the router does not route to all of {sorted(decode_urls)}")
