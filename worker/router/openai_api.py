"""OpenAI request bodies (with vLLM's extensions that benchmark clients send) and their validation.

Parsing is strict where a wrong value would silently change the answer (types, ranges, n>1,
echo) and lenient where OpenAI itself is (unknown fields are ignored).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.worker.router.errors import APIError, bad_request
from tandem.worker.server.protocol import Sampling


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # vLLM: -1 and 0 both mean off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    return_token_ids: bool = False  # vLLM extension: token ids in each choice
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def parse_body(raw: bytes, model: type[CompletionRequest] | type[ChatRequest]) -> Any:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"invalid value for '{where}': {first['msg']}", param=where) from None
    _check_unsupported(req)
    return req


def _check_unsupported(req: CompletionRequest | ChatRequest) -> None:
    if req.n != 1:
        raise bad_request("only n=1 is supported", param="n")
    if req.presence_penalty or req.frequency_penalty:
        raise bad_request("presence_penalty and frequency_penalty are not supported", param="presence_penalty")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise bad_request("echo is not supported", param="echo")
        if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
            if len(req.prompt) != 1:
                raise bad_request("only one prompt per request is supported", param="prompt")
            req.prompt = req.prompt[0]
        if req.prompt in ("", []):
            raise bad_request("prompt must not be empty", param="prompt")


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", param="stop")
    if len(stops) > 16:
        raise bad_request("at most 16 stop strings are supported", param="stop")
    return stops


def sampling_from(req: CompletionRequest | ChatRequest, max_tokens: int, want_logprobs: bool) -> Sampling:
    return Sampling(
        max_tokens=max_tokens, temperature=req.temperature, top_k=max(0, req.top_k), top_p=req.top_p,
        min_p=req.min_p, seed=req.seed, stop=stop_list(req.stop), stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos, logprobs=want_logprobs)


def chat_messages(req: ChatRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template; content parts must be text."""
    out = []
    for i, msg in enumerate(req.messages):
        content = msg.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content: only text parts are supported",
                                      param=f"messages.{i}.content")
                texts.append(part["text"])
            content = "".join(texts)
        out.append({"role": msg.role, "content": content or ""})
    return out


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, default: int | None) -> int:
    if prompt_len >= max_model_len:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's maximum context length is "
                       f"{max_model_len} tokens", param="prompt", code="context_length_exceeded")
    room = max_model_len - prompt_len
    if requested is None:
        return min(room, default) if default is not None else room
    if requested > room:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the request has "
                       f"{prompt_len} prompt tokens and asks for {requested} more", param="max_tokens",
                       code="context_length_exceeded")
    return requested
