"""vLLM's /tokenize and /detokenize (request and response shapes as vLLM's), and /version.

Tokenizing uses the router's tokenizer and chat template, the same ones a completion or a chat
request goes through, so `count` is the prompt_tokens that request would be charged.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.worker.model.tokenizer import Tokenizer
from tandem.worker.router.errors import bad_request
from tandem.worker.router.openai_api import ChatMessage, Flag, TokenId, chat_messages, load_json
from tandem.worker.router.tokens import encode


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: Flag = True
    return_token_strs: Flag = False


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: Flag = False  # the template writes them
    return_token_strs: Flag = False


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]


def parse(raw: bytes, model: type[BaseModel]) -> Any:
    data = load_json(raw)
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    if model is TokenizeCompletion and "messages" in data:
        model = TokenizeChat
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise bad_request(f"invalid value for '{where}': {first['msg']}", param=where) from None


def tokenize(req: TokenizeCompletion | TokenizeChat, tok: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """Runs in a worker thread: a long prompt takes seconds to encode."""
    if isinstance(req, TokenizeChat):
        try:
            text = tok.apply_chat_template(chat_messages(req), add_generation_prompt=req.add_generation_prompt)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
    else:
        text = req.prompt
    ids = encode(tok, text, add_special_tokens=req.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
    return out


def detokenize(req: Detokenize, tok: Tokenizer) -> dict[str, Any]:
    if any(t >= tok.vocab_size for t in req.tokens):
        raise bad_request(f"token ids must be in 0..{tok.vocab_size - 1}", "tokens")
    return {"prompt": tok.decode(list(req.tokens), skip_special_tokens=False)}


def version() -> dict[str, str]:
    try:
        return {"version": importlib.metadata.version("tandem-serving")}
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return {"version": "unknown"}
