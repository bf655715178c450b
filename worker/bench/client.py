"""Sends benchmark requests to an OpenAI-compatible /v1/completions and times every token.

Streams with `stream_options.include_usage` so token counts come from the server, and
`ignore_eos` so each request generates the length it asked for. A token's time is when its SSE
chunk arrives (what a client sees), so ITL includes the network and the router.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tandem.worker.bench.workload import RequestSpec


@dataclass
class RequestResult:
    tag: str
    ok: bool
    start: float  # monotonic send time
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # filled when asked for (send_one's token_ids)


async def model_name(client: httpx.AsyncClient, url: str) -> str:
    resp = await client.get(f"{url}/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data", [])
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


async def calibrate(client: httpx.AsyncClient, url: str, model: str, sample: str) -> float:
    """Tokens per word of `sample` on the target's tokenizer (from its usage count)."""
    resp = await client.post(f"{url}/v1/completions", json={
        "model": model, "prompt": sample, "max_tokens": 1, "temperature": 0})
    resp.raise_for_status()
    tokens = int(resp.json()["usage"]["prompt_tokens"])
    return max(0.1, tokens / len(sample.split()))


async def send_one(client: httpx.AsyncClient, url: str, model: str, spec: RequestSpec, prompt: str | list[int],
                   timeout: float, token_ids: bool = False) -> RequestResult:
    """One streamed completion; a chunk's time is when it reaches this client.

    A server sends a chunk when new text is ready, so a token whose text is still empty (an
    incomplete UTF-8 sequence) reaches the client with the next one. `token_ids` asks for vLLM's
    `return_token_ids`, with which Tandem's router sends one chunk per token: per-token ITL.
    """
    body: dict[str, object] = {
        "model": model, "prompt": prompt, "max_tokens": spec.output_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0,
    }
    if token_ids:
        body["return_token_ids"] = True
    start = time.monotonic()
    result = RequestResult(spec.tag, False, start)
    last = start
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    result.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    return result
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = str(chunk["error"].get("message", chunk["error"]))
                        return result
                    if chunk.get("usage"):
                        result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        result.output_tokens = chunk["usage"]["completion_tokens"]
                    choices = chunk.get("choices") or []
                    if token_ids and choices:
                        result.token_ids += choices[0].get("token_ids") or []
                    if choices and (choices[0].get("token_ids") if token_ids else True):
                        now = time.monotonic()
                        if result.ttft is None:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        last = now
                        result.text += choices[0].get("text") or ""

    except TimeoutError:
        result.error = f"no complete answer within {timeout:.0f}s"
        return result
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.monotonic() - start
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "stream ended without any token"
    return result


async def run_requests(url: str, model: str, specs: list[RequestSpec], prompts: list[str], *,
                       max_duration: float, request_timeout: float, token_ids: bool = False,
                       on_done: Callable[[RequestResult], None] | None = None,
                       headers: dict[str, str] | None = None) -> tuple[list[RequestResult], float]:
    """Send each spec at its send_at; stop sending after max_duration. Returns results and wall time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=10.0), limits=limits,
                                 headers=headers or {}) as client:
        start = time.monotonic()

        async def fire(spec: RequestSpec, prompt: str) -> RequestResult:
            delay = spec.send_at - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            remaining = max(1.0, max_duration - (time.monotonic() - start))
            res = await send_one(client, url, model, spec, prompt, min(request_timeout, remaining), token_ids)
            if on_done is not None:
                on_done(res)
            return res

        chosen = [(s, p) for s, p in zip(specs, prompts, strict=True) if s.send_at < max_duration]
        results = await asyncio.gather(*(fire(s, p) for s, p in chosen))
        return list(results), time.monotonic() - start
