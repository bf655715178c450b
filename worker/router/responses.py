"""OpenAI response objects (completions and chat, whole and streamed), as plain dicts."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from tandem.worker.router.tokens import Delta, TextAssembler


@dataclass
class Shape:
    """What kind of answer one request gets."""

    id: str
    model: str
    chat: bool
    logprobs: bool
    token_ids: bool = False  # vLLM's `return_token_ids` extension: ids next to the text
    created: int = 0

    def __post_init__(self) -> None:
        self.created = int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _logprobs(shape: Shape, asm: TextAssembler, delta: Delta) -> dict[str, Any] | None:
    if not shape.logprobs or delta.logprobs is None:
        return None
    tokens = [asm.token_text(t) for t in delta.token_ids]
    if shape.chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(tokens, delta.logprobs, strict=False)]}
    return {"tokens": tokens, "token_logprobs": list(delta.logprobs), "top_logprobs": None, "text_offset": None}


def _merge_logprobs(shape: Shape, parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not shape.logprobs:
        return None
    if shape.chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {"tokens": [t for p in parts for t in p["tokens"]],
            "token_logprobs": [t for p in parts for t in p["token_logprobs"]], "top_logprobs": None,
            "text_offset": None}


def stream_chunk(shape: Shape, asm: TextAssembler, delta: Delta, first: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": _logprobs(shape, asm, delta),
                              "finish_reason": delta.finish_reason}
    if shape.chat:
        d: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta.text or first:
            d["content"] = delta.text
        choice["delta"] = d
        obj = "chat.completion.chunk"
    else:
        choice["text"] = delta.text
        obj = "text_completion"
    if shape.token_ids:
        choice["token_ids"] = list(delta.token_ids)
    return {"id": shape.id, "object": obj, "created": shape.created, "model": shape.model, "choices": [choice]}


def usage_chunk(shape: Shape, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    obj = "chat.completion.chunk" if shape.chat else "text_completion"
    return {"id": shape.id, "object": obj, "created": shape.created, "model": shape.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def full_response(shape: Shape, asm: TextAssembler, deltas: list[Delta], finish_reason: str | None,
                  prompt_tokens: int) -> dict[str, Any]:
    lps = [x for d in deltas if (x := _logprobs(shape, asm, d)) is not None]
    choice: dict[str, Any] = {"index": 0, "logprobs": _merge_logprobs(shape, lps), "finish_reason": finish_reason}
    if shape.chat:
        choice["message"] = {"role": "assistant", "content": asm.text}
        obj = "chat.completion"
    else:
        choice["text"] = asm.text
        obj = "text_completion"
    if shape.token_ids:
        choice["token_ids"] = list(asm.token_ids)
    return {"id": shape.id, "object": obj, "created": shape.created, "model": shape.model, "choices": [choice],
            "usage": usage(prompt_tokens, asm.num_tokens)}


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
