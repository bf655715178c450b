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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: the prompt tokens a prefix cache served (prompt_tokens_details), when
    the workers said (None: a worker before control API 5 answered)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


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
    top_lists: list[dict[str, float] | None] | None = [_by_text(asm, top) for top in tops] if delta.top_logprobs else None
    return _completion_logprobs(asm, tokens, list(delta.logprobs), top_lists)


def _completion_logprobs(asm: TextAssembler, tokens: list[str], logprobs: list[float | None],
                         tops: list[dict[str, float] | None] | None) -> dict[str, Any]:
    """Completions' logprobs object; text_offset: where each token starts in the choice's text (its
    tokens' texts laid end to end, as vLLM counts them), continued from the tokens listed before."""
    offsets = []
    for token in tokens:
        offsets.append(asm.offset)
        asm.offset += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _echo_logprobs(shape: Shape, asm: TextAssembler) -> dict[str, Any] | None:
    """Echo: the prompt's tokens with their logprobs (the first token has none, as in OpenAI's and vLLM's
    answers), listed before the generated tokens'."""
    if not shape.logprobs or asm.echo is None or asm.prompt_logprobs is None:
        return None
    tokens = [asm.token_text(t) for t in asm.prompt_ids]
    tops: list[dict[str, float] | None] | None = None
    if asm.prompt_top_logprobs is not None:
        tops = [None, *(_by_text(asm, top) for top in asm.prompt_top_logprobs)]
    return _completion_logprobs(asm, tokens, [None, *asm.prompt_logprobs], tops)


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
            "text_offset": [t for p in parts for t in p["text_offset"]]}


def stream_chunk(shape: Shape, asm: TextAssembler, delta: Delta, first: bool, index: int = 0) -> dict[str, Any]:
    echo = first and asm.echo is not None  # the first chunk of an echo starts with the prompt
    if echo:
        parts = [p for p in (_echo_logprobs(shape, asm), _logprobs(shape, asm, delta)) if p is not None]
        logprobs = _merge_logprobs(shape, parts) if parts else None
    else:
        logprobs = _logprobs(shape, asm, delta)
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": delta.finish_reason}
    if shape.chat:
        d: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta.text or first:
            d["content"] = delta.text
        choice["delta"] = d
        obj = "chat.completion.chunk"
    else:
        choice["text"] = (asm.echo or "") + delta.text if echo else delta.text
        obj = "text_completion"
    if shape.token_ids:
        choice["token_ids"] = list(delta.token_ids)
    return {"id": shape.id, "object": obj, "created": shape.created, "model": shape.model, "choices": [choice]}


def usage_chunk(shape: Shape, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int | None = None) -> dict[str, Any]:
    obj = "chat.completion.chunk" if shape.chat else "text_completion"
    return {"id": shape.id, "object": obj, "created": shape.created, "model": shape.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def full_response(shape: Shape, asm: TextAssembler, deltas: list[Delta], finish_reason: str | None,
                  prompt_tokens: int) -> dict[str, Any]:
    echoed = _echo_logprobs(shape, asm)
    lps = ([echoed] if echoed is not None else []) + [x for d in deltas if (x := _logprobs(shape, asm, d)) is not None]
    choice: dict[str, Any] = {"index": 0, "logprobs": _merge_logprobs(shape, lps), "finish_reason": finish_reason}
    if shape.chat:
        choice["message"] = {"role": "assistant", "content": asm.text}
        obj = "chat.completion"
    else:
        choice["text"] = (asm.echo or "") + asm.text
        obj = "text_completion"
    if shape.token_ids:
        choice["token_ids"] = list(asm.token_ids)
    return {"id": shape.id, "object": obj, "created": shape.created, "model": shape.model, "choices": [choice],
            "usage": usage(prompt_tokens, asm.num_tokens, asm.num_cached_tokens)}


def merge_choices(answers: list[dict[str, Any]], prompt_tokens: int | None = None,
                  cached_tokens: int | None = None) -> dict[str, Any]:
    """n answers to one prompt (full_response each) as one answer with n choices: the first one's id,
    choices indexed 0..n-1, the prompt counted once (or `prompt_tokens`: a batch's prompts, each once; and
    `cached_tokens`, theirs) and the completions' tokens summed."""
    merged = dict(answers[0])
    merged["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    if prompt_tokens is None:
        prompt_tokens = answers[0]["usage"]["prompt_tokens"]
        cached_tokens = answers[0]["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
    merged["usage"] = usage(prompt_tokens, completion, cached_tokens)
    return merged


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
