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
    tops = delta.top_logprobs or [[] for _ in tokens]
    if shape.chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [_chat_entry(asm, tid, tlp) for tid, tlp in top]}
                            for t, lp, top in zip(tokens, delta.logprobs, tops, strict=False)]}
    # Completions list each token's alternatives as {text: logprob}, as OpenAI's legacy API does (tokens
    # that decode to the same text share a key), or null for logprobs=0.
    top_lists = [_by_text(asm, top) for top in tops] if delta.top_logprobs else None
    return {"tokens": tokens, "token_logprobs": list(delta.logprobs), "top_logprobs": top_lists, "text_offset": None}


def _by_text(asm: TextAssembler, top: list[tuple[int, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for token_id, logprob in top:  # best first: a text keeps its best token's logprob
        out.setdefault(asm.token_text(token_id), logprob)
    return out


def _chat_entry(asm: TextAssembler, token_id: int, logprob: float) -> dict[str, Any]:
    text = asm.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _merge_logprobs(shape: Shape, parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not shape.logprobs:
        return None
    if shape.chat:
        return {"content": [c for p in parts for c in p["content"]]}
    tops = [p["top_logprobs"] for p in parts]
    return {"tokens": [t for p in parts for t in p["tokens"]],
            "token_logprobs": [t for p in parts for t in p["token_logprobs"]],
            "top_logprobs": [t for top in tops for t in top] if tops and all(t is not None for t in tops) else None,
            "text_offset": None}


def stream_chunk(shape: Shape, asm: TextAssembler, delta: Delta, first: bool, index: int = 0) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "logprobs": _logprobs(shape, asm, delta),
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


def merge_choices(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """n answers to one prompt (full_response each) as one answer with n choices: the first one's id,
    choices indexed 0..n-1, the prompt counted once and the completions' tokens summed."""
    merged = dict(answers[0])
    merged["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    merged["usage"] = usage(answers[0]["usage"]["prompt_tokens"], completion)
    return merged


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
