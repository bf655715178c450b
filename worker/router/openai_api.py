"""OpenAI request bodies (with vLLM's extensions that benchmark clients send) and their validation.

Parsing is strict where a wrong value would silently change the answer (types, ranges, n>1,
echo, best_of) and lenient where OpenAI itself is (unknown fields are ignored). Types are JSON's:
a flag must be true/false (null means the default), a number must not be a string or a boolean,
as OpenAI's own API answers; pydantic's lax mode would turn "yes" into true and true into 1.
"""

from __future__ import annotations

import json
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError
from pydantic_core import PydanticCustomError

from tandem.worker.router.errors import APIError, bad_request
from tandem.worker.server.protocol import INT32_MAX, MAX_TEMPERATURE, SEED_MAX, SEED_MIN, Sampling


def _json_number(value: Any) -> Any:
    """Numbers must be JSON numbers: lax pydantic would take "5" or true (1) for an int or a float."""
    if isinstance(value, bool | str):
        raise PydanticCustomError("number_type", "Input should be a number, not a {kind}",
                                  {"kind": "boolean" if isinstance(value, bool) else "string"})
    return value


def _null_is_false(value: Any) -> Any:
    return False if value is None else value


Int = Annotated[int, BeforeValidator(_json_number)]  # 5 and 5.0 pass; "5", true and 5.5 do not
Float = Annotated[float, BeforeValidator(_json_number)]
# true/false only (null: the default, false), never "yes" or 1.
Flag = Annotated[bool, Strict(), BeforeValidator(_null_is_false)]
TokenId = Annotated[int, BeforeValidator(_json_number), Field(ge=0, le=INT32_MAX)]
# A UTF-16 surrogate written as a JSON escape (\ud800-\udfff): json.loads turns a lone one into a str no
# tokenizer can encode. Pairs are fine (an emoji); this only says whether the slower exact check must run.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Roles whose message must carry content (OpenAI: required for system/developer/user/tool; an
# assistant message may leave it out or null when it carries tool_calls, and vLLM accepts that).
CONTENT_REQUIRED = ("system", "developer", "user", "tool")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    include_usage: Flag = False


class _Common(BaseModel):
    # Ranges are the worker's (protocol.Sampling), checked here first so that the client sees a 400 naming
    # the parameter. No NaN or Infinity: json.loads takes both, and they fail no range check downstream.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)  # a tiny one is greedy (the engine's floor)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    top_k: Int = Field(0, ge=-1, le=INT32_MAX)  # vLLM: -1 and 0 both mean off
    min_p: Float = Field(0.0, ge=0.0, le=1.0)
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(None, json_schema_extra={"anyOf": [  # see stop_list
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
        {"type": "null"}]})
    stop_token_ids: list[TokenId] | None = None
    stream: Flag = False
    stream_options: StreamOptions | None = None
    ignore_eos: Flag = False
    # The published schema (the router's /openapi.json) says what _check_unsupported accepts: n=1, best_of 1 or
    # null, no penalties, no echo. Validation stays as it is, so that the 400 names the unsupported feature.
    n: Int = Field(1, ge=1, json_schema_extra={"maximum": 1})
    best_of: Int | None = Field(None, json_schema_extra={"anyOf": [{"const": 1}, {"type": "null"}]})
    return_token_ids: Flag = False  # vLLM extension: token ids in each choice
    presence_penalty: Float = Field(0.0, json_schema_extra={"const": 0})
    frequency_penalty: Float = Field(0.0, json_schema_extra={"const": 0})
    user: str | None = None


class CompletionRequest(_Common):
    # Not empty, and one prompt per request (_check_unsupported).
    prompt: str | list[Int] | list[str] | list[list[Int]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
         "minItems": 1, "maxItems": 1}]})
    logprobs: Int | None = Field(None, ge=0, le=5)
    echo: Flag = Field(False, json_schema_extra={"const": False})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Flag = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)


def parse_body(raw: bytes, model: type[CompletionRequest] | type[ChatRequest]) -> Any:
    data = load_json(raw)
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where, inside_union = _param(model, first["loc"])
        if inside_union:  # e.g. prompt: 5 -> every member of the union failed; name the field, not a member
            raise bad_request(f"invalid type for '{where}': {_union_help(model, where)}", param=where) from None
        raise bad_request(f"invalid value for '{where}': {first['msg']}", param=where) from None
    _check_unsupported(req)
    return req


def load_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 for anything a strict JSON parser refuses and for what Python's takes
    but nothing downstream can use: NaN and Infinity, nesting deeper than the interpreter's recursion
    limit (a RecursionError, which was a 500), and lone surrogates (a 500 in the tokenizer)."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    if SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(data):
        raise bad_request("request body has a lone UTF-16 surrogate escape (\\ud800-\\udfff): not a character")
    return data


def _no_constant(name: str) -> Any:
    raise bad_request(f"request body is not valid JSON: {name} is not a JSON number")


def _has_lone_surrogate(data: Any) -> bool:
    """Whether any string in the parsed body holds a surrogate json.loads left unpaired. Iterative: the
    body's nesting is whatever json.loads accepted, close to the interpreter's recursion limit."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _param(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[str | None, bool]:
    """The request parameter an error is about ("messages.0.role", "prompt"), and whether the error's
    location went on into a member of a union (pydantic names those "str", "list[int]", ...)."""
    parts: list[str] = []
    current: type[BaseModel] | None = model
    for item in loc:
        if isinstance(item, int):
            parts.append(str(item))
            continue
        if current is None or item not in current.model_fields:
            return ".".join(parts) or None, True
        parts.append(item)
        current = _model_in(current.model_fields[item].annotation)
    return ".".join(parts) or None, False


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The request model inside an annotation such as `list[ChatMessage]` or `StreamOptions | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if (found := _model_in(arg)) is not None:
                return found
    return None


def _union_help(model: type[BaseModel], where: str | None) -> str:
    if where == "prompt":
        return "expected a string, a list of token ids, or a one-element list of either"
    if where == "stop":
        return "expected a string or a list of strings"
    if where is not None and where.endswith(".content"):
        return "expected a string or a list of content parts"
    return "wrong type"


def _check_unsupported(req: CompletionRequest | ChatRequest) -> None:
    if req.n != 1:
        raise bad_request("only n=1 is supported", param="n")
    if req.best_of not in (None, 1):
        raise bad_request("best_of is not supported (only best_of=1)", param="best_of")
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
        if content is None and msg.role in CONTENT_REQUIRED:
            raise bad_request(f"messages[{i}]: a {msg.role} message needs content (a string or a list of "
                              "content parts)", param=f"messages.{i}.content")
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
