"""Malformed requests get OpenAI-style 4xx errors, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from .conftest import Stack, metric_value

pytestmark = pytest.mark.integration


def post(stack: Stack, path: str, body: bytes | dict) -> httpx.Response:  # type: ignore[type-arg]
    if isinstance(body, dict):
        return httpx.post(f"{stack.url}{path}", json=body, timeout=30)
    return httpx.post(f"{stack.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 30}, 400, "n"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi " * 3000}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": 42}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages.0.content"),
], ids=["bad-json", "not-an-object", "no-prompt", "max-tokens-type", "temperature-range", "max-tokens-zero",
        "empty-prompt", "token-out-of-vocab", "n>1", "unknown-model", "prompt-too-long", "too-many-tokens",
        "no-messages", "bad-role", "messages-type", "best-of", "stream-string", "max-tokens-bool", "prompt-type",
        "message-without-content"])
def test_bad_request_gets_openai_error(mono: Stack, path: str, body: bytes | dict, status: int,  # type: ignore[type-arg]
                                       param: str | None) -> None:
    resp = post(mono, path, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    assert err["param"] == param
    # ...and the server still answers a good request.
    ok = post(mono, "/v1/completions", {"model": "tiny", "prompt": "still alive?", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_sees_typed_errors(disagg: Stack) -> None:
    c = openai.OpenAI(base_url=f"{disagg.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="tiny", prompt="word " * 5000, max_tokens=4)
    assert "context length" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="hi", stream=True, max_tokens=4, top_p=0)
    assert c.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens >= 1


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/completions", 405), ("POST", "/v1/embeddings", 404), ("GET", "/nope", 404),
    ("DELETE", "/v1/chat/completions", 405),
])
def test_unknown_paths_and_methods_get_openai_errors(mono: Stack, method: str, path: str, status: int) -> None:
    resp = httpx.request(method, f"{mono.url}{path}", timeout=10)
    assert resp.status_code == status
    assert set(resp.json()) == {"error"}
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"] == "invalid_request_error"


def test_refused_requests_are_counted(mono: Stack) -> None:
    def errors() -> float:
        return metric_value(mono.url, "tandem_requests_total", pool="router", reason="error")

    before = errors()
    bad = [{"model": "tiny", "prompt": "hi", "max_tokens": "x"}, {"model": "nope", "prompt": "hi"},
           {"model": "tiny", "prompt": "hi", "stream": True, "best_of": 4}]
    for body in bad:
        assert post(mono, "/v1/completions", body).status_code in (400, 404)
    assert post(mono, "/v1/completions", b"{").status_code == 400
    assert errors() == before + len(bad) + 1
    assert metric_value(mono.url, "tandem_migrations_total", pool="router") == 0.0
    text = httpx.get(f"{mono.url}/metrics", timeout=5).text
    assert 'tandem_migrations_total{model="tiny",pool="router",role="router"} 0.0' in text
