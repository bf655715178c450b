"""Structured outputs and tool calls through a real `tandem router` against scripted workers (issue 20):
- a rolling upgrade: a worker older than control API 4 ignores `sampling.grammar` (and the penalties,
  logit_bias, min_tokens, top_logprobs), so a request that sets one never goes to it, on either pool;
  with only such workers it is a 503 that says why, while plain requests are served as before;
- Mistral's `[TOOL_CALLS]` as a special token of the tokenizer: the router's text skips special tokens,
  yet `tool_choice: auto` reads the call (from the token ids).

The workers are the scripted HTTP servers of test_router_robustness.py: they report the `api_version`
a test gives them and stream the tokens it gives them, and count the calls they get.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_router_robustness import ScriptedHandler, router_procs, serve_scripted, start_router  # noqa: F401 (fixtures)

# ruff: noqa: F811 (the fixtures above are used by name, as parameters, which ruff reads as redefinitions)

pytestmark = pytest.mark.integration

TOKEN = 65  # what the workers answer unless told otherwise
JSON_OBJECT = {"type": "json_object"}


class VersionedWorker:
    """A worker of `role` that reports control API `api_version` and answers `tokens` (the first from
    /prefill, the rest from /decode, all of them from /generate)."""

    def __init__(self, role: str, api_version: int, free_blocks: int = 1000, tokens: list[int] | None = None) -> None:
        self.role, self.api_version, self.free_blocks = role, api_version, free_blocks
        self.tokens = tokens
        self.calls: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        worker = self

        class Handler(ScriptedHandler):
            def do_GET(self) -> None:
                self._info_or_404(worker.info())

            def do_POST(self) -> None:
                body = self._body()
                worker.calls[self.path] += 1
                worker.bodies.append(body)
                if self.path == "/kv/reserve":
                    self._json({"transfer_id": body["request_id"], "kv_address": "tcp://127.0.0.1:9",
                                "block_ids": [0], "layout_hash": "fake"})
                elif self.path == "/prefill":
                    self._json({"first_token_id": worker.answer(body)[0],
                                "num_prompt_tokens": len(body["prompt_token_ids"]), "kv_sent": True})
                elif self.path in ("/decode", "/generate"):
                    tokens = worker.answer(body)[1 if self.path == "/decode" else 0:]
                    finish = "length" if worker.tokens is None else "stop"
                    line = {"token_ids": tokens, "finished": True, "finish_reason": finish}
                    self._send(json.dumps(line).encode() + b"\n", "application/x-ndjson")
                else:
                    self._json({})

        self.server, self.url = serve_scripted(Handler)

    def answer(self, body: dict[str, Any]) -> list[int]:
        return self.tokens if self.tokens is not None else [TOKEN] * body["sampling"]["max_tokens"]

    def generated(self) -> int:
        """Calls that produced tokens here."""
        return self.calls["/generate"] + self.calls["/decode"] + self.calls["/prefill"]

    def info(self) -> dict[str, Any]:
        return {"api_version": self.api_version, "model": "tiny", "role": self.role, "pool": "local",
                "layout_hash": "fake", "kv_address": None, "transport": "tcp", "max_model_len": 2048,
                "block_size": 16, "ready": True, "draining": False, "load_progress": 1.0,
                "stats": {"num_free_blocks": self.free_blocks, "queued_prompt_tokens": 0}}


def completion(url: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3, **kw},
                      timeout=60)


@pytest.mark.parametrize("fields", [{"response_format": JSON_OBJECT}, {"guided_regex": "[0-9]+"},
                                    {"presence_penalty": 0.5}, {"logit_bias": {"7": 5}}])
def test_a_request_setting_a_newer_field_goes_only_to_workers_that_honour_it(
        start_router: Callable[..., str], fields: dict[str, Any]) -> None:
    # The old worker has more free KV blocks, so placement alone would choose it every time.
    old, new = VersionedWorker("both", 3, free_blocks=5000), VersionedWorker("both", 4)
    url = start_router([], [old, new])
    for _ in range(3):
        resp = completion(url, **fields)
        assert resp.status_code == 200, resp.text
    assert old.generated() == 0 and new.generated() == 3, (dict(old.calls), dict(new.calls))
    assert completion(url).status_code == 200  # a plain request may still go to the old worker: it does
    assert old.generated() == 1


def test_both_pools_of_a_disaggregated_request_honour_its_grammar(start_router: Callable[..., str]) -> None:
    old_prefill, new_prefill = VersionedWorker("prefill", 3), VersionedWorker("prefill", 4)
    old_decode, new_decode = VersionedWorker("decode", 3, free_blocks=5000), VersionedWorker("decode", 4)
    url = start_router([old_prefill, new_prefill], [old_decode, new_decode], "--placement", "round-robin")
    for _ in range(4):
        resp = completion(url, response_format=JSON_OBJECT)
        assert resp.status_code == 200, resp.text
    assert sum(old_prefill.calls.values()) == 0 and sum(old_decode.calls.values()) == 0, \
        (dict(old_prefill.calls), dict(old_decode.calls))
    assert new_prefill.calls["/prefill"] == 4 and new_decode.calls["/decode"] == 4
    assert all(b["sampling"]["grammar"] == {"kind": "json_object", "spec": ""}
               for b in new_prefill.bodies + new_decode.bodies if "sampling" in b)


def test_prefill_workers_too_old_for_the_grammar_leave_the_request_to_its_decode_worker(
        start_router: Callable[..., str]) -> None:
    prefill, decode = VersionedWorker("prefill", 3), VersionedWorker("decode", 4)
    url = start_router([prefill], [decode])
    resp = completion(url, response_format=JSON_OBJECT)
    assert resp.status_code == 200, resp.text
    assert prefill.calls["/prefill"] == 0 and decode.calls["/generate"] == 1  # a local prefill: slower, right


def test_with_only_older_workers_a_grammar_is_a_503_that_says_why(start_router: Callable[..., str]) -> None:
    old = VersionedWorker("both", 3)
    url = start_router([], [old])
    resp = completion(url, response_format=JSON_OBJECT)  # waits WAIT_FOR_WORKER_S (10 s) for a newer one
    assert resp.status_code == 503, resp.text
    message = resp.json()["error"]["message"]
    assert "control API version 4 or later" in message and "(version 3)" in message and "grammar" in message
    assert old.generated() == 0
    assert completion(url).status_code == 200 and old.generated() == 1  # the rest is served as before


# --- Mistral's [TOOL_CALLS] ---

MISTRAL_MARK = "[TOOL_CALLS]"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def mistral_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with `[TOOL_CALLS]` added to its tokenizer as a special token, as Mistral's tokenizers
    have it (so decoding with skip_special_tokens drops it)."""
    from tandem.worker.model.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("mistral-tokenizer")
    for f in tiny_model.iterdir():
        shutil.copy(f, path / f.name)
    tok = build_tokenizer()
    tok.add_special_tokens([MISTRAL_MARK])
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_mistral_call_whose_marker_is_a_special_token(start_router: Callable[..., str],
                                                                   mistral_model: Path, stream: bool) -> None:
    from tandem.worker.model.tokenizer import Tokenizer

    tok = Tokenizer(mistral_model)
    mark = tok.backend.token_to_id(MISTRAL_MARK)
    call = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    tokens = [mark, *tok.encode(call, add_special_tokens=False), min(tok.eos_token_ids)]
    assert tok.decode(tokens) == call  # what the router's text holds: no marker
    worker = VersionedWorker("both", 4, tokens=tokens)
    url = start_router([], [worker], "--model", str(mistral_model))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
            "max_tokens": 64, "stream": stream}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    if stream:
        chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        calls = [c for ch in chunks for d in [ch["choices"][0]["delta"]] for c in d.get("tool_calls") or []]
        finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]]
        content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
    else:
        message = resp.json()["choices"][0]["message"]
        calls, content = message.get("tool_calls") or [], message["content"] or ""
        finish = [resp.json()["choices"][0]["finish_reason"]]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo"})], resp.text
    assert content == "" and finish == ["tool_calls"]
